"""The machine llmgw runs on: what its OS is, its package manager, a bounded command.

Shared by the agent (an engine's OS packages, its `ldd` and `--version`) and
`llmgw-cp init-postgres` (PostgreSQL from the same package manager), so it
belongs to neither. Three public modules, imported by name:

- `llmgw.host.os_release`: `parse_os_release`, os-release(5) to `OsRelease` (pure);
- `llmgw.host.packages`: `family` (os-release to "debian", "rhel", "suse") and
  `PackageInstaller`, the node's own package manager (trio);
- `llmgw.host.run`: `run_bounded`, one short command killed whole at its deadline (trio).

This `__init__` imports none of them, so the agent's discovery can parse
os-release without bringing trio in.
"""

__all__: list[str] = []

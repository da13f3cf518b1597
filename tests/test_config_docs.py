"""docs/configuration.md names every key each config file takes, and only those.

The loaders refuse unknown keys (cattrs, forbid_extra_keys), so a key the reference
lists but the code lacks is one an operator is told to write and is then refused
for; a key the code takes but the reference leaves out is one nobody can find.
"""

from __future__ import annotations

import re

import attrs
import pytest
from helpers import REPO

from llmgw import config
from llmgw.router._main import RouterFile
from llmgw.router._router import RouterConfig

DOC = REPO / "docs" / "configuration.md"


def sections() -> dict[str, str]:
    """Heading text -> its body, for every heading of the document."""
    parts = re.split(r"^#+ (.*)$", DOC.read_text(), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def keys(heading_start: str) -> set[str]:
    """The top-level keys of one section's table: its rows' first column, each name
    in backticks (`tls.ca`, `tls.cert` is the key `tls`)."""
    (body,) = [b for h, b in sections().items() if h.startswith(heading_start)]
    out = set()
    for line in body.splitlines():
        first = re.match(r"^\| (`[^|]*`) \|", line)
        if first is not None:
            for name in re.findall(r"`([^`]+)`", first.group(1)):
                out.add(name.split(".", 1)[0])
    return out


def fields(cls: type) -> set[str]:
    return {f.name for f in attrs.fields(cls)}


@pytest.mark.parametrize(
    ("heading", "cls"),
    [
        ("agent.yaml", config.AgentConfig),
        ("server.yaml", config.ServerConfig),
        ("Router settings", RouterConfig),
        ("router.yaml", RouterFile),
        ("ctl.yaml", config.CtlConfig),
    ],
)
def test_the_reference_lists_exactly_the_keys_the_loader_takes(heading: str, cls: type) -> None:
    documented, taken = keys(heading), fields(cls)
    assert documented - taken == set(), f"{heading}: documented, but refused as unknown"
    assert taken - documented == set(), f"{heading}: taken, but not in the reference"


def test_nested_keys_are_the_nested_classes_fields() -> None:
    (server,) = [b for h, b in sections().items() if h.startswith("server.yaml")]
    mirror = set(re.findall(r"`mirror\.([a-z_]+)`", server))
    assert mirror == fields(config.MirrorConfig)
    for heading in ("agent.yaml", "server.yaml"):
        (body,) = [b for h, b in sections().items() if h.startswith(heading)]
        assert set(re.findall(r"`tls\.([a-z_]+)`", body)) == fields(config.TlsFiles), heading

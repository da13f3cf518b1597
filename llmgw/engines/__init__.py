"""Engine adapters: a profile and an assignment in, the exact processes to run out.

Pure: no I/O, no trio, no subprocess. The agent's supervisor performs a
`LaunchPlan`; `llmgw ctl engine-check` checks `widest_command` against the
engine's `--help` with `check_flags`; the scraper reads `metric_names`. LoRA
adapters: `adapter_api` (a load or unload as an `HttpCall`), `adapter_request`
(a request in the engine's form), `listed_adapters` (what its listing says).
A share of a card: `EngineProfile.gpu_memory_fraction`, from `memory_fraction`.
"""

from llmgw.engines._adapters import (
    AdapterApi,
    adapter_api,
    adapter_request,
    listed_adapters,
)
from llmgw.engines._flags import check_flags, help_warnings
from llmgw.engines._load import EngineLoad, parse_load, parse_samples, slots_usage
from llmgw.engines._memory import memory_fraction
from llmgw.engines._plan import help_commands, metric_names, plan_launch, widest_command
from llmgw.engines._probe import PROBE_HEADER, PROBE_PATH, generates, probe_body
from llmgw.engines._types import (
    ENGINES,
    Assignment,
    EngineConfigError,
    EngineName,
    EngineProfile,
    FlagCheck,
    HttpCall,
    LaunchAdapter,
    LaunchPlan,
    MetricNames,
    MultinodeMode,
    ProcessRole,
    ProcessSpec,
)
from llmgw.engines._validate import validate

__all__ = [
    "ENGINES",
    "PROBE_HEADER",
    "PROBE_PATH",
    "AdapterApi",
    "Assignment",
    "EngineConfigError",
    "EngineLoad",
    "EngineName",
    "EngineProfile",
    "FlagCheck",
    "HttpCall",
    "LaunchAdapter",
    "LaunchPlan",
    "MetricNames",
    "MultinodeMode",
    "ProcessRole",
    "ProcessSpec",
    "adapter_api",
    "adapter_request",
    "check_flags",
    "generates",
    "help_commands",
    "help_warnings",
    "listed_adapters",
    "memory_fraction",
    "metric_names",
    "parse_load",
    "parse_samples",
    "plan_launch",
    "probe_body",
    "slots_usage",
    "validate",
    "widest_command",
]

"""A shard relaunched with other LoRA adapters, and the argv its sources become: pure.

llama-server cannot load an adapter at run time, so a replica of it changes the
adapters it holds by being stopped and started again with another list
(`relaunchShard`). Everything else about the shard stays: the same id, port,
cards, replica and model, so the control plane, the router and the node's
accounting see the same replica come back. The processes' argv name the
adapters (`--lora-scaled SOURCE:0` per adapter), so they change with them, and
only so: apart from the elements that name an adapter source (old or new) and
the flag just before each, every argv stays as it was, and so does the rest of
each process. `relaunch_refusal` says, naming the fields, when a new spec is
more than that.

`local_argv` is what the supervisor spawns once the sources are ready on the
node: every argv element equal to a source is its local path, and every
element starting with a source and ":" is the local path and the rest
(llama-server's `--lora-scaled PATH:SCALE`). An element equal to a source wins
over a longer one's prefix; among prefixes, the longest source wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from llmgw.model import ProcessSpec, ShardSpec

# What a relaunch may change: the adapters the shard holds, and where they come from.
RELAUNCH_MAY_CHANGE = frozenset({"adapters", "adapter_sources"})


def relaunch_refusal(current: ShardSpec, new: ShardSpec) -> str | None:
    """Why `new` cannot replace `current` by a relaunch (one line naming every field
    that differs and may not, with both values); None when it can."""
    sources = (*current.adapter_sources, *new.adapter_sources)
    shown = {
        f.name: (getattr(current, f.name), getattr(new, f.name))
        for f in attrs.fields(ShardSpec)
        if f.name not in RELAUNCH_MAY_CHANGE
    }
    shown["processes"] = (
        _apart_from_adapters(current.processes, sources),
        _apart_from_adapters(new.processes, sources),
    )
    differ = [name for name, (was, now) in shown.items() if was != now]
    was, now = shown["processes"]
    if [p.argv for p in was] != [p.argv for p in now]:  # the argv is what differs: show it
        shown["processes"] = ([p.argv for p in was], [p.argv for p in now])
    problems = []
    if differ:
        named = "; ".join(
            f"{name} {_shown(shown[name][0])} -> {_shown(shown[name][1])}" for name in differ
        )
        problems.append(
            f"a relaunch changes only adapters and adapter_sources, and this one changes "
            f"{named} (start a new shard for that)"
        )
    if len(new.adapters) != len(new.adapter_sources):
        problems.append(
            f"{len(new.adapters)} adapters but {len(new.adapter_sources)} adapter sources "
            "(one source per adapter, in the same order)"
        )
    return "; ".join(problems) or None


def _apart_from_adapters(
    processes: Sequence[ProcessSpec], sources: Sequence[str]
) -> tuple[ProcessSpec, ...]:
    """Each process with the argv elements that name an adapter source, and the flag
    just before each, left out."""
    return tuple(attrs.evolve(p, argv=_without_sources(p.argv, sources)) for p in processes)


def _without_sources(argv: Sequence[str], sources: Sequence[str]) -> tuple[str, ...]:
    def names_one(element: str) -> bool:
        return any(element == s or element.startswith(s + ":") for s in sources)

    kept: list[str] = []
    for element in argv:
        if names_one(element):
            if kept and kept[-1].startswith("-"):
                kept.pop()  # its flag: --lora-scaled, --lora
            continue
        kept.append(element)
    return tuple(kept)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def local_argv(argv: Sequence[str], local: Mapping[str, str]) -> list[str]:
    """`argv` with each source (a key of `local`) replaced by its local path, whole or
    as the part before ":"."""
    by_length = sorted(local, key=len, reverse=True)
    out = []
    for element in argv:
        path = local.get(element)
        if path is None:
            for source in by_length:
                if element.startswith(source + ":"):
                    path = local[source] + element[len(source) :]
                    break
        out.append(element if path is None else path)
    return out

"""A llama-server on a shared card, held to its share where llama-server allows it.

llama-server has no flag that caps its memory. What it has is `--fit` (on by default):
it sizes the arguments left unset (context, layers offloaded) to the device memory free
at its start, less `--fit-target` MiB per device, a margin (default 1024). So a margin of
(free now - share) holds it to its share at start: the agent reads each card's free
memory just before the launch and sets `LLAMA_ARG_FIT_TARGET` (llama-server's own
environment form of `--fit-target`), one value per card in CUDA_VISIBLE_DEVICES' order.
An operator's `--ctx-size` (or `--fit off`) in engine_args wins: fit adjusts only what is
unset. A reading that fails sets nothing (llama-server's own default margin), said in
the log. What the engine grows to after its start is the memory watch's
(llmgw/core/_card_memory.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import trio

log = logging.getLogger("llmgw.agent.fit")

FIT_ENV = "LLAMA_ARG_FIT_TARGET"
QUERY_TIMEOUT_S = 10.0


def fit_target(free_mib: Mapping[str, int], gpus: Sequence[str], share_mib: int) -> str | None:
    """`--fit-target`'s value for a share of `share_mib` on each of `gpus` (UUIDs), given
    each card's free MiB now; None when a card's free memory is not known."""
    if not gpus or any(u not in free_mib for u in gpus):
        return None
    return ",".join(str(max(0, free_mib[u] - share_mib)) for u in gpus)


def parse_free(text: str) -> dict[str, int]:
    """`uuid, memory.free` lines (csv, noheader, nounits) -> uuid: MiB; lines that do not
    parse are left out (their card is then unknown)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


async def fit_env(gpus: Sequence[str], share_mib: int) -> dict[str, str]:
    """The environment that holds a llama-server to `share_mib` on each of `gpus`."""
    query = ["nvidia-smi", "--query-gpu=uuid,memory.free", "--format=csv,noheader,nounits"]
    try:
        with trio.fail_after(QUERY_TIMEOUT_S):
            done = await trio.run_process(query, capture_stdout=True, capture_stderr=True,
                                          check=False)  # fmt: skip
    except (OSError, trio.TooSlowError) as exc:
        log.warning("llama-server share of %d MiB: free memory not read (%s)", share_mib, exc)
        return {}
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[:200]
        log.warning("llama-server share of %d MiB: nvidia-smi said %s", share_mib, why)
        return {}
    target = fit_target(parse_free(done.stdout.decode(errors="replace")), gpus, share_mib)
    if target is None:
        log.warning("llama-server share of %d MiB: %s not in nvidia-smi's list", share_mib, gpus)
        return {}
    return {FIT_ENV: target}


__all__ = ["FIT_ENV", "fit_env", "fit_target", "parse_free"]

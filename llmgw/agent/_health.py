"""A shard's health, watched: how often, how long each check may take, what passes.

A shard that serves HTTP is checked by `/health` answering 200 and
`/v1/models` listing one of its served names, and, when it generates (not an
embedding-only engine: llmgw/engines/_probe.py), by a one-token generation
answered within `probe_timeout_s`: before it is first reported ready, then at
most every `probe_interval_s` while ready, and at every check after one that
failed (so `failures` failed generations in a row make it unhealthy, each
named in the reason). `/health` alone passes an engine that is wedged (a CUDA
hang); a generation does not. Each observation goes through
the shard's `HealthRun` (llmgw.core), which turns it into the event the
supervisor applies. A rank that serves no HTTP is judged by staying alive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import trio

from llmgw import engines, model
from llmgw.agent import _shard_logs
from llmgw.agent._shard import Shard
from llmgw.core import ShardEvent
from llmgw.model import ShardState

# Part of the supervisor, as operators know it.
log = logging.getLogger("llmgw.agent.supervisor")


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be a positive number, got {value}")


@attrs.frozen
class HealthPolicy:
    """How a shard's health is watched.

    `poll_s` while it loads (how soon it is seen ready), `interval_s` once it
    has been ready, each check bounded by `timeout_s`; `failures` checks in a
    row that fail make a ready shard unhealthy.
    """

    interval_s: float = attrs.field(default=5.0, validator=_positive)
    poll_s: float = attrs.field(default=1.0, validator=_positive)
    timeout_s: float = attrs.field(default=5.0, validator=_positive)
    failures: int = attrs.field(default=3, validator=_positive)
    probe_interval_s: float = attrs.field(default=30.0, validator=_positive)
    probe_timeout_s: float = attrs.field(default=30.0, validator=_positive)


DEFAULT_POLICY = HealthPolicy()


async def watch(
    shard: Shard, policy: HealthPolicy, apply: Callable[[Shard, ShardEvent], None]
) -> None:
    """Check `shard` until cancelled, applying each observation's event; cuts its logs too."""
    spec = shard.spec
    if not spec.serves_http or spec.port is None:
        # A rank that serves no HTTP is judged by staying alive.
        await trio.sleep(2.0)
        apply(shard, ShardEvent.HEALTHY)
        return
    base = f"http://127.0.0.1:{spec.port}"
    names = set(spec.served_names) | {spec.model}
    asked = _probe_name(spec)
    probed_at: float | None = None  # the last generation that passed; None: none yet
    async with httpx.AsyncClient(base_url=base, timeout=policy.timeout_s) as client:
        while True:
            failure: str | None = f"timed out after {policy.timeout_s:g} s"
            with trio.move_on_after(policy.timeout_s):
                failure = await check(client, spec, names, policy.timeout_s)
            now = trio.current_time()
            due = probed_at is None or now - probed_at >= policy.probe_interval_s
            if failure is None and asked is not None and due:
                failure = await probe(client, asked, policy.probe_timeout_s)
                probed_at = trio.current_time() if failure is None else None
            event = shard.health.observe(failure)
            if failure is not None and event is not ShardEvent.CHECK_FAILED:
                log.debug("shard %s: health check failed: %s", spec.shard_id, failure)
            apply(shard, event)
            _shard_logs.cut_logs(shard)
            loading = shard.state is ShardState.LOADING
            poll = min(policy.poll_s, policy.interval_s)
            await trio.sleep(poll if loading else policy.interval_s)


def _probe_name(spec: model.ShardSpec) -> str | None:
    """The served name a generation probe asks for; None: the shard generates nothing."""
    argv = [a for p in spec.processes if p.role == "engine" for a in p.argv]
    if not engines.generates(spec.engine, argv):
        return None
    return spec.served_names[0] if spec.served_names else spec.model


async def probe(client: httpx.AsyncClient, name: str, timeout_s: float) -> str | None:
    """One token generated within `timeout_s`: None when it was, else what went wrong."""
    what = f"a one-token generation (POST {engines.PROBE_PATH})"
    try:
        with trio.fail_after(timeout_s):
            answer = await client.post(
                engines.PROBE_PATH,
                content=engines.probe_body(name),
                headers={
                    "content-type": "application/json",
                    engines.PROBE_HEADER.decode(): "1",
                },
                timeout=timeout_s,
            )
    except (trio.TooSlowError, httpx.TimeoutException):
        return f"{what} did not answer within {timeout_s:g} s"
    except httpx.HTTPError as exc:
        return f"{what} failed: {type(exc).__name__}: {exc}"
    if answer.status_code != 200:
        return f"{what} answered {answer.status_code}: {answer.text[:200]}"
    return None


async def check(
    client: httpx.AsyncClient, spec: model.ShardSpec, names: set[str], timeout_s: float
) -> str | None:
    """One health check: None when it passed, else what went wrong, in a few words."""
    try:
        health = await client.get(spec.health_path)
        if health.status_code != 200:
            return f"{spec.health_path} answered {health.status_code}"
        listed = await client.get(spec.models_path)
        ids = {m.get("id") for m in listed.json().get("data", [])}
    except httpx.TimeoutException:
        return f"timed out after {timeout_s:g} s"
    except httpx.ConnectError as exc:
        text = str(exc)
        return f"cannot connect to port {spec.port}" + (
            " (connection refused)" if "refused" in text.lower() else f" ({text})"
        )
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    except (ValueError, AttributeError):
        return f"{spec.models_path} did not answer an OpenAI model list"
    if not ids & names:
        return f"{spec.models_path} lists none of {sorted(names)}"
    return None

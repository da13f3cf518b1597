"""Why an endpoint would be chosen now: the explanation, for the admin key only.

A request with `x-llmgw-explain: 1` from the admin key, or the control plane's
`POST /api/v1/route` (`llmgw ctl route`), gets the decision the router would
make now as JSON (`object: llmgw.route_explanation`), every figure named and
unknown ones null. Nothing is admitted, sent or recorded; an exact tie is
broken with a fixed seed.
"""

from __future__ import annotations

import hashlib
import hmac
import random
from collections.abc import Iterable
from typing import Any

import trio

from llmgw.core import Decision, TrafficChoice, explain, route
from llmgw.router import _surface
from llmgw.router._adapters import AdapterRoute
from llmgw.router._fleet import Fleet, Model
from llmgw.router._record import Prompt

EXPLAIN_HEADER = b"x-llmgw-explain"


class AdminKey:
    """Who may ask: the holder of the admin key (None: nobody)."""

    def __init__(self, admin_key: str | None) -> None:
        self._digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None

    def __repr__(self) -> str:
        return f"<AdminKey {'set' if self._digest is not None else 'none'}>"

    def check(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Raise the 403 unless the request carries the admin key."""
        token = _surface.api_key(headers)
        header = EXPLAIN_HEADER.decode()
        if self._digest is None:
            raise _surface.explain_without_admin_key(header)
        if not token or not hmac.compare_digest(
            hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest(), self._digest
        ):
            raise _surface.explain_not_admin(header)


def explanation(
    fleet: Fleet, name: str, prompt: Prompt | None, affinity: str | None = None
) -> dict[str, Any]:
    """The decision for a request to the model `name` now, as JSON; 404 for an unknown one.
    A traffic split's name is explained for a version drawn as a request's would be
    (its `model` says which)."""
    split = fleet.traffic().get(name)
    if split is not None:
        served = fleet.serving(v.served for v in split.versions)
        drawn = route(split, u=fleet.draw(), available=served)
        if isinstance(drawn, TrafficChoice):  # no pin asked: always a choice
            name = drawn.version.served
    model = fleet.models().get(name)
    if model is None:
        raise _surface.unknown_model(name)
    now = trio.current_time()
    # A quarantined endpoint (wedged, llmgw/router/_wedge.py) is no candidate; said apart.
    open_ = [s for s in model.endpoints if s.quarantine is None]
    loads, _ = fleet.loads(open_, model, prompt, now)
    decision = explain(
        loads,
        model.estimate(prompt),
        now,
        random.Random(0),
        fleet.scoring,
        affinity,
        rotation=model.rotation,
    )
    answer = decision_json(name, decision, prompt, fleet.config.prefix_block_bytes)
    answer["quarantined"] = {
        s.endpoint.endpoint_id: s.quarantine.reason for s in model.endpoints if s.quarantine
    }
    route_ = fleet.adapters().get(name)
    if route_ is not None:
        answer["adapter"] = adapter_json(name, route_, model)
    return answer


def adapter_json(name: str, route_: AdapterRoute, model: Model) -> dict[str, Any]:
    """For an adapter: the replicas of its base that hold it (the only candidates), the
    loads in flight, and whether a request now triggers one (none holds it: it waits
    on the adapter's hold, and the leader loads it where its plan says)."""
    holders = sorted(s.endpoint.endpoint_id for s in model.endpoints)
    if holders:
        words = f"held by {', '.join(holders)}: a request goes to one of them, no load"
    elif route_.loading:
        words = f"held by none; loading on {', '.join(route_.loading)}: a request waits for it"
    else:
        words = f"held by none: a request waits and makes the control plane load {name}"
    return {
        "base": route_.base,
        "held_by": holders,
        "loading_on": list(route_.loading),
        "triggers_load": not holders and not route_.loading,
        "reason": words,
    }


def decision_json(
    model: str, decision: Decision, prompt: Prompt | None, block_bytes: int
) -> dict[str, Any]:
    """An explanation as JSON: every figure named, unknown ones null."""
    per_token = decision.request
    return {
        "object": "llmgw.route_explanation",
        "model": model,
        "policy": decision.policy,
        "chosen": decision.chosen,
        "reason": decision.reason,
        "bound": {
            "epsilon": decision.epsilon,
            "max_requests_per_endpoint": decision.capacity,
            "average_load": decision.average_load,
        },
        "request": {
            "prompt_bytes": None if prompt is None else len(prompt.text),
            "prompt_blocks": None if prompt is None else len(prompt.blocks),
            "block_bytes": block_bytes,
            "estimated_prompt_tokens": per_token.prompt_tokens,
            "expected_output_tokens": per_token.output_tokens,
            "decode_cost": per_token.decode_cost,
        },
        "candidates": [
            {
                "endpoint": c.endpoint_id,
                "healthy": c.healthy,
                "breaker_allows": c.allowed,
                "within_bound": c.within_bound,
                "load": c.load,
                "in_flight": c.in_flight,
                "cached_tokens": c.cached_tokens,
                "uncached_tokens": c.uncached_tokens,
                "pending_prefill_tokens": c.pending_prefill,
                "pending_decode_tokens": c.pending_decode,
                "queued_work_tokens": c.queued,
                "external_requests": c.external,
                "scraped": {
                    "running": c.running,
                    "waiting": c.waiting,
                    "kv_usage": c.kv_usage,
                    "age_s": c.scrape_age_s,
                },
                "cost": c.cost,
            }
            for c in decision.candidates
        ],
    }

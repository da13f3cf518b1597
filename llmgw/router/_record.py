"""One request: what the client asked (`Ask`, `Prompt`) and how it went (`Record`).

The listener (llmgw/router/_router.py) parses the request into an `Ask`, a
frozen value the attempt loop (llmgw/router/_attempt.py) reads and never
changes. Both fill in the request's `Record` as it goes, each its own fields
(below), and the router reads the record once, when the request has ended
however it ended: for the request metrics (`RouterMetrics.finished`) and for
the tenant's meter.
"""

from __future__ import annotations

import attrs

from llmgw.core import ResumePlan
from llmgw.router import _surface


@attrs.frozen
class Prompt:
    """A request's prompt as the prefix index sees it."""

    text: bytes  # the canonical rendering (_surface.prompt_bytes)
    blocks: tuple[int, ...]  # its chain hashes; empty when the policy does not use them
    max_tokens: int | None


@attrs.frozen
class Ask:
    """An inference request as parsed: what is sent to the engine, and how."""

    path: str
    body: bytes  # as the client sent it (a traffic split's served name put in)
    content_type: bytes  # what the engine is sent (a form's, with its boundary)
    stream: bool
    prompt: Prompt | None  # None: a route with no prompt (embeddings, audio, ...)
    affinity: str | None  # the affinity header's value, when configured and sent
    # The body that also asks for the stream's usage event, for an engine that says its
    # tokens only when asked (llmgw/core/_metering.py); None: the client asked itself,
    # or the route and request have no such event.
    usage_body: bytes | None
    # A stream's continuation after a cut: whether it may be, and what to extend.
    resume: ResumePlan | None = None


@attrs.define(slots=True)
class Record:
    """What one request did, filled in as it goes; read once when it ends."""

    # The listener's: the route's error shape, and who asked for what.
    errors: _surface.ErrorShape = "openai"
    model: str = ""  # a served name the router knows, or "" (metrics labels stay bounded)
    band: str = ""
    # Set once the request passed its tenant's limits: from then on it is metered.
    tenant: str | None = None
    key_id: str = ""
    # Both's: the status answered (499: the client left first), and how far the answer got.
    status: int = 0
    responded: bool = False  # the head has gone to the client: an error now is too late
    complete: bool = False  # the last byte is being sent: a disconnect now is no news
    client_gone: bool = False
    # The listener's: when the request arrived (the trio clock; None: not noted).
    arrived: float | None = None
    # The attempt loop's: time to the first streamed chunk, and the relayed answer's
    # usage (None: not said).
    ttft: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

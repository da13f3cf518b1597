"""One attempt at an endpoint, as a table: (phase, outcome) -> (breaker event, retry?).

The router's attempt loop (llmgw/router/_attempt.py) sends a request to the
endpoint it chose, and each thing that can happen to it is an `AttemptPhase`
(how far the attempt got) and an `AttemptOutcome` (how that part ended).
`ATTEMPT_VERDICTS` says what the endpoint's breaker (llmgw/core/_breaker.py)
is told and whether another endpoint is tried; the loop does the I/O and
follows the table. Every pair has
a verdict (the table's length is asserted), so no outcome can go untold.

| phase \\ outcome | failed           | succeeded | cancelled |
|-----------------|------------------|-----------|-----------|
| head            | FAILURE, retry   | SUCCESS   | CANCEL    |
| whole_body      | BROKEN, retry    | COMPLETE  | -         |
| stream          | BROKEN, resume   | COMPLETE  | -         |

- head: the request is sent and the engine's head is awaited. `failed` is an
  upstream error (refused, reset, a reply that is not HTTP, a head cut short,
  no head within `first_byte_timeout_s`) or a head with a 5xx status other
  than 501 (`head_outcome`); 501 is the engine saying it does not serve the
  route, its own answer like a 404, not a failure of the engine. Nothing has
  reached the client, so another endpoint is tried while attempts
  (`retries`) and untried endpoints are left; with none left, a 5xx answer is
  passed on as the engine sent it, and an error is answered with its status.
- whole_body: a whole answer (not streamed, or with a Content-Length) is
  read before any of it is sent: a body that breaks is the breaker's
  `broken` (answered at once, then hung or cut: counted apart from the head's
  verdict, see the breaker), and since still nothing has reached the client,
  another endpoint is tried.
- stream: the head has been sent to the client, chunks pass through as they
  come. A break is `broken`, and too late to retry: the request cannot be
  sent again as it was. It is `resume`d instead where the request allows it
  (llmgw/core/_continuation.py: greedy chat or completions, no n > 1,
  logprobs, guidance, tools, penalties or stop strings): another endpoint is
  sent the prompt plus the text already sent, and its stream is spliced into
  the client's (llmgw/router/_continue.py), while attempts and endpoints are
  left. Otherwise, or when none is left, the client gets a final error event
  in its route's shape (OpenAI's `data: {"error": ...}`, Anthropic's `event:
  error`) and the connection is cut. A continued stream's own head failing
  is a head failure like any other (its request is retried elsewhere, as
  nothing of it has reached the client).
- cancelled: the client left (or the request was cancelled otherwise). At
  the head there is no verdict on the endpoint (`cancel`, which in half_open
  hands the probe back); after it, the head's verdict was already told.
"""

from __future__ import annotations

import enum

import attrs

from llmgw.core._breaker import BreakerEvent


class AttemptPhase(enum.StrEnum):
    HEAD = "head"
    WHOLE_BODY = "whole_body"
    STREAM = "stream"


class AttemptOutcome(enum.StrEnum):
    FAILED = "failed"
    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"


@attrs.frozen
class AttemptVerdict:
    breaker: BreakerEvent | None  # what the endpoint's breaker is told; None: nothing
    retry: bool  # try another endpoint (while attempts and endpoints are left)
    # Continue the answer on another endpoint, where the request allows it (a stream).
    resume: bool = False


_P = AttemptPhase
_O = AttemptOutcome
_E = BreakerEvent

ATTEMPT_VERDICTS: dict[tuple[AttemptPhase, AttemptOutcome], AttemptVerdict] = {
    (_P.HEAD, _O.FAILED): AttemptVerdict(_E.FAILURE, retry=True),
    (_P.HEAD, _O.SUCCEEDED): AttemptVerdict(_E.SUCCESS, retry=False),
    (_P.HEAD, _O.CANCELLED): AttemptVerdict(_E.CANCEL, retry=False),
    (_P.WHOLE_BODY, _O.FAILED): AttemptVerdict(_E.BROKEN, retry=True),
    (_P.WHOLE_BODY, _O.SUCCEEDED): AttemptVerdict(_E.COMPLETE, retry=False),
    (_P.WHOLE_BODY, _O.CANCELLED): AttemptVerdict(None, retry=False),
    (_P.STREAM, _O.FAILED): AttemptVerdict(_E.BROKEN, retry=False, resume=True),
    (_P.STREAM, _O.SUCCEEDED): AttemptVerdict(_E.COMPLETE, retry=False),
    (_P.STREAM, _O.CANCELLED): AttemptVerdict(None, retry=False),
}
assert len(ATTEMPT_VERDICTS) == len(AttemptPhase) * len(AttemptOutcome), "a verdict for every pair"


def attempt_verdict(phase: AttemptPhase, outcome: AttemptOutcome) -> AttemptVerdict:
    return ATTEMPT_VERDICTS[(phase, outcome)]


def head_outcome(status: int) -> AttemptOutcome:
    """A head's status as an outcome: a 5xx other than 501 is the endpoint failing."""
    return AttemptOutcome.FAILED if status >= 500 and status != 501 else AttemptOutcome.SUCCEEDED

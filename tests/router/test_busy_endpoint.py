"""An engine whose /metrics does not answer while it answers requests is busy, not gone:
the scraper does not mark it unhealthy (a llama-server serves /metrics from the loop that
generates, and a burst of held requests on a fresh replica made its model answer 503
while the engine was serving them). One that sends nothing at all still goes unhealthy.
A real listener on loopback accepts the readings and never answers them."""

from __future__ import annotations

import functools

import trio

from llmgw.core import Breaker, BreakerConfig
from llmgw.router._scraper import EndpointState, Scraper
from llmgw.router._types import Endpoint


async def test_a_silent_metrics_endpoint_is_unhealthy_only_when_no_request_gets_bytes() -> None:
    async def never_answers(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, never_answers, 0, host="127.0.0.1")
        )
        port = listener.socket.getsockname()[1]

        def state(eid: str) -> EndpointState:
            ep = Endpoint(eid, "tiny", "llama-server", "127.0.0.1", port)
            return EndpointState(ep, Breaker(BreakerConfig(), name=eid))

        busy, silent = state("busy"), state("silent")
        scraper = Scraper(lambda: [busy, silent], interval_s=0.1, timeout_s=0.1)
        for _ in range(6):  # twice the misses that make one unhealthy
            busy.byte_at = trio.current_time()  # an answer to a request just ended there
            async with trio.open_nursery() as readings:
                readings.start_soon(scraper.scrape, busy)
                readings.start_soon(scraper.scrape, silent)
        assert busy.healthy and busy.misses == 0
        assert not silent.healthy and silent.misses == 6
        assert silent.last_error == "no answer within 0.1 s"
        # Bytes long ago prove nothing now: it goes unhealthy as any other.
        busy.byte_at = trio.current_time() - 10
        for _ in range(3):
            await scraper.scrape(busy)
        assert not busy.healthy
        nursery.cancel_scope.cancel()

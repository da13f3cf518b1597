"""What every llmgw entry point does the same way: logging, signals, exit codes."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import trio

from llmgw.errors import ConfigError, LlmgwError

log = logging.getLogger("llmgw")


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("LLMGW_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def run_service(name: str, service: Callable[[], Awaitable[None]]) -> int:
    """Run `service` until it returns or SIGTERM/SIGINT arrives; returns the exit code.

    A signal cancels the root scope, so every task unwinds in order; the
    service must not block its own cancellation for more than a few seconds.
    """

    async def root() -> None:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("%s: %s received, stopping", name, signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

            async def serve() -> None:
                await service()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_signal)
            nursery.start_soon(serve)

    # Everything imported and configured so far lives as long as the process:
    # keep it out of the collector's way, and collect young objects less often,
    # so that a full collection does not land in the middle of requests.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    try:
        trio.run(root)
    except (LlmgwError, BaseExceptionGroup) as exc:
        errors = [e for e in _leaves(exc) if isinstance(e, LlmgwError)]
        if not errors:
            raise
        for error in errors:
            print(f"{name}: {error}", file=sys.stderr)
        return 2 if any(isinstance(e, ConfigError) for e in errors) else 1
    log.info("%s stopped", name)
    return 0


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]

"""What the fake engine prints to stdout, in each imitated engine's own words.

The startup banner, the line that says where it listens (tests and the agent
wait for it), the "loaded" line, the periodic statistics line
(LLMGW_FAKE_LOG_EVERY) and the shutdown line. They are shaped like vLLM's,
SGLang's and llama-server's, so log readers meet the lines they would in
production; the numbers come from the real in-flight load.
"""

from __future__ import annotations

import time

import trio

from llmgw.testing._fake_engine_cli import Engine, FakeConfig
from llmgw.testing._fake_engine_wire import EngineState


def say(line: str) -> None:
    print(line, flush=True)


def stamp(engine: Engine) -> str:
    now = time.localtime()
    if engine == "vllm":
        return time.strftime("INFO %m-%d %H:%M:%S", now)
    return time.strftime("[%Y-%m-%d %H:%M:%S]", now)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce_start(c: FakeConfig) -> None:
    if c.engine == "vllm":
        say(f"{stamp('vllm')} [api_server.py:1805] vLLM API server version {c.version}")
        say(f"{stamp('vllm')} [utils.py:326] non-default args: {{'model': {c.model!r}}}")
    elif c.engine == "sglang":
        say(
            f"{stamp('sglang')} server_args=ServerArgs(model_path={c.model!r}, "
            f"host={c.host!r}, port={c.port})"
        )
    else:
        say(f"build: {c.version} (1a2b3c4d) with cc (GCC) 13.3.0 for x86_64-linux-gnu")
        say(f"main: loading model from '{c.model}'")


def announce_listening(c: FakeConfig, port: int) -> None:
    where = url(c.host, port)
    if c.engine == "llama-server":
        say(f"main: server is listening on {where} - starting the main loop")
    else:
        say(f"INFO:     Uvicorn running on {where} (Press CTRL+C to quit)")


def announce_loaded(engine: Engine) -> None:
    if engine == "vllm":
        say("INFO:     Application startup complete.")
    elif engine == "sglang":
        say(f"{stamp('sglang')} The server is fired up and ready to roll!")
    else:
        say("main: model loaded")


def announce_shutdown(engine: Engine) -> None:
    if engine != "llama-server":
        say("INFO:     Shutting down")


async def log_stats(c: FakeConfig, st: EngineState, every: float) -> None:
    """Every `every` seconds, the engine's statistics line: throughput since the last one."""
    prompt, gen = st.prompt_tokens_total, st.generation_tokens_total
    while True:
        await trio.sleep(every)
        dp, dg = st.prompt_tokens_total - prompt, st.generation_tokens_total - gen
        prompt, gen = st.prompt_tokens_total, st.generation_tokens_total
        running, waiting = len(st.running), st.waiting
        hit_rate = st.prefix.hits / st.prefix.queries if st.prefix and st.prefix.queries else 0
        if c.engine == "vllm":
            say(
                f"{stamp('vllm')} [loggers.py:123] Engine 000: Avg prompt throughput: "
                f"{dp / every:.1f} tokens/s, Avg generation throughput: {dg / every:.1f} "
                f"tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, GPU KV cache "
                f"usage: {st.kv_usage() * 100:.1f}%, Prefix cache hit rate: "
                f"{hit_rate * 100:.1f}%"
            )
        elif c.engine == "sglang":
            say(
                f"{stamp('sglang')} Decode batch. #running-req: {running}, #token: "
                f"{st.kv_used_tokens()}, token usage: {st.kv_usage():.2f}, gen throughput "
                f"(token/s): {dg / every:.2f}, #queue-req: {waiting}"
            )
        elif running or waiting:
            say(f"srv  update_slots: {running} of {c.slots} slots processing, {waiting} deferred")
        else:
            say("srv  update_slots: all slots are idle")

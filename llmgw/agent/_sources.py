"""A shard's model source, made ready on this node before its first process starts.

The supervisor calls `Sources.prepare(spec)` inside the shard's task, so the
shard stays `starting` while it runs and `stop()` cancels it with the shard.
No timer here: the control plane's `startup_timeout_s`, counted from when it
first saw the shard, ends a fetch that never finishes, and progress resets
nothing.

What `llmgw.core.classify_source` says the source is decides what happens:

| source                     | before launch                     | the engine gets            |
|----------------------------|-----------------------------------|----------------------------|
| none, or a hub id          | nothing                           | the argv as written        |
| a local path               | it must exist on this node        | the argv as written        |
| `http(s)://…` file/version | fetched (the system's trust)      | the file, or the directory |
| `mirror:/…` file/version   | fetched from the control plane's  | the same                   |
|                            | mirror, with the agent's client   |                            |
|                            | certificate                       |                            |

A version's directory goes to vLLM and SGLang; llama-server gets the first
`*.gguf` in it by name (a split GGUF's first part: llama.cpp finds the rest
beside it). The supervisor puts that path in place of every argv element equal
to the source, so run.json records the argv as run and adoption after an
agent restart matches it (an adopted shard fetches nothing).

A shard's LoRA adapters (`ShardSpec.adapter_sources`) are made ready the same
way, beside its model's source and at the same time; their paths also replace
an element that starts with the source and ":" (`--lora-scaled PATH:SCALE`).
`fetchAdapter` (an engine that loads adapters at run time) makes one adapter's
source ready through `ready` without a shard. A fetch error names the source as
the catalog wrote it, then the URL the Fetcher asked.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import quote

import attrs
import trio

from llmgw import model
from llmgw.agent._fetch import Fetcher, FetchError, Kind
from llmgw.core import SourceKind, cache_name, classify_source
from llmgw.errors import ConfigError, LlmgwError

log = logging.getLogger("llmgw.agent.sources")

MIRROR_PREFIX = "mirror:"


class SourceError(LlmgwError):
    """A shard's source cannot be made ready here; one line naming the source and why."""


@attrs.frozen
class ControlPlane:
    """The control plane the agent is registered with: where it dialled, what it was told."""

    host: str
    port: int
    settings: model.Settings


class Sources:
    def __init__(
        self,
        fetcher: Fetcher | None,
        *,
        node_id: str | None = None,
        control_plane: Callable[[], ControlPlane | None] = lambda: None,
        client_tls: ssl.SSLContext | None = None,
        on_fetched: Callable[[], Awaitable[None]] | None = None,
        notify_progress: Callable[[model.Progress], None] | None = None,
    ) -> None:
        self._fetcher = fetcher
        self._node_id = node_id
        self._control_plane = control_plane
        self._client_tls = client_tls  # the cluster CA and this agent's certificate
        self._on_fetched = on_fetched  # the weights rescan: the next heartbeat shows them
        self._names: dict[str, str] = {}  # cache name -> the source text it caches
        self._notify_progress = notify_progress
        self.fetches = 0  # fetches asked of the Fetcher (each may be one shared download)

    def __repr__(self) -> str:
        return f"<Sources node={self._node_id} fetches={self.fetches} fetcher={self._fetcher!r}>"

    def source_of(self, name: str) -> str | None:
        """The source a cache name was fetched for (the Fetcher's progress names it so)."""
        return self._names.get(name)

    def progress(self, name: str, done: int, total: int | None) -> None:
        """The Fetcher's progress (by cache name, at most once a second) as the wire's,
        keyed by the source text: one per source, however many shards wait on it."""
        source = self._names.get(name)
        if source is not None and self._notify_progress is not None:
            self._notify_progress(model.Progress(source, done, total))

    def in_flight(self) -> frozenset[str]:
        """Cache names being fetched now."""
        return self._fetcher.in_flight() if self._fetcher is not None else frozenset()

    async def prepare(self, spec: model.ShardSpec) -> dict[str, str]:
        """Every source of `spec` (its model's, then each adapter's) made ready here, at
        once; answers the local path to put in place of each source text in the argv
        (`llmgw.core.local_argv`), for the sources that have one. The first source that
        cannot be made ready ends the others' waits and raises its SourceError."""
        texts = [(spec.source, "model source")] if spec.source is not None else []
        texts += [(text, "adapter source") for text in spec.adapter_sources]
        local: dict[str, str] = {}
        failed: list[SourceError] = []

        async def one(text: str, what: str, cancel: trio.CancelScope) -> None:
            try:
                path = await self.ready(text, spec.engine, what=what, shard_id=spec.shard_id)
            except SourceError as exc:
                failed.append(exc)
                cancel.cancel()
                return
            if path is not None:
                local[text] = path

        async with trio.open_nursery() as nursery:
            for text, what in dict(texts).items():
                nursery.start_soon(one, text, what, nursery.cancel_scope)
        if failed:
            raise failed[0]
        return local

    async def ready(
        self, text: str, engine: str, *, what: str = "model source", shard_id: str | None = None
    ) -> str | None:
        """One source made ready on this node: the local path to hand `engine` (a file, a
        version's directory, or llama-server's first .gguf in it); None for a local path
        (checked to exist) or a hub id, which the engine reads as written. Single flight
        (the Fetcher's): every caller waiting on one source shares one download."""
        try:
            source = classify_source(text)
        except ConfigError as exc:
            raise SourceError(str(exc)) from None
        if source.kind is SourceKind.HUB:
            return None
        if source.kind is SourceKind.LOCAL:
            if not await trio.to_thread.run_sync(os.path.exists, text):
                where = self._node_id or "this node"
                raise SourceError(f"{what} {text}: no such file or directory on {where}")
            return None
        if self._fetcher is None:
            raise SourceError(f"{what} {text}: this agent fetches nothing (no weights_dir)")
        context: ssl.SSLContext | None = None
        if source.kind in (SourceKind.MIRROR_FILE, SourceKind.MIRROR_VERSION):
            url, context = self._mirror_url(text)
        else:
            url = text  # https: the system's default trust, as the Fetcher does without one
        kind: Kind = "version" if source.version else "file"
        self.fetches += 1
        name = cache_name(text)
        self._names[name] = text  # a name stands for one text: it is the text's hash
        log.info("%s: fetching %s (%s)", f"shard {shard_id}" if shard_id else what, text, name)
        try:
            path = await self._fetcher.fetch(url, kind, source=text, ssl_context=context)
        except FetchError as exc:
            message = str(exc)
            # The Fetcher names the URL; a mirror's is not what the catalog wrote.
            raise SourceError(message if text in message else f"{what} {text}: {message}") from None
        if self._on_fetched is not None:
            await self._on_fetched()
        if not source.version:
            return str(path)
        if engine == "llama-server":
            return await trio.to_thread.run_sync(_first_gguf, f"{what} {text}", path)
        return str(path)

    def _mirror_url(self, text: str) -> tuple[str, ssl.SSLContext | None]:
        return mirror_url(self._control_plane(), text, self._client_tls)


def mirror_url(
    cp: ControlPlane | None, text: str, client_tls: ssl.SSLContext | None
) -> tuple[str, ssl.SSLContext | None]:
    """The URL of `mirror:/…` text on the control plane the agent registered with, and
    the TLS to fetch it with (the agent's client context when the mirror speaks TLS);
    SourceError when there is no such mirror. The engine installer resolves its
    archives and pip's index here too."""
    if cp is None:
        raise SourceError(
            f"{text}: not registered with a control plane, so there is no mirror to fetch from"
        )
    where = _host_port(cp.host, cp.port)
    if cp.settings.mirror_port is None:
        raise SourceError(
            f"{text}: the control plane at {where} serves no weights mirror "
            "(server.yaml mirror.dir)"
        )
    scheme = "https" if cp.settings.mirror_tls else "http"
    path = quote(text[len(MIRROR_PREFIX) :])  # "/" stays; a space becomes %20
    url = f"{scheme}://{_host_port(cp.host, cp.settings.mirror_port)}{path}"
    return url, (client_tls if cp.settings.mirror_tls else None)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _first_gguf(named: str, directory: Path) -> str:
    names = sorted(p.name for p in directory.iterdir() if p.name.endswith(".gguf"))
    if not names:
        raise SourceError(f"{named}: the version holds no .gguf file, which llama-server needs")
    return str(directory / names[0])

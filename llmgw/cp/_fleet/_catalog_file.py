"""The catalog as a file: loaded at start, reloaded on SIGHUP and when it changes.

The file is server.yaml; its `engines:` declaration (llmgw/cp/_fleet/_engines.py) is
reloaded with the catalog. A bad file is refused whole (catalog and engines) and
the running ones stay, with the reasons logged. The catalog carries the declared
engine versions (`_catalog.with_engines`): they are part of each profile's
fingerprint, so a new version of an engine a model runs is a catalog change
that rolls that model.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio

from llmgw import config, model
from llmgw.cp._fleet import _catalog
from llmgw.errors import ConfigError

log = logging.getLogger("llmgw.cp.catalog")


def read_data(path: Path) -> Any:
    """server.yaml's parsed YAML ({} for an empty file)."""
    return config.read_yaml(path) or {}


def read(path: Path) -> _catalog.Catalog:
    return _catalog.parse(read_data(path), str(path))


# server.yaml's parsed data -> its engine declaration (llmgw.cp._fleet._engines.load, bound
# to the file's name, the mirror's directory and its hash cache).
EngineLoader = Callable[[Any], Awaitable["model.EngineDecls | None"]]
OnEngines = Callable[["model.EngineDecls | None"], None]


class CatalogFile:
    def __init__(
        self,
        path: Path,
        initial: _catalog.Catalog,
        engines: model.EngineDecls | None = None,
        load_engines: EngineLoader | None = None,
    ) -> None:
        self.path = path
        self.catalog = _catalog.with_engines(initial, engines)
        self.engines = engines
        self.load_engines = load_engines  # None: the engines are not this file's to reload
        self.loads = 1
        self.refusals = 0
        self._stamp = self._mtime()

    def __repr__(self) -> str:
        return (
            f"<CatalogFile {self.path} models={len(self.catalog.models)} "
            f"adapters={len(self.catalog.adapters)} loads={self.loads}>"
        )

    @property
    def adapters(self) -> tuple[_catalog.CatalogAdapter, ...]:
        """The running catalog's `adapters:`."""
        return self.catalog.adapters

    def _mtime(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    async def reload(
        self,
        why: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_engines: OnEngines = lambda _: None,
    ) -> bool:
        """Read the file again; False (and the running catalog and engines stay) when it
        is refused. `on_change` is called when the catalog changed (its models, its
        splits, its adapters, or a model's fingerprints: a new version of an engine a
        model runs), `on_engines` with the new declaration when its fingerprint changed
        (None: the `engines:` key went away)."""
        try:
            data = read_data(self.path)
            catalog = _catalog.parse(data, str(self.path))
            engines = self.engines
            if self.load_engines is not None:
                engines = await self.load_engines(data)
            catalog = _catalog.with_engines(catalog, engines)
        except ConfigError as exc:
            self.refusals += 1
            log.error(
                "catalog reload (%s) refused; the running catalog and engines stay:\n%s",
                why,
                exc,
            )
            return False
        # A new declared version changes the fingerprints of the profiles running it:
        # that is a change of the catalog, as an edit of those models would be.
        changed = (catalog.models, catalog.traffic, catalog.adapters) != (
            self.catalog.models,
            self.catalog.traffic,
            self.catalog.adapters,
        ) or any(catalog.fingerprints(m) != self.catalog.fingerprints(m) for m in catalog.models)
        before = self.engines.fingerprint if self.engines is not None else None
        after = engines.fingerprint if engines is not None else None
        self.catalog = catalog
        self.engines = engines
        self.loads += 1
        log.info(
            "catalog reloaded (%s): %d models, %d adapters%s%s",
            why,
            len(catalog.models),
            len(catalog.adapters),
            "" if changed else ", unchanged",
            "" if before == after else f", engines {before or 'none'} -> {after or 'none'}",
        )
        if changed:
            on_change()
        if before != after:
            on_engines(engines)
        return True

    async def watch(
        self,
        on_change: Callable[[], None],
        on_engines: OnEngines,
        *,
        poll_s: float = 2.0,
    ) -> None:
        """Reload on SIGHUP, and when the file's mtime or size changes, calling back
        as `reload` says."""
        reload = partial(self.reload, on_change=on_change, on_engines=on_engines)
        async with trio.open_nursery() as nursery:

            async def on_hup() -> None:
                with trio.open_signal_receiver(signal.SIGHUP) as signals:
                    async for _ in signals:
                        self._stamp = self._mtime()
                        await reload("SIGHUP")

            nursery.start_soon(on_hup)
            while True:
                await trio.sleep(poll_s)
                stamp = self._mtime()
                if stamp != self._stamp and stamp is not None:
                    self._stamp = stamp
                    await reload("the file changed")

"""The catalog as a file: loaded at start, reloaded on SIGHUP and when it changes.

A bad file is refused whole and the running catalog stays, with the reasons
logged.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path

import trio
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from llmgw.cp import _catalog
from llmgw.errors import ConfigError

log = logging.getLogger("llmgw.cp.catalog")


def read(path: Path) -> _catalog.Catalog:
    try:
        data = YAML(typ="safe", pure=True).load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return _catalog.parse(data or {}, str(path))


class CatalogFile:
    def __init__(self, path: Path, initial: _catalog.Catalog) -> None:
        self.path = path
        self.catalog = initial
        self.loads = 1
        self.refusals = 0
        self.on_change: Callable[[], None] = lambda: None
        self._stamp = self._mtime()

    def __repr__(self) -> str:
        return f"<CatalogFile {self.path} models={len(self.catalog.models)} loads={self.loads}>"

    def _mtime(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def reload(self, why: str) -> bool:
        try:
            catalog = read(self.path)
        except ConfigError as exc:
            self.refusals += 1
            log.error("catalog reload (%s) refused; the running catalog stays:\n%s", why, exc)
            return False
        changed = catalog != self.catalog
        self.catalog = catalog
        self.loads += 1
        log.info(
            "catalog reloaded (%s): %d models%s",
            why,
            len(catalog.models),
            "" if changed else ", unchanged",
        )
        if changed:
            self.on_change()
        return True

    async def watch(self, *, poll_s: float = 2.0) -> None:
        """Reload on SIGHUP, and when the file's mtime or size changes."""
        async with trio.open_nursery() as nursery:

            async def on_hup() -> None:
                with trio.open_signal_receiver(signal.SIGHUP) as signals:
                    async for _ in signals:
                        self._stamp = self._mtime()
                        self.reload("SIGHUP")

            nursery.start_soon(on_hup)
            while True:
                await trio.sleep(poll_s)
                stamp = self._mtime()
                if stamp != self._stamp and stamp is not None:
                    self._stamp = stamp
                    self.reload("the file changed")

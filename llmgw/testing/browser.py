"""A small driver for a real headless Chromium, over the Chrome DevTools Protocol.

Tests of the admin pages use it: open a URL, fill and submit forms, read
elements by CSS selector, evaluate JavaScript, wait for a condition (polled
against a deadline), collect console errors and uncaught exceptions, and save
a screenshot. It drives the system's `chromium` (Debian's package) and never
downloads a browser. The client is ours: one websocket (wsproto over a trio
TCP stream) to one page target, requests matched to replies by id.

    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto("http://127.0.0.1:8080/admin/login")
        await page.fill("input[name=key]", key)
        await page.submit("form")
        await page.wait_for("location.pathname === '/admin/'")
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
import wsproto
import wsproto.events

from llmgw.errors import LlmgwError

__all__ = ["Browser", "BrowserError", "ConsoleError", "Page", "open_browser"]


class BrowserError(LlmgwError):
    """The browser did not start, did not answer, or a command it ran failed."""


@attrs.frozen
class ConsoleError:
    """A console message at level error, or an uncaught exception, seen on a page."""

    kind: str  # "console", "exception" or "log"
    text: str
    url: str = ""


def _js(value: Any) -> str:
    """A Python value as a JavaScript literal (JSON is a subset of JavaScript)."""
    return json.dumps(value)


class _Socket:
    """One client websocket to a DevTools target: CDP requests matched to replies by id."""

    def __init__(self, stream: trio.SocketStream, ws: wsproto.WSConnection) -> None:
        self._stream = stream
        self._ws = ws
        self._next_id = 0
        self._waiting: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self._send_lock = trio.Lock()
        self.on_event: list[Any] = []
        self.closed = False

    @classmethod
    async def connect(cls, url: str, *, timeout: float) -> _Socket:
        rest = url.removeprefix("ws://")
        hostport, _, path = rest.partition("/")
        host, _, port = hostport.rpartition(":")
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, int(port))
            ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
            await stream.send_all(ws.send(wsproto.events.Request(host=hostport, target="/" + path)))
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    raise BrowserError(f"DevTools websocket {url} closed during the handshake")
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, wsproto.events.AcceptConnection):
                        return cls(stream, ws)
                    if isinstance(event, wsproto.events.RejectConnection):
                        raise BrowserError(
                            f"DevTools websocket {url} refused the handshake "
                            f"with status {event.status_code}"
                        )

    async def reader(self) -> None:
        parts: list[str] = []
        try:
            while True:
                data = await self._stream.receive_some(1 << 20)
                if not data:
                    return
                self._ws.receive_data(data)
                for event in self._ws.events():
                    if isinstance(event, wsproto.events.TextMessage):
                        parts.append(str(event.data))
                        if event.message_finished:
                            self._dispatch(json.loads("".join(parts)))
                            parts = []
                    elif isinstance(event, wsproto.events.Ping):
                        await self._send(event.response())
                    elif isinstance(event, wsproto.events.CloseConnection):
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        finally:
            self.closed = True
            for done, _box in self._waiting.values():
                done.set()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            waiting = self._waiting.pop(int(message["id"]), None)
            if waiting is not None:
                waiting[1].append(message)
                waiting[0].set()
            return
        for handler in self.on_event:
            handler(message.get("method", ""), message.get("params", {}))

    async def _send(self, event: wsproto.events.Event) -> None:
        async with self._send_lock:
            await self._stream.send_all(self._ws.send(event))

    async def call(self, method: str, params: dict[str, Any], *, timeout: float) -> Any:
        if self.closed:
            raise BrowserError(f"DevTools call {method}: the browser's websocket is closed")
        self._next_id += 1
        ident = self._next_id
        done, box = trio.Event(), list[dict[str, Any]]()
        self._waiting[ident] = (done, box)
        payload = json.dumps({"id": ident, "method": method, "params": params})
        try:
            with trio.move_on_after(timeout) as scope:
                await self._send(wsproto.events.TextMessage(data=payload))
                await done.wait()
        finally:
            self._waiting.pop(ident, None)
        if scope.cancelled_caught:
            raise BrowserError(f"DevTools call {method} got no reply in {timeout:g} s")
        if not box:
            raise BrowserError(f"DevTools call {method}: the browser closed the websocket")
        reply = box[0]
        if "error" in reply:
            raise BrowserError(f"DevTools call {method} failed: {reply['error']}")
        return reply.get("result", {})

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._stream.aclose()


class Page:
    """One tab. Every method has a deadline; none sleeps to wait."""

    def __init__(self, sock: _Socket, nursery: trio.Nursery, *, timeout: float) -> None:
        self._sock = sock
        self._nursery = nursery
        self.timeout = timeout
        self.console_errors: list[ConsoleError] = []
        self.dialogs: list[str] = []  # the messages of alert/confirm dialogs, accepted
        self.loads = 0  # documents loaded in this tab (Page.loadEventFired)
        self._loaded = trio.Event()
        sock.on_event.append(self._on_event)

    def __repr__(self) -> str:
        return (
            f"<Page loads={self.loads} console_errors={len(self.console_errors)} "
            f"dialogs={len(self.dialogs)} closed={self._sock.closed}>"
        )

    def _on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(
                str(a.get("value", a.get("description", ""))) for a in params.get("args", [])
            )
            self.console_errors.append(ConsoleError("console", text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exc = details.get("exception", {})
            text = str(exc.get("description") or details.get("text", "uncaught exception"))
            self.console_errors.append(ConsoleError("exception", text, details.get("url", "")))
        elif method == "Page.loadEventFired":
            self.loads += 1
            self._loaded.set()
            self._loaded = trio.Event()
        elif method == "Page.javascriptDialogOpening":
            # A confirm() before a destructive action: answered yes, as the operator would.
            self.dialogs.append(str(params.get("message", "")))
            self._nursery.start_soon(self._answer_dialog)
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            # Chromium asks every origin for /favicon.ico by itself: not the page's doing.
            if entry.get("level") == "error" and not str(entry.get("url", "")).endswith(
                "/favicon.ico"
            ):
                self.console_errors.append(
                    ConsoleError("log", str(entry.get("text", "")), str(entry.get("url", "")))
                )

    async def _answer_dialog(self) -> None:
        with contextlib.suppress(BrowserError):
            await self.call("Page.handleJavaScriptDialog", accept=True)

    async def _enable(self) -> None:
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.call(f"{domain}.enable")

    async def call(self, method: str, **params: Any) -> Any:
        """Send one CDP command to this page and return its result."""
        return await self._sock.call(method, params, timeout=self.timeout)

    async def goto(self, url: str) -> None:
        """Navigate and wait until the new document (not the one before it) has loaded."""
        before = self.loads
        result = await self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"navigating to {url} failed: {result['errorText']}")
        await self.wait_load_after(before, what=url)

    async def wait_load_after(self, before: int, *, what: str = "the page") -> None:
        """Wait until a document loads that was not yet loaded when `loads` was `before`."""
        with trio.move_on_after(self.timeout):
            while self.loads <= before:
                await self._loaded.wait()
            await self.wait_loaded()
            return
        raise BrowserError(f"{what} did not finish loading in {self.timeout:g} s")

    async def wait_loaded(self) -> None:
        await self.wait_for("document.readyState === 'complete'")

    async def evaluate(self, expression: str) -> Any:
        """Evaluate a JavaScript expression (promises awaited) and return its value."""
        result = await self.call(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"evaluating {expression!r} threw: {text}")
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout: float | None = None) -> Any:
        """Poll a JavaScript expression until it is truthy; return its value.

        Raises BrowserError naming the expression and its last value at the deadline.
        Evaluation errors while the page navigates count as "not yet".
        """
        limit = self.timeout if timeout is None else timeout
        last: Any = None
        with trio.move_on_after(limit):
            while True:
                try:
                    last = await self.evaluate(expression)
                except BrowserError as exc:
                    last = str(exc)
                else:
                    if last:
                        return last
                await trio.sleep(0.05)  # the poll interval, not a wait for the event
        raise BrowserError(
            f"waited {limit:g} s for {expression!r} to hold; last value {last!r}; "
            f"page {await self._location()}"
        )

    async def _location(self) -> str:
        try:
            return str(await self.evaluate("location.href"))
        except BrowserError:
            return "(unknown)"

    async def url(self) -> str:
        return str(await self.evaluate("location.href"))

    async def count(self, selector: str) -> int:
        return int(await self.evaluate(f"document.querySelectorAll({_js(selector)}).length"))

    async def _one(self, selector: str, body: str) -> Any:
        """Run `body` (using `el`) on the one element `selector` names, or raise."""
        expression = (
            f"(() => {{ const el = document.querySelector({_js(selector)});"
            f" if (el === null) return {{missing: true}};"
            f" return {{value: (() => {{ {body} }})()}}; }})()"
        )
        result = await self.evaluate(expression)
        if result.get("missing"):
            raise BrowserError(f"no element matches {selector!r} on {await self._location()}")
        return result.get("value")

    async def text(self, selector: str) -> str:
        return str(await self._one(selector, "return el.textContent;")).strip()

    async def texts(self, selector: str) -> list[str]:
        value = await self.evaluate(
            f"Array.from(document.querySelectorAll({_js(selector)}), e => e.textContent.trim())"
        )
        return [str(v) for v in value]

    async def attr(self, selector: str, name: str) -> str | None:
        value = await self._one(selector, f"return el.getAttribute({_js(name)});")
        return None if value is None else str(value)

    async def fill(self, selector: str, value: str) -> None:
        await self._one(
            selector,
            f"el.value = {_js(value)};"
            " el.dispatchEvent(new Event('input', {bubbles: true}));"
            " el.dispatchEvent(new Event('change', {bubbles: true})); return null;",
        )

    async def click(self, selector: str) -> None:
        await self._one(selector, "el.click(); return null;")

    async def submit(self, selector: str) -> None:
        """Submit a form the way a user's click would, and wait for the page it leads to."""
        before = self.loads
        await self._one(selector, "el.requestSubmit(); return null;")
        await self.wait_load_after(before, what=f"the page after submitting {selector!r}")

    async def cookies(self) -> list[dict[str, Any]]:
        result = await self.call("Network.getCookies")
        return list(result.get("cookies", []))

    async def screenshot(self, path: Path) -> Path:
        """Save a PNG of the page (the whole page, not only the viewport)."""
        result = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(result["data"])
        if not data.startswith(b"\x89PNG"):
            raise BrowserError(f"the screenshot for {path} is not a PNG")
        await trio.Path(path.parent).mkdir(parents=True, exist_ok=True)
        await trio.Path(path).write_bytes(data)
        return path

    def assert_no_console_errors(self) -> None:
        if self.console_errors:
            shown = "; ".join(f"{e.kind}: {e.text} {e.url}".strip() for e in self.console_errors)
            raise AssertionError(f"the page logged {len(self.console_errors)} error(s): {shown}")


class Browser:
    """A running headless Chromium and the pages opened in it."""

    def __init__(
        self, nursery: trio.Nursery, port: int, *, timeout: float, process: trio.Process
    ) -> None:
        self._nursery = nursery
        self.port = port
        self.timeout = timeout
        self.process = process
        self._sockets: list[_Socket] = []

    def __repr__(self) -> str:
        pages = len(self._sockets)
        return f"<Browser pid={self.process.pid} devtools=127.0.0.1:{self.port} pages={pages}>"

    async def new_page(self) -> Page:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            reply = await client.put(f"http://127.0.0.1:{self.port}/json/new?about:blank")
        if reply.status_code != 200:
            raise BrowserError(
                f"chromium's /json/new answered {reply.status_code}: {reply.text[:200]}"
            )
        sock = await _Socket.connect(reply.json()["webSocketDebuggerUrl"], timeout=self.timeout)
        self._sockets.append(sock)
        self._nursery.start_soon(sock.reader)
        page = Page(sock, self._nursery, timeout=self.timeout)
        await page._enable()
        return page

    async def _aclose(self) -> None:
        for sock in self._sockets:
            await sock.aclose()


def _chromium_binary() -> str | None:
    return shutil.which("chromium")


@contextlib.asynccontextmanager
async def open_browser(
    tmp_path: Path, *, timeout: float = 15.0, binary: str | None = None
) -> AsyncIterator[Browser]:
    """Start headless Chromium with its profile under tmp_path; stop it on exit."""
    exe = binary or _chromium_binary()
    if exe is None:
        raise BrowserError("no `chromium` on PATH: install Debian's chromium package")
    profile = tmp_path / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    log = (tmp_path / "chromium.log").open("wb")
    args = [
        exe,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--metrics-recording-only",
        "--password-store=basic",
        "--window-size=1280,900",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "about:blank",
    ]
    env = {**os.environ, "HOME": str(tmp_path)}  # the launcher script cleans $HOME's crash dir
    process = await trio.lowlevel.open_process(
        args,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        port = await _devtools_port(profile, process, timeout, tmp_path / "chromium.log")
        async with trio.open_nursery() as nursery:
            browser = Browser(nursery, port, timeout=timeout, process=process)
            try:
                yield browser
            finally:
                await browser._aclose()
                nursery.cancel_scope.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await process.wait()
        log.close()


async def _devtools_port(profile: Path, process: trio.Process, timeout: float, log: Path) -> int:
    """Chromium writes the port it chose to <profile>/DevToolsActivePort once it listens."""
    marker = profile / "DevToolsActivePort"
    with trio.move_on_after(timeout):
        while True:
            if process.returncode is not None:
                tail = (await trio.Path(log).read_text(errors="replace"))[-2000:]
                raise BrowserError(
                    f"chromium exited with status {process.returncode} before listening: {tail}"
                )
            with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
                port = int((await trio.Path(marker).read_text()).splitlines()[0])
                if port > 0:
                    return port
            await trio.sleep(0.05)  # the poll interval for a file chromium writes
    raise BrowserError(f"chromium wrote no {marker} in {timeout:g} s; see {log}")

"""The Chromium driver itself, proved on a static page served on loopback."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import require

from llmgw.testing.browser import BrowserError, open_browser

PAGE = b"""<!doctype html>
<html><head><title>static</title></head><body>
<h1 id="title" data-x="42">Hello &lt;b&gt;</h1>
<form id="f" method="post" action="/posted">
  <input name="key" id="key"><button type="submit">go</button>
</form>
<div id="later"></div>
<button id="ask" onclick="document.getElementById('answer').textContent = confirm('sure?')">ask</button>
<p id="answer"></p>
<script>
  setTimeout(() => { document.getElementById('later').textContent = 'arrived'; }, 300);
</script>
</body></html>"""

BROKEN = b"""<!doctype html><html><body>
<script>console.error('boom from console'); undefinedFunction();</script>
</body></html>"""


class _Handler(BaseHTTPRequestHandler):
    posted: list[bytes] = []

    def do_GET(self) -> None:
        body = BROKEN if self.path == "/broken" else PAGE
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        _Handler.posted.append(data)
        body = b"<!doctype html><p id='done'>" + data + b"</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def static_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _chromium() -> None:
    require(shutil.which("chromium") is not None, "Debian's chromium package (/usr/bin/chromium)")


async def test_driver_reads_fills_submits_waits_and_screenshots(
    static_server: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        startup = time.monotonic() - started
        await page.goto(static_server + "/")
        assert await page.text("#title") == "Hello <b>"
        assert await page.attr("#title", "data-x") == "42"
        assert await page.count("input") == 1
        assert await page.evaluate("1 + 2") == 3
        assert await page.wait_for("document.getElementById('later').textContent") == "arrived"
        with pytest.raises(BrowserError, match="no element matches '#nothing'"):
            await page.text("#nothing")
        with pytest.raises(BrowserError, match="to hold"):
            await page.wait_for("false", timeout=0.3)
        # A confirm() is answered yes (as before a revoke), and its message kept.
        await page.click("#ask")
        assert await page.wait_for("document.getElementById('answer').textContent") == "true"
        assert page.dialogs == ["sure?"]
        await page.fill("#key", "s3cret&x")
        await page.submit("#f")
        await page.wait_for("location.pathname === '/posted'")
        await page.wait_loaded()
        assert await page.text("#done") == "key=s3cret%26x"
        shot = await page.screenshot(tmp_path / "static.png")
        assert shot.read_bytes().startswith(b"\x89PNG")
        page.assert_no_console_errors()
    print(f"chromium start to first page: {startup:.2f} s")


async def test_driver_catches_console_errors_and_uncaught_exceptions(
    static_server: str, tmp_path: Path
) -> None:
    async with open_browser(tmp_path) as browser:
        page = await browser.new_page()
        await page.goto(static_server + "/broken")
        await page.wait_for("true")
        kinds = {e.kind for e in page.console_errors}
        assert "console" in kinds and "exception" in kinds, page.console_errors
        assert any("boom from console" in e.text for e in page.console_errors)
        assert any("undefinedFunction" in e.text for e in page.console_errors)
        with pytest.raises(AssertionError, match="error"):
            page.assert_no_console_errors()

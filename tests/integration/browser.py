"""A real headless Chromium for tests, driven over its DevTools protocol (a websocket, with
aiohttp): open a page, evaluate JavaScript in it, record console messages, exceptions and
network requests, take a screenshot. Debian's `chromium` package; tests skip without it.

    async with Browser(tmp_path) as b:
        await b.open(url)
        regions = await b.eval("[...document.querySelectorAll('[data-region]')].length")
        assert not b.errors()
"""

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(RuntimeError):
    """Chromium did not start, or a DevTools command failed."""


class Browser:
    def __init__(self, tmp: Path, width: int = 1500, height: int = 1100) -> None:
        if CHROMIUM is None:
            raise BrowserError("chromium is not installed (Debian: apt-get install chromium)")
        self.dir = Path(tmp) / "chromium"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.size = (width, height)
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.reader: asyncio.Task | None = None
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future] = {}
        self.console: list[dict] = []
        """{"source": "console|exception|log", "level", "text"} in arrival order."""
        self.requests: list[dict] = []
        """Network.requestWillBeSent's `request` objects (url, method, headers)."""

    async def __aenter__(self) -> "Browser":
        log = open(self.dir / "chromium.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.dir / 'profile'}",
             f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            await self._connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _connect(self, timeout: float = 60.0) -> None:
        port_file = self.dir / "profile" / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not port_file.is_file() or not port_file.read_text().strip():
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited {self.proc.returncode}: "
                                   f"{(self.dir / 'chromium.log').read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise BrowserError(f"chromium wrote no DevToolsActivePort in {timeout}s")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            targets = await r.json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0)
        self.reader = asyncio.create_task(self._read())
        for domain in ("Page", "Runtime", "Log", "Network"):
            await self.send(f"{domain}.enable")

    async def _read(self) -> None:
        assert self.ws is not None
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = json.loads(msg.data)
            if "id" in doc:
                fut = self.waiting.pop(doc["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(doc)
                continue
            self._event(doc.get("method", ""), doc.get("params", {}))
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(BrowserError("the DevTools connection closed"))

    def _event(self, method: str, p: dict) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"])
            self.console.append({"source": "console", "level": p["type"], "text": text})
        elif method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            text = d.get("exception", {}).get("description") or d.get("text", "")
            self.console.append({"source": "exception", "level": "error", "text": text})
        elif method == "Log.entryAdded":
            e = p["entry"]
            self.console.append({"source": "log", "level": e["level"],
                                 "text": f"{e.get('url', '')} {e['text']}"})
        elif method == "Network.requestWillBeSent":
            self.requests.append(p["request"])

    async def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict:
        assert self.ws is not None
        self.next_id += 1
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = fut
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method,
                                           "params": params}))
        doc = await asyncio.wait_for(fut, timeout)
        if "error" in doc:
            raise BrowserError(f"{method}: {doc['error']}")
        return doc.get("result", {})

    async def open(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", 30, "the page to load")

    async def eval(self, expression: str) -> Any:
        out = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)
        if "exceptionDetails" in out:
            raise BrowserError(f"{expression[:80]}: {out['exceptionDetails']}")
        return out["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"console: {self.console[-10:]}")
            await asyncio.sleep(0.25)

    async def screenshot(self, path: Path) -> Path:
        out = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(out["data"]))
        return path

    def errors(self) -> list[dict]:
        """Console errors, uncaught exceptions and browser log errors (failed loads, CSP)."""
        return [m for m in self.console if m["level"] in ("error", "assert")]

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

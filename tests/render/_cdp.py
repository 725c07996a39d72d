"""A small Chrome DevTools Protocol driver for the browser tests: headless Chromium, one page, evaluate, screenshot.

Chromium runs with ``--remote-debugging-port`` on 127.0.0.1 and every host but 127.0.0.1 unresolvable;
the page is driven over its DevTools websocket (tornado, which Jupyter brings): ``evaluate`` runs
an expression in the page and returns its JSON value, ``screenshot`` writes a PNG. Bounded: every
wait has a deadline, and ``close`` kills the browser it started (its own process group).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Any, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    last: Optional[BaseException] = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.read().decode("utf-8")
        except Exception as e:   # not up yet
            last = e
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f} s: {last}")


class Browser:
    """Headless Chromium with one page, driven over CDP."""

    def __init__(self, chromium: str, width: int = 1280, height: int = 1800):
        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="ts-chromium-")
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             f"--remote-debugging-port={self.port}", "--remote-allow-origins=*", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._ids = itertools.count(1)
        self.loop = asyncio.new_event_loop()
        self.ws: Any = None
        try:
            wait_http(f"http://127.0.0.1:{self.port}/json/version", 30)
            pages = json.loads(wait_http(f"http://127.0.0.1:{self.port}/json/list", 10))
            page = next(p for p in pages if p.get("type") == "page")
            self.loop.run_until_complete(self._connect(page["webSocketDebuggerUrl"]))
        except BaseException:
            self.close()
            raise

    async def _connect(self, url: str) -> None:
        from tornado.websocket import websocket_connect

        self.ws = await websocket_connect(url, max_message_size=256 * 1024 * 1024)

    async def _call(self, method: str, params: dict, timeout: float) -> dict:
        i = next(self._ids)
        await self.ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"CDP {method} did not answer in {timeout:.0f} s")
            msg = await asyncio.wait_for(self.ws.read_message(), left)
            if msg is None:
                raise ConnectionError("the browser closed the DevTools connection")
            d = json.loads(msg)
            if d.get("id") == i:
                if "error" in d:
                    raise RuntimeError(f"CDP {method}: {d['error']}")
                return d.get("result", {})

    def call(self, method: str, timeout: float = 60, **params: Any) -> dict:
        return self.loop.run_until_complete(self._call(method, params, timeout))

    def goto(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float) -> Any:
        """Evaluate until the value is truthy; the last value when the deadline passes."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.5)
        return value

    def screenshot(self, path: str, full_page: bool = True) -> str:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            m = self.call("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m.get("contentSize")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"],
                                                            "height": min(size["height"], 8000), "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.ws is not None:
                self.ws.close()
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except Exception:
            pass
        self.proc.wait(timeout=30)
        self.loop.close()

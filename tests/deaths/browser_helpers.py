"""A real browser for the report: Debian's chromium, headless, driven over the DevTools protocol.

The page is loaded in a fresh profile with the network machinery off; every console message,
uncaught exception, log entry and network request is collected, so a test can say "no console
error" and "nothing but the file itself was loaded", read the DOM and keep a screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import websocket

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1200,900",
)


def available() -> bool:
    return Path(CHROMIUM).is_file()


class Page:
    """One DevTools session on a page target."""

    def __init__(self, ws_url: str) -> None:
        self.socket = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self.ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_event(self, method: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events if e.get("method") == method]
            if found:
                return found[0]
            self.socket.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(websocket.WebSocketTimeoutException):
                self.events.append(json.loads(self.socket.recv()))
        raise AssertionError(f"no {method} within {timeout} s")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def poll(self, expression: str, timeout: float = 30) -> Any:
        """Evaluate until the value is truthy (no sleep as synchronisation: a condition)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            self.call(
                "Runtime.evaluate",
                expression="new Promise(r => setTimeout(r, 100))",
                awaitPromise=True,
            )
        raise AssertionError(f"{expression} still false after {timeout} s")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries so far."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(
                    " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
                )
            elif method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(params["entry"].get("text", ""))
        return found

    def requests(self) -> list[str]:
        return [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
        ]

    def screenshot(self, path: Path) -> Path:
        height = self.evaluate("document.documentElement.scrollHeight")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1200,
            height=min(height, 8000),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path


@contextlib.contextmanager
def opened(url: str, profile: Path) -> Iterator[Page]:
    """Chromium with a fresh profile, `url` loaded in its page, the page's events recorded."""
    browser = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            if browser.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"chromium did not start (exit {browser.poll()})")
            time.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = Page(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])
        try:
            for domain in ("Runtime", "Log", "Page", "Network"):
                page.call(f"{domain}.enable")
            page.call("Page.navigate", url=url)
            page.wait_event("Page.loadEventFired")
            yield page
        finally:
            page.socket.close()
    finally:  # the browser and its renderer, zygote and utility processes: its whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(browser.pid, signal.SIGTERM)
        try:
            browser.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait(10)

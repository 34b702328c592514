"""Debian's headless Chromium, driven over the DevTools protocol through a pipe.

With `--remote-debugging-pipe` the browser reads commands from its file descriptor 3 and
writes replies and events to 4, each a JSON object ended by a NUL byte: no websocket and
no extra package. One browser serves every page of a test, so a page costs a navigation,
not a browser start.

The browser resolves no host name but 127.0.0.1 (`--host-resolver-rules`), so nothing it
is asked for leaves the machine; every request a page makes is recorded all the same, and
a test fails on any that was meant for elsewhere.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--mute-audio",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--remote-debugging-pipe",
]
WIDTH, HEIGHT = 1280, 900
LOCAL_SCHEMES = {"data", "blob", "about"}


def executable() -> str:
    """Chromium's path; the test fails (never skips) where it is not installed."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "chromium is not installed: scripts/bootstrap dev installs Debian's package",
            pytrace=False,
        )
    return path


class BrowserError(RuntimeError):
    """The browser answered a command with an error, or not in time."""


@dataclass
class Visit:
    """What one page did: its console errors and every URL it requested."""

    url: str
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def foreign_requests(self) -> list[str]:
        """Requests for anything but 127.0.0.1 (data: and blob: URLs stay in the page)."""
        return [
            url
            for url in self.requests
            if urlsplit(url).scheme not in LOCAL_SCHEMES and urlsplit(url).hostname != "127.0.0.1"
        ]


class Browser:
    def __init__(self, process: subprocess.Popen[bytes], commands: int, replies: int) -> None:
        self._process = process
        self._commands = commands
        self._replies = replies
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        self._answers: dict[int, dict[str, Any]] = {}
        self._session = ""

    # -- the protocol ---------------------------------------------------------------------

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None
    ) -> Any:
        """Send one command and return its result: to the page's session by default, to
        the browser itself with session="" (and before a tab is open)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        target = self._session if session is None else session
        if target:
            message["sessionId"] = target
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        number, deadline = self._next_id, time.monotonic() + 30
        while number not in self._answers:
            if not self._take(deadline):
                raise BrowserError(f"no answer to {method} in 30 s")
        reply = self._answers.pop(number)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def _take(self, deadline: float) -> bool:
        """Read one message: an answer is kept for its command, an event handled."""
        message = self._read(deadline)
        if message is None:
            return False
        if "id" in message:
            self._answers[message["id"]] = message
        else:
            self._event(message)
        return True

    def _read(self, deadline: float) -> dict[str, Any] | None:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                return None
            chunk = os.read(self._replies, 1 << 20)
            if not chunk:
                raise BrowserError(f"the browser closed its pipe (exit {self._process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)  # type: ignore[no-any-return]

    def _event(self, message: dict[str, Any]) -> None:
        if message.get("method") == "Target.attachedToTarget":
            # A worker of the page (the search index): watch its console and requests too.
            worker = message["params"]["sessionId"]
            for domain in ("Runtime", "Network"):
                with contextlib.suppress(BrowserError):
                    self.send(f"{domain}.enable", session=worker)
        self._events.append(message)

    def settle(self, seconds: float) -> None:
        """Take in the events of the next `seconds`."""
        deadline = time.monotonic() + seconds
        while self._take(deadline):
            pass

    def wait_for_event(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self._events):
            if not self._take(deadline):
                raise BrowserError(f"no {method} in {timeout} s")

    # -- pages ----------------------------------------------------------------------------

    def open_tab(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session="")["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send(
            "Target.setAutoAttach",
            {"autoAttach": True, "waitForDebuggerOnStart": False, "flatten": True},
        )
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False},
        )

    def visit(self, url: str) -> Visit:
        """Load `url`; the visit collects what the page logs and requests from now on."""
        self._events.clear()
        self.send("Page.navigate", {"url": url})
        self.wait_for_event("Page.loadEventFired", timeout=30)
        return Visit(url)

    def collect(self, visit: Visit) -> Visit:
        """Fill `visit` with the console errors and requests seen since it started."""
        for event in self._events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                visit.requests.append(params["request"]["url"])
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                args = params["args"]
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in args)
                visit.errors.append(f"console.{params['type']}: {text}")
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                description = details.get("exception", {}).get("description", details["text"])
                visit.errors.append(f"uncaught: {description}")
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                entry = params["entry"]
                visit.errors.append(f"{entry['source']}: {entry['text']} {entry.get('url', '')}")
        return visit

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float) -> bool:
        """Poll a JavaScript condition; False if it did not hold within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.evaluate(expression):
                return True
            self.settle(0.1)
        return bool(self.evaluate(expression))

    def document(self) -> dict[str, Any]:
        """The DOM tree, shadow roots included (closed ones too, which scripts cannot see)."""
        return self.send("DOM.getDocument", {"depth": -1, "pierce": True})["root"]  # type: ignore[no-any-return]

    def screenshot(self, path: Path, *, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params["captureBeyondViewport"] = True
            params["clip"] = {"x": 0, "y": 0, "width": WIDTH, "height": size["height"], "scale": 1}
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", params)["data"]))


def _high(fd: int) -> int:
    """A copy of `fd` numbered 10 or more, so it cannot collide with 3 or 4 in the child."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return copy


@contextlib.contextmanager
def chromium() -> Iterator[Browser]:
    """A headless Chromium with a fresh profile, stopped on exit."""
    path = executable()
    commands_read, commands_write = map(_high, os.pipe())
    replies_read, replies_write = map(_high, os.pipe())

    def give_pipes() -> None:  # in the child, before exec: the protocol's 3 and 4
        os.dup2(commands_read, 3)
        os.dup2(replies_write, 4)

    with tempfile.TemporaryDirectory(prefix="inbox-docs-chromium-") as profile:
        log = Path(profile) / "stderr.log"
        with log.open("wb") as stderr:
            process = subprocess.Popen(
                [path, *FLAGS, f"--user-data-dir={profile}/profile", "about:blank"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                close_fds=False,
                preexec_fn=give_pipes,  # noqa: PLW1509 (only dup2 before exec)
            )
        os.close(commands_read)
        os.close(replies_write)
        try:
            browser = Browser(process, commands_write, replies_read)
            try:
                browser.send("Browser.getVersion")
            except BrowserError as exc:
                raise BrowserError(f"{exc}; its log: {log.read_text()[-2000:]}") from exc
            yield browser
        finally:
            with contextlib.suppress(BrowserError, OSError):
                browser.send("Browser.close", session="")
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            os.close(commands_write)
            os.close(replies_read)

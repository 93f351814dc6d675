"""A real headless Chromium for the tests, driven over the Chrome DevTools Protocol (CDP) with
aiohttp's websocket client: started and stopped by PID, one tab, navigation that waits for the
page's load event, the DOM read with ``Runtime.evaluate``, forms filled and submitted as a user
would, screenshots.

    browser = Chromium(tmp_path / "chromium").start()
    async with browser.tab(1280, 800) as tab:
        await tab.goto("http://127.0.0.1:8480/console/")
        title = await tab.eval("document.title")
        await tab.screenshot(Path("overview.png"))
    browser.stop()
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))


class CdpError(RuntimeError):
    """A CDP call failed, or a page did not load in time (the message says which)."""


@dataclass
class Chromium:
    """One headless Chromium with its own profile directory under ``workdir``."""

    workdir: Path
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.profile = self.workdir / "profile"
        self.log = self.workdir / "chromium.log"

    @staticmethod
    def available() -> str:
        """Why a browser test cannot run here ("" when it can)."""
        if not CHROMIUM.exists():
            return f"{CHROMIUM} is absent (Debian: apt-get install chromium)"
        return ""

    def start(self, timeout: float = 30.0) -> Chromium:
        active = self.profile / "DevToolsActivePort"
        active.unlink(missing_ok=True)
        command = [
            str(CHROMIUM),
            "--headless=new",
            "--no-sandbox",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--mute-audio",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "about:blank",
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:  # Chromium writes its port (and browser target) once it listens
            if self.proc.poll() is not None:
                raise CdpError(f"chromium exited with {self.proc.returncode}: {self.logs()}")
            lines = active.read_text().splitlines() if active.exists() else []
            if len(lines) >= 2 and lines[0].isdigit():
                self.port = int(lines[0])
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise CdpError(f"chromium wrote no DevToolsActivePort in {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM to the browser's PID (its own session: its helpers too), then SIGKILL."""
        proc = self.proc
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
        shutil.rmtree(self.profile, ignore_errors=True)

    def logs(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    @contextlib.asynccontextmanager
    async def tab(self, width: int = 1280, height: int = 800) -> AsyncIterator[Tab]:
        """A new tab of ``width`` x ``height`` CSS pixels, closed at the end."""
        base = f"http://127.0.0.1:{self.port}"
        async with aiohttp.ClientSession() as session:
            async with session.put(f"{base}/json/new?about:blank") as reply:
                target = await reply.json()
            ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
            tab = Tab(ws)
            reader = asyncio.create_task(tab.read())
            try:
                await tab.call("Page.enable")
                await tab.call("Network.enable")
                await tab.call(
                    "Emulation.setDeviceMetricsOverride",
                    width=width,
                    height=height,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                yield tab
            finally:
                reader.cancel()
                await ws.close()
                async with session.get(f"{base}/json/close/{target['id']}") as reply:
                    await reply.read()


class Tab:
    """One page target: CDP calls by id, its events kept for who waits on them."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
        self.ws = ws
        self.ids = 0
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.responses: dict[str, dict[str, Any]] = {}  # url: its last response (status, headers)

    async def read(self) -> None:
        async for message in self.ws:
            doc = json.loads(message.data)
            if "id" in doc:
                future = self.waiting.pop(doc["id"], None)
                if future is not None and not future.done():
                    if "error" in doc:
                        future.set_exception(CdpError(f"{doc['error']}"))
                    else:
                        future.set_result(doc.get("result", {}))
            else:
                if doc.get("method") == "Network.responseReceived":
                    response = doc["params"]["response"]
                    self.responses[response["url"]] = response
                await self.events.put(doc)

    async def call(self, method: str, timeout: float = 30.0, **params: Any) -> Any:
        self.ids += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[self.ids] = future
        await self.ws.send_str(json.dumps({"id": self.ids, "method": method, "params": params}))
        return await asyncio.wait_for(future, timeout)

    async def loaded(self, timeout: float = 30.0) -> None:
        """Until the page's load event (events before it are dropped)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise CdpError(f"no load event in {timeout} s")
            try:
                event = await asyncio.wait_for(self.events.get(), left)
            except asyncio.TimeoutError:
                continue
            if event.get("method") == "Page.loadEventFired":
                return

    def drain(self) -> None:
        while not self.events.empty():
            self.events.get_nowait()

    async def goto(self, url: str) -> dict[str, Any]:
        """Loads ``url``; the response of the page's last document (after redirects)."""
        self.drain()
        done = await self.call("Page.navigate", url=url)
        if done.get("errorText"):
            raise CdpError(f"{url}: {done['errorText']}")
        await self.loaded()
        return await self.document()

    async def document(self) -> dict[str, Any]:
        """The response of the page now shown (status, headers)."""
        shown = await self.eval("location.href")
        return self.responses.get(shown, {})

    async def eval(self, expression: str) -> Any:
        """``expression``'s value in the page (JSON-able)."""
        done = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in done:
            raise CdpError(f"{expression}: {done['exceptionDetails']}")
        return done["result"].get("value")

    async def text(self, selector: str) -> str | None:
        """The text of the first element ``selector`` picks (None: none)."""
        found = await self.eval(
            f"(e => e ? e.innerText : null)(document.querySelector({json.dumps(selector)}))"
        )
        return found if found is None else str(found)

    async def texts(self, selector: str) -> list[str]:
        return list(
            await self.eval(
                f"[...document.querySelectorAll({json.dumps(selector)})].map(e => e.innerText)"
            )
        )

    async def exists(self, selector: str) -> bool:
        return bool(await self.eval(f"!!document.querySelector({json.dumps(selector)})"))

    async def fill(self, selector: str, value: str) -> None:
        await self.eval(
            f"document.querySelector({json.dumps(selector)}).value = {json.dumps(value)}"
        )

    async def click(self, selector: str) -> dict[str, Any]:
        """Clicks ``selector`` (a submit button, a link) and waits for the page it loads."""
        self.drain()
        await self.eval(f"document.querySelector({json.dumps(selector)}).click()")
        await self.loaded()
        return await self.document()

    async def set_cookie(self, name: str, value: str, url: str) -> None:
        await self.call(
            "Network.setCookie", name=name, value=value, url=url, httpOnly=True, sameSite="Strict"
        )

    async def clear_cookies(self) -> None:
        await self.call("Network.clearBrowserCookies")

    async def screenshot(self, path: Path) -> None:
        done = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(_write, path, base64.b64decode(done["data"]))


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)

"""What the browser tests share: the paths, Chromium's flags, the server's /metrics, and the page."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

REPO = Path(__file__).resolve().parents[3]
ENGINE_DIR = Path(os.environ.get("TRTSERVER_TEST_ENGINE_DIR", REPO / "engines" / "SmolLM2-135M-Instruct"))
OUT = REPO / "tests" / "out" / "playground"
CHROMIUM = os.environ.get("TRTSERVER_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("TRTSERVER_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
MODEL = "SmolLM2-135M-Instruct"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1000",
                  "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(base: str, process: subprocess.Popen[bytes], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("server did not become healthy")


def metric(base: str, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when the series does not exist yet)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r"\s+(\S+)"
    match = re.search(r"^" + pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


class Page:
    """The playground page in the browser, by the ids of its elements."""

    def __init__(self, driver: webdriver.Chrome, base: str) -> None:
        self.driver, self.base = driver, base

    def open(self) -> None:
        self.driver.get(f"{self.base}/")
        self.wait(lambda d: self.text("model-id") != "…" or self.text("status") != "", 30)

    def el(self, element_id: str) -> WebElement:
        return self.driver.find_element("id", element_id)

    def text(self, element_id: str) -> str:
        return str(self.driver.execute_script("return document.getElementById(arguments[0]).textContent",
                                              element_id))

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def wait(self, condition: Any, timeout: float = 120.0) -> Any:
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.1).until(condition)
        except TimeoutException:
            self.screenshot("timed-out")
            raise AssertionError(f"timed out after {timeout} s; the page says {self.text('status')!r}") from None

    def fill(self, element_id: str, value: str) -> None:
        """Set a field as typing would (input and change events), without a keystroke per character."""
        self.js("const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                "el.dispatchEvent(new Event('input', {bubbles: true}));"
                "el.dispatchEvent(new Event('change', {bubbles: true}));", element_id, value)

    def check(self, element_id: str, on: bool = True) -> None:
        if self.el(element_id).is_selected() != on:
            self.el(element_id).click()

    def mode(self, name: str) -> None:
        self.el(f"mode-{name}").click()

    def tab(self, name: str) -> None:
        self.driver.find_element("css selector", f'.tabs button[data-tab="{name}"]').click()

    def send(self) -> None:
        self.el("send").click()

    def busy(self) -> bool:
        return not self.el("send").is_enabled()

    def wait_done(self, timeout: float = 120.0) -> str:
        self.wait(lambda d: not self.busy(), timeout)
        return self.text("status")

    def answer(self, index: int = 0) -> str:
        return str(self.js("const c = document.querySelectorAll('#output .choice .text')[arguments[0]];"
                           "return c ? c.textContent : '';", index))

    def record_frames(self) -> None:
        """From now on, the answer's length at every animation frame, into ``window.frames_seen``."""
        self.js("window.frames_seen = []; window.frames_stop = false;"
                "const tick = () => { const c = document.querySelector('#output .choice .text');"
                " window.frames_seen.push(c ? c.textContent.length : 0);"
                " if (!window.frames_stop) requestAnimationFrame(tick); };"
                "requestAnimationFrame(tick);")

    def frames(self) -> list[int]:
        return list(self.js("window.frames_stop = true; return window.frames_seen;"))

    def console_errors(self) -> list[dict[str, Any]]:
        return [entry for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def screenshot(self, name: str) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(OUT / f"{name}.png"))

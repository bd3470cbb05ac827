"""A real server on the default model and headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make install`` adds) driving the page through selenium.

The browser reaches nothing but the loopback server: every host name but 127.0.0.1 fails to
resolve, and selenium uses the installed chromedriver directly (Selenium Manager never runs).
Screenshots of each state go to ``tests/out/playground/`` at the top of the repository.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from playground_support import (
    CHROMEDRIVER,
    CHROMIUM,
    CHROMIUM_FLAGS,
    ENGINE_DIR,
    Page,
    free_port,
    wait_healthy,
)
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    """Extra ``trtserver serve`` flags; a test module overrides this fixture to change them."""
    return []


@pytest.fixture(scope="module")
def base_url(server_args: list[str]) -> Iterator[str]:
    if not (ENGINE_DIR / "trtserver.json").exists():
        pytest.fail(f"{ENGINE_DIR} is missing: run `make engines` first")
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / f"trtserver-test-playground-{port}.log", "wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "trtserver.cli", "serve", str(ENGINE_DIR), "--port", str(port), "--engine", "torch",
         "--device", os.environ.get("TRTSERVER_TEST_DEVICE", "cpu"), "--max-batch-size", "4",
         "--max-model-len", "2048", *server_args],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            pytest.fail(f"{path} is missing: run `make install` (it installs Debian's chromium and chromium-driver)")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="playground-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager, should anything call it, downloads nothing
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


@pytest.fixture
def page(browser: webdriver.Chrome, base_url: str) -> Page:
    browser.get("about:blank")
    return Page(browser, base_url)

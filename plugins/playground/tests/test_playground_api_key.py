"""The page on a server with an API key: it loads without one, says so on a 401, and works with it."""

from __future__ import annotations

import pytest
from playground_support import MODEL, Page

KEY = "k-playground-test"


@pytest.fixture(scope="module")
def server_args() -> list[str]:
    return ["--api-keys", KEY]


def test_401_message_then_works_with_the_key(page: Page) -> None:
    page.driver.get(f"{page.base}/playground/")
    page.js("sessionStorage.clear()")
    page.open()
    # the page itself loads without a key; its first API call is refused and it says what to do
    assert "API key" in page.text("status") and "401" in page.text("status")
    assert page.text("model-id") == "…"
    page.mode("completion")
    page.fill("prompt", "Hello")
    page.fill("max_tokens", "4")
    page.send()
    status = page.wait_done(30)
    assert "401" in status and "API key" in status
    assert page.js("return document.getElementById('status').className") == "error"
    assert "needs-key" in (page.el("api-key").get_attribute("class") or "")
    page.screenshot("09-api-key-missing")

    page.fill("api-key", "wrong")
    page.send()
    assert "401" in page.wait_done(30)

    page.fill("api-key", KEY)
    page.wait(lambda d: page.text("model-id") == MODEL, 10)
    page.send()
    assert page.wait_done().startswith("Done"), page.text("status")
    assert len(page.answer()) > 0
    assert "needs-key" not in (page.el("api-key").get_attribute("class") or "")
    page.screenshot("10-api-key-given")

    # kept while the tab stays open: a reload still has it
    assert page.js("return sessionStorage.getItem('trtserver-playground-api-key')") == KEY
    page.open()
    page.wait(lambda d: page.text("model-id") == MODEL, 10)
    assert page.el("api-key").get_attribute("value") == KEY
    assert page.text("status") == ""

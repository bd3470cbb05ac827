"""One behavioural test per hook (``test_hook_<name>``; tests/unit/test_hooks_meta.py checks that
every hook has one), on a scripted engine, with one app and one test plugin for the whole module."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from trtserver import hookimpl
from trtserver.config import ServerConfig
from trtserver.errors import PermissionDenied
from trtserver.http.app import STATE
from trtserver.scripted_engine import CHAT_TEMPLATE, ScriptedEngine, reply, scripted_tokenizer, write_engine_dir
from trtserver.testing import serve_scripted
from trtserver.text import StopMatch
from trtserver.tokenizer import Tokenizer

FORCED_TOKEN = scripted_tokenizer().encode("a", add_special_tokens=False)[0]
ANSWER = reply(" The quick brown fox jumps over the lazy dog.")


class CharStop:
    def __init__(self, char: str) -> None:
        self.char = char

    def find(self, text: str, new_from: int) -> StopMatch | None:
        at = text.find(self.char)
        return None if at < 0 else StopMatch(at, at + 1, f"char:{self.char}")

    def hold(self, text: str) -> int:
        return 0


class OnlyToken:
    """A guide that allows one token, for ever."""

    def __init__(self, token: int) -> None:
        self.token = token

    def new_state(self) -> OnlyToken:
        return self

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row, self.token // 32] |= 1 << (self.token % 32)

    def accept_token(self, token_id: int) -> bool:
        return token_id == self.token

    def is_terminated(self) -> bool:
        return False


class HookPlugin:
    """Implements every hook; each behaviour is switched on by a request field or header."""

    def __init__(self) -> None:
        self.engine_factory_calls: list[str] = []
        self.fingerprint_calls = 0
        self.quota_calls = 0
        self.quota_store: Any = None
        self.ready: list[tuple[bool, Any]] = []
        self.guides: list[tuple[Any, int]] = []
        self.received_async: list[str] = []

    @hookimpl
    def trtserver_register_engines(self, register: Callable[..., None]) -> None:
        def factory(config: ServerConfig) -> Any:
            self.engine_factory_calls.append(config.engine)
            return ScriptedEngine(config, ANSWER)

        register("hooktest", factory)

    @hookimpl
    def trtserver_app_created(self, app: web.Application, config: ServerConfig) -> None:
        async def hello(request: web.Request) -> web.Response:
            return web.json_response({"hello": config.engine})

        app.router.add_get("/plugin/hello", hello)

    @hookimpl
    def trtserver_system_fingerprint(self, engine_info: Any) -> str:
        self.fingerprint_calls += 1
        return f"fp_hooktest_{engine_info.backend}"

    @hookimpl
    def trtserver_quota_store(self, config: ServerConfig) -> Any:
        from trtserver.quota import MemoryQuotaStore

        self.quota_calls += 1
        self.quota_store = MemoryQuotaStore()  # the built-in store, as our own answer (firstresult: ours wins)
        return self.quota_store

    @hookimpl
    def trtserver_request_received(self, request: Any, context: Any) -> Any:
        if context.headers.get("X-Deny"):
            raise PermissionDenied("denied by the test plugin", param="prompt")
        if context.extra.get("slow_check"):
            async def check() -> None:
                await asyncio.sleep(0.01)
                self.received_async.append(context.request_id)
                if context.extra["slow_check"] == "deny":
                    raise PermissionDenied("denied asynchronously")

            return check()
        return None

    @hookimpl
    def trtserver_register_guided_backends(self, register: Callable[..., None]) -> None:
        def compile_guide(spec: Any, context: Any) -> OnlyToken:
            self.guides.append((spec, context.vocab_size))
            return OnlyToken(FORCED_TOKEN)

        register("HookTest", compile_guide)

    @hookimpl
    def trtserver_logits_processors(self, request: Any, context: Any) -> list[Callable[[], Any]] | None:
        if not context.extra.get("force_token"):
            return None

        def force(output_token_ids: Any, logits: Any) -> None:
            keep = logits[FORCED_TOKEN].item()
            logits.fill_(float("-inf"))
            logits[FORCED_TOKEN] = keep

        return [lambda: force]

    @hookimpl
    def trtserver_stop_checkers(self, request: Any, context: Any) -> list[Callable[[], Any]] | None:
        char = context.extra.get("stop_at_char")
        return [lambda: CharStop(char)] if char else None

    @hookimpl
    def trtserver_response_ready(self, request: Any, response: Any, context: Any) -> Any:
        async def record() -> None:
            self.ready.append((request.stream, response))

        return record()


@pytest.fixture(scope="module")
def plugin() -> HookPlugin:
    return HookPlugin()


@pytest.fixture(scope="module")
async def client(plugin: HookPlugin) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve_scripted([plugin], installed_plugins=False, engine="hooktest") as test_client:
        yield test_client


async def post(client: TestClient[Any, Any], headers: dict[str, str] | None = None, **body: Any) -> Any:
    response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                           **body}, headers=headers)
    return response.status, await response.json()


async def stream(client: TestClient[Any, Any], **body: Any) -> list[dict[str, Any]]:
    response = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                                           "stream": True, **body})
    events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_hook_trtserver_register_engines(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    assert plugin.engine_factory_calls == ["hooktest"]  # selected by --engine hooktest, built once
    status, body = await post(client)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def test_hook_trtserver_app_created(client: TestClient[Any, Any]) -> None:
    response = await client.get("/plugin/hello")
    assert response.status == 200 and await response.json() == {"hello": "hooktest"}


async def test_hook_trtserver_system_fingerprint(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    assert plugin.fingerprint_calls == 1
    status, body = await post(client)
    assert body["system_fingerprint"] == "fp_hooktest_scripted"
    assert {c["system_fingerprint"] for c in await stream(client)} == {"fp_hooktest_scripted"}


async def test_hook_trtserver_quota_store(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    pm = client.app[STATE].pm
    assert pm.hook.trtserver_quota_store.spec.opts["firstresult"]
    service = client.app[STATE].service
    assert plugin.quota_calls == 1  # asked once, at start-up
    status, _ = await post(client)
    assert status == 200 and plugin.quota_calls == 1  # never per request
    assert service.quota_store is plugin.quota_store


async def test_hook_trtserver_request_received(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    status, body = await post(client, headers={"X-Deny": "1"})
    assert status == 403
    assert body["error"]["type"] == "permission_error" and body["error"]["param"] == "prompt"
    status, body = await post(client, slow_check="deny")  # an awaitable result is awaited
    assert status == 403 and body["error"]["message"] == "denied asynchronously"
    status, body = await post(client, slow_check="ok", headers={"X-Request-Id": "async-ok"})
    assert status == 200 and plugin.received_async[-1] == "async-ok"


async def test_hook_trtserver_register_guided_backends(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    from trtserver.guided import GuideSpec

    # names match whatever their case: registered as HookTest
    status, body = await post(client, guided_regex="a+", guided_decoding_backend="hooktest", return_token_ids=True)
    assert status == 200 and body["choices"][0]["token_ids"] == [FORCED_TOKEN] * 4
    vocab_size = client.app[STATE].engine.info.vocab_size
    assert plugin.guides[-1] == (GuideSpec("regex", "a+"), vocab_size)
    status, body = await post(client, structured_outputs={"choice": ["a", "b"], "backend": " HOOKTEST"})
    assert status == 200 and plugin.guides[-1][0] == GuideSpec("choice", ("a", "b"))

    status, body = await post(client, guided_regex="[ab]+", guided_decoding_backend="nobackend")
    assert status == 400 and body["error"]["param"] == "guided_decoding_backend"
    assert "'nobackend'" in body["error"]["message"] and "available: hooktest" in body["error"]["message"]
    status, body = await post(client, guided_regex="[ab]+")  # no backend named: the default, xgrammar
    assert status == 400 and body["error"]["param"] == "guided_decoding_backend"
    assert "'xgrammar'" in body["error"]["message"]


class GuideClaimer:
    def __init__(self, name: str) -> None:
        self.name = name

    @hookimpl
    def trtserver_register_guided_backends(self, register: Callable[..., None]) -> None:
        register(self.name, lambda spec, context: OnlyToken(FORCED_TOKEN))


async def test_two_plugins_registering_one_guided_backend_stop_start_up() -> None:
    from trtserver.plugins import PluginLoadError, new_plugin_manager
    from trtserver.serving.core import guided_backends

    pm = new_plugin_manager()
    pm.register(GuideClaimer("mine"), name="first")
    pm.register(GuideClaimer("Mine"), name="second")
    with pytest.raises(PluginLoadError, match="guided decoding backend 'mine' is registered by both") as caught:
        guided_backends(pm)
    assert "'first'" in str(caught.value) and "'second'" in str(caught.value)
    with pytest.raises(RuntimeError, match="registered by both"):  # the server does not start
        async with serve_scripted([GuideClaimer("mine"), GuideClaimer("mine")], installed_plugins=False):
            pass


async def test_hook_trtserver_logits_processors(client: TestClient[Any, Any]) -> None:
    _, free = await post(client, return_token_ids=True)
    _, forced = await post(client, return_token_ids=True, force_token=True)
    assert free["choices"][0]["token_ids"] != [FORCED_TOKEN] * 4
    assert forced["choices"][0]["token_ids"] == [FORCED_TOKEN] * 4


async def test_hook_trtserver_stop_checkers(client: TestClient[Any, Any]) -> None:
    _, free = await post(client, max_tokens=12)
    text = free["choices"][0]["text"]
    char = next(c for c in text[1:] if c.strip())
    _, stopped = await post(client, max_tokens=12, stop_at_char=char)
    choice = stopped["choices"][0]
    assert choice["text"] == text[: text.index(char)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", f"char:{char}")


async def test_hook_trtserver_response_ready(client: TestClient[Any, Any], plugin: HookPlugin) -> None:
    plugin.ready.clear()
    _, body = await post(client)
    chunks = await stream(client)
    assert [stream for stream, _ in plugin.ready] == [False, True]
    whole, streamed = plugin.ready[0][1], plugin.ready[1][1]
    assert whole.choices[0].text == body["choices"][0]["text"]
    assert streamed.choices[0].text == "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed.choices[0].text == whole.choices[0].text  # greedy: same text both ways
    assert streamed.choices[0].finish_reason == "length"


class TemplatePlugin:
    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.seen: list[str | None] = []

    @hookimpl
    def trtserver_chat_template(self, config: ServerConfig, model_template: str | None) -> str | None:
        self.seen.append(model_template)
        return self.answer


async def test_hook_trtserver_chat_template(tmp_path: Path) -> None:
    from trtserver.chat_template import resolve_chat_template
    from trtserver.plugins import new_plugin_manager

    engine_dir = write_engine_dir(tmp_path)
    tokenizer = Tokenizer.from_dir(engine_dir)
    config = ServerConfig(engine_dir=str(engine_dir))
    messages = [{"role": "user", "content": "Hi"}]
    pm = new_plugin_manager()
    silent, patching = TemplatePlugin(None), TemplatePlugin("{{ bos_token }}plugin: {{ messages[0].content }}")
    pm.register(silent, name="silent")
    pm.register(patching, name="patching")
    template = resolve_chat_template(config, pm, tokenizer)
    assert template is not None and template.render(messages) == "<|im_start|>plugin: Hi"
    # firstresult: the later-registered plugin answered first, so the silent one was never asked
    assert patching.seen == [CHAT_TEMPLATE] and silent.seen == []
    pm.unregister(patching)
    template = resolve_chat_template(config, pm, tokenizer)  # no answer: the engine directory's template
    assert template is not None and template.render(messages) == "<|im_start|>user\nHi<|im_end|>\n"
    assert silent.seen == [CHAT_TEMPLATE]
    pm.register(patching, name="patching")
    overridden = msgspec.structs.replace(config, chat_template="operator: {{ messages[0].content }}")
    template = resolve_chat_template(overridden, pm, tokenizer)  # --chat-template wins, plugins are not asked
    assert template is not None and template.render(messages) == "operator: Hi" and len(patching.seen) == 1


class ToolParserPlugin:
    @hookimpl
    def trtserver_register_tool_parsers(self, register: Callable[..., None]) -> None:
        register("shout", lambda tools: ShoutParser())


class ShoutParser:
    def feed(self, text: str) -> list[Any]:
        from trtserver.tool_calls import ContentDelta

        return [ContentDelta(text.upper())]

    def finish(self) -> list[Any]:
        return []


async def test_hook_trtserver_register_tool_parsers() -> None:
    from trtserver.plugins import load_plugins, new_plugin_manager
    from trtserver.tool_calls import ContentDelta, registered_tool_parsers, tool_parser_factory

    pm = new_plugin_manager()
    load_plugins(pm, allowlist=[])  # trtserver's own plugins: the built-in hermes parser
    pm.register(ToolParserPlugin(), name="shouting")
    assert set(registered_tool_parsers(pm)) >= {"hermes", "shout"}
    parser = tool_parser_factory(pm, "shout")([])
    assert parser.feed("hi") == [ContentDelta("HI")] and parser.finish() == []

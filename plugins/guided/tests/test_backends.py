"""Every backend driven through its TokenConstraint with the real tokenizer (no model)."""

from __future__ import annotations

import importlib.metadata
import json
import re
import time

import jsonschema
import numpy as np
import pluggy
import pytest
import torch
from packaging.version import Version
from trtserver.engine.base import GenerationRequest, SamplingParams, TokenConstraint
from trtserver.engine.torch.transport import messages as ipc
from trtserver.errors import InvalidRequest
from trtserver.guided import GuideContext, GuideSpec
from trtserver.tokenizer import Tokenizer

from trtserver_guided import plugin
from trtserver_guided.plugin import get_backend, guided_decoder

BACKENDS = ("xgrammar", "llguidance", "outlines", "lm-format-enforcer")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


LOOSE = {**SCHEMA, "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}}}


def words(context: GuideContext) -> int:
    return (context.vocab_size + 31) // 32


def allowed(state: TokenConstraint, context: GuideContext) -> np.ndarray:
    mask = torch.zeros(1, words(context), dtype=torch.int32)
    state.fill_bitmask(mask, 0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


def replay(state: TokenConstraint, ids: list[int], context: GuideContext) -> int | None:
    """Feed ``ids``; return the index of the first token the mask refused, else None."""
    for i, tid in enumerate(ids):
        if tid not in set(allowed(state, context).tolist()):
            return i
        assert state.accept_token(tid)
    return None


def fake_greedy(state: TokenConstraint, tokenizer: Tokenizer, context: GuideContext, seed: int,
                steps: int = 120) -> tuple[str, bool]:
    """A 'model' with seeded random logits and a liking for EOS, under the mask."""
    gen = torch.Generator().manual_seed(seed)
    eos = context.eos_token_ids[0]
    special = tokenizer.special_token_ids | set(context.eos_token_ids)
    mask = torch.zeros(1, words(context), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    out: list[int] = []
    for _ in range(steps):
        if state.is_terminated():
            return tokenizer.decode(out), True
        logits = torch.randn(1, context.vocab_size, generator=gen)
        logits[0, eos] += 6.0
        mask.zero_()
        state.fill_bitmask(mask, 0)
        ok = ((mask.unsqueeze(-1) >> shifts) & 1).view(1, -1)[:, : context.vocab_size].bool()
        assert ok.any(), "empty mask before termination"
        logits.masked_fill_(~ok, float("-inf"))
        tid = int(logits.argmax())
        assert tid not in special or tid in context.eos_token_ids
        assert tid < context.tokenizer.vocab_size
        assert state.accept_token(tid)
        if tid != eos:
            out.append(tid)
    return tokenizer.decode(out), state.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fake_model_outputs_are_valid(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    schema = GuideSpec("json", json.dumps(SCHEMA), disable_any_whitespace=True)
    regex = GuideSpec("regex", r"[a-c]{2,5}-\d{1,3}")
    choice = GuideSpec("choice", ("red", "green", "blue sky"))
    for seed in range(3):
        text, done = fake_greedy(guided_decoder(schema, backend, context).new_state(), tokenizer, context, seed)
        assert done, text
        # lm-format-enforcer can overshoot maxLength with a token that also closes the string
        jsonschema.validate(json.loads(text), SCHEMA if backend != "lm-format-enforcer" else LOOSE)
        text, done = fake_greedy(guided_decoder(regex, backend, context).new_state(), tokenizer, context, seed)
        assert done and re.fullmatch(r"[a-c]{2,5}-\d{1,3}", text), text
        text, done = fake_greedy(guided_decoder(choice, backend, context).new_state(), tokenizer, context, seed)
        assert done and text in choice.value, text


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance"))
def test_fake_model_grammar(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    spec = GuideSpec("grammar", 'root ::= num (("+" | "*") num)?\nnum ::= [1-9] [0-9]?')
    for seed in range(3):
        text, done = fake_greedy(guided_decoder(spec, backend, context).new_state(), tokenizer, context, seed)
        assert done and re.fullmatch(r"[1-9][0-9]?([+*][1-9][0-9]?)?", text), text


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance"))
def test_lark_grammar_on_llguidance_and_xgrammar(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    spec = GuideSpec("grammar", 'start: "a" | "bb"')
    state = guided_decoder(spec, backend, context).new_state()
    assert replay(state, tokenizer.encode("bb", add_special_tokens=False), context) is None
    assert state.is_terminated() or set(allowed(state, context).tolist()) <= set(context.eos_token_ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forced_json_replay_and_eos(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    spec = GuideSpec("json", json.dumps(SCHEMA))
    state = guided_decoder(spec, backend, context).new_state()
    text = '{"name":"Al","ok":true}' if backend == "llguidance" else '{"name": "Al", "ok": true}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert replay(state, ids[:-1], context) is None
    eos = context.eos_token_ids[0]
    assert eos not in allowed(state, context), "EOS allowed before the object is complete"
    assert replay(state, ids[-1:], context) is None
    assert eos in allowed(state, context), "EOS not allowed in an accepting state"
    # a complete object: terminated now (only EOS may follow) or after EOS
    if not state.is_terminated():
        assert state.accept_token(eos) and state.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_tokens_are_refused(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    state = guided_decoder(GuideSpec("regex", r"\d{3}"), backend, context).new_state()
    ids = set(allowed(state, context).tolist())
    assert not ids & (tokenizer.special_token_ids | set(context.eos_token_ids))
    assert max(ids) < tokenizer.vocab_size
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    assert letter not in ids
    assert state.accept_token(letter) is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_special_tokens_inside_json_string(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    state = guided_decoder(GuideSpec("json", json.dumps(schema)), backend, context).new_state()
    prefix = '{"s":"' if backend == "llguidance" else '{"s": "'
    assert replay(state, tokenizer.encode(prefix, add_special_tokens=False), context) is None
    inside = set(allowed(state, context).tolist())
    assert len(inside) > 1000
    assert not inside & (tokenizer.special_token_ids | set(context.eos_token_ids))
    assert max(inside) < tokenizer.vocab_size


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance", "outlines"))
def test_multibyte_characters_need_byte_tokens(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    spec = GuideSpec("choice", ("日本語", "龘 👍"))
    for target in spec.value:
        state = guided_decoder(spec, backend, context).new_state()
        assert replay(state, tokenizer.encode(target, add_special_tokens=False), context) is None
        assert context.eos_token_ids[0] in allowed(state, context)


@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_key_order_is_the_clients(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    props = {"b": {"type": "integer"}, "a": {"type": "integer"}}
    schema = json.dumps({"type": "object", "properties": props, "required": ["b", "a"],
                         "additionalProperties": False})
    sep = "" if backend == "llguidance" else " "
    state = guided_decoder(GuideSpec("json", schema), backend, context).new_state()
    ids = tokenizer.encode('{"b":' + sep + "1," + sep + '"a":' + sep + "2}", add_special_tokens=False)
    assert replay(state, ids, context) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_guide_crosses_to_the_engine_process_as_its_recipe(backend: str, context: GuideContext) -> None:
    """What the server sends its engine process: a few hundred bytes, compiled again on arrival (here,
    in the same process, that is the compile cache's copy)."""
    decoder = guided_decoder(GuideSpec("json", json.dumps(SCHEMA)), backend, context)
    request = GenerationRequest("guided", [1], SamplingParams(), guided=decoder)
    message = ipc.encode_request(request, context.tokenizer)
    assert len(message) < 4096
    _, rebuilt = ipc.decode_request(memoryview(message), context.tokenizer)
    assert isinstance(rebuilt, GenerationRequest) and rebuilt.guided is decoder


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_guides_are_cached(backend: str, context: GuideContext) -> None:
    spec = GuideSpec("regex", r"[xyz]{4}")
    first = guided_decoder(spec, backend, context)
    hits = get_backend(plugin.ALIASES[backend]).cache.hits
    assert guided_decoder(GuideSpec("regex", r"[xyz]{4}"), backend, context) is first
    assert get_backend(plugin.ALIASES[backend]).cache.hits == hits + 1
    assert guided_decoder(GuideSpec("regex", r"[xyz]{5}"), backend, context) is not first


def test_the_cache_is_bounded_by_the_bytes_of_its_guides() -> None:
    from trtserver_guided.cache import CompileCache

    cache: CompileCache[bytes] = CompileCache(max_entries=100, max_bytes=10, size=len)

    def get(key: str, value: bytes) -> bytes:
        out = cache.get(key, lambda: value, timeout=5)
        deadline = time.monotonic() + 5
        while cache.pending() and time.monotonic() < deadline:  # stored just after the caller wakes
            time.sleep(0.01)
        return out

    for key, value in (("a", b"1234"), ("b", b"5678"), ("c", b"90")):
        get(key, value)
    assert cache.bytes == 10 and len(cache) == 3
    assert get("a", b"") == b"1234"  # a hit: "a" is now the most recent
    get("d", b"xyz")
    assert "b" not in cache and "a" in cache and cache.bytes == 9
    assert get("huge", b"x" * 11) == b"x" * 11  # answered, not kept
    assert "huge" not in cache and cache.bytes == 9 and "d" in cache  # nor does it push the others out


def test_xgrammar_guides_count_their_bytes(context: GuideContext) -> None:
    backend = get_backend("xgrammar")
    before = backend.cache.bytes
    guide = guided_decoder(GuideSpec("regex", r"[a-z]{1,300}q"), "xgrammar", context)
    size = backend.footprint(guide.decoder)  # type: ignore[attr-defined]
    assert size > 10_000
    deadline = time.monotonic() + 5
    while backend.cache.bytes < before + size and time.monotonic() < deadline:  # stored after the caller wakes
        time.sleep(0.01)
    assert backend.cache.bytes >= before + size


def test_cache_key_keeps_schema_text(context: GuideContext) -> None:
    a = guided_decoder(GuideSpec("json", '{"type":"object","properties":{"x":{"type":"integer"}}}'), "xgrammar",
                       context)
    b = guided_decoder(GuideSpec("json", '{"properties":{"x":{"type":"integer"}},"type":"object"}'), "xgrammar",
                       context)
    assert a is not b


@pytest.mark.parametrize("backend", ("outlines", "lm-format-enforcer"))
def test_grammar_refused(backend: str, context: GuideContext) -> None:
    with pytest.raises(InvalidRequest, match=f"'{backend}' does not support grammars"):
        guided_decoder(GuideSpec("grammar", 'root ::= "a"'), backend, context)


@pytest.mark.parametrize("backend", ("xgrammar", "lm-format-enforcer"))
def test_whitespace_pattern_refused_where_unsupported(backend: str, context: GuideContext) -> None:
    with pytest.raises(InvalidRequest, match="whitespace_pattern"):
        guided_decoder(GuideSpec("json", json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"), backend, context)


@pytest.mark.parametrize("backend", ("llguidance", "outlines"))
def test_whitespace_pattern_honoured(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    spec = GuideSpec("json", json.dumps(SCHEMA), whitespace_pattern=r"[\n]?")
    state = guided_decoder(spec, backend, context).new_state()
    assert replay(state, tokenizer.encode('{\n"name":\n"A",\n"ok":\nfalse\n}', add_special_tokens=False),
                  context) is None
    state = guided_decoder(spec, backend, context).new_state()
    assert replay(state, tokenizer.encode('{ "name": "A"', add_special_tokens=False), context) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_spec_is_a_400_naming_the_backend(backend: str, context: GuideContext) -> None:
    with pytest.raises(InvalidRequest):
        guided_decoder(GuideSpec("regex", "(unclosed"), backend, context).new_state()


def test_unknown_backend_is_left_to_others(context: GuideContext) -> None:
    assert "someone-elses" not in plugin.backends()
    with pytest.raises(KeyError):
        guided_decoder(GuideSpec("regex", "a"), "someone-elses", context)


def test_only_installed_backends_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    missing = {"xgrammar", "outlines_core"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in missing else real_find_spec(name, *args))
    names = set(plugin.backends())
    assert names == {"llguidance", "guidance", "lm-format-enforcer", "lm_format_enforcer", "lmfe", "auto"}
    missing.add("llguidance")  # auto needs xgrammar or llguidance
    assert set(plugin.backends()) == {"lm-format-enforcer", "lm_format_enforcer", "lmfe"}


def test_aliases_and_auto(context: GuideContext) -> None:
    spec = GuideSpec("regex", "ab")
    assert guided_decoder(spec, "guidance", context) is guided_decoder(spec, "llguidance", context)
    assert guided_decoder(spec, "lmfe", context) is guided_decoder(spec, "lm-format-enforcer", context)
    assert guided_decoder(spec, "auto", context) is guided_decoder(spec, "xgrammar", context)
    # xgrammar cannot honour a whitespace regex: auto falls back to llguidance
    ws = GuideSpec("json", json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    assert guided_decoder(ws, "auto", context) is guided_decoder(ws, "llguidance", context)


def test_hook_through_pluggy(context: GuideContext) -> None:
    from trtserver.plugins import new_plugin_manager
    from trtserver.serving.core import guided_backends

    pm: pluggy.PluginManager = new_plugin_manager()
    pm.register(plugin, name="guided")
    registered = guided_backends(pm)
    assert set(registered) == set(plugin.ALIASES) | {"auto"}  # every library is installed here
    spec = GuideSpec("choice", ("a", "b"))
    assert registered["xgrammar"](spec, context) is get_backend("xgrammar").decoder(spec, context)
    assert registered["lmfe"](spec, context) is registered["lm-format-enforcer"](spec, context)


def test_entry_point_is_declared() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="trtserver")}
    assert names.get("guided") == "trtserver_guided.plugin"


def test_missing_library_is_a_400_with_install_hint(context: GuideContext, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def fake_import(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr("importlib.import_module", lambda name: fake_import(name))
    with pytest.raises(InvalidRequest, match=r"'llguidance' is not installed.*pip install 'trtserver-guided\[llguidance\]'"):
        guided_decoder(GuideSpec("regex", "never-compiled-before"), "llguidance", context)


def test_compile_timeout(context: GuideContext, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = get_backend("xgrammar")
    real = backend._compile

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(1.0)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(backend, "_compile", slow)
    quick = GuideContext(tokenizer=context.tokenizer, vocab_size=context.vocab_size,
                         eos_token_ids=context.eos_token_ids, compile_timeout_s=0.2)
    with pytest.raises(InvalidRequest, match=r"guide compilation exceeded 0.2 s"):
        guided_decoder(GuideSpec("regex", "slow-one"), "xgrammar", quick)


def test_outlines_compile_is_bounded(context: GuideContext, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtserver_guided.backends import outlines

    quick = GuideContext(tokenizer=context.tokenizer, vocab_size=context.vocab_size,
                         eos_token_ids=context.eos_token_ids, compile_timeout_s=1.5)
    blowup = json.dumps({"type": "string", "maxLength": 40})  # minutes and gigabytes unbounded
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="exceeded"):
        guided_decoder(GuideSpec("json", blowup), "outlines", quick)
    assert time.monotonic() - start < 5
    # a limit below what the worker already uses: every allocation fails, as a blow-up's would
    monkeypatch.setattr(outlines, "MAX_MB", 16)
    with pytest.raises(InvalidRequest, match="memory limit of 16 MiB"):
        guided_decoder(GuideSpec("regex", "[a-f]{3}"), "outlines", quick)


@pytest.mark.xfail(Version(importlib.metadata.version("outlines_core")) <= Version("0.2.14"), strict=True,
                   reason="outlines-core <= 0.2.14 drops transitions out of accepting states (fixed upstream)")
def test_outlines_optional_suffix(tokenizer: Tokenizer, context: GuideContext) -> None:
    state = guided_decoder(GuideSpec("choice", ("yes", "yes please")), "outlines", context).new_state()
    assert replay(state, tokenizer.encode("yes please", add_special_tokens=False), context) is None


@pytest.mark.parametrize("backend", ("xgrammar", "llguidance", "lm-format-enforcer"))
def test_optional_suffix(backend: str, tokenizer: Tokenizer, context: GuideContext) -> None:
    state = guided_decoder(GuideSpec("choice", ("yes", "yes please")), backend, context).new_state()
    assert replay(state, tokenizer.encode("yes please", add_special_tokens=False), context) is None

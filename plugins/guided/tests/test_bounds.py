"""Compiles that would run away are killed or refused; cheap compiles do not wait behind slow ones;
a guide that cannot be followed never lets a forbidden token through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_backends import allowed, replay
from trtserver.errors import APIError, InvalidRequest
from trtserver.guided import GuideContext, GuideSpec
from trtserver.tokenizer import Tokenizer

from trtserver_guided.plugin import guided_decoder

RUNAWAY_REGEX = "(a|b)*a(a|b){18}"  # a DFA of 2**19 states: minutes of pure Python in interegular


def with_timeout(context: GuideContext, seconds: float) -> GuideContext:
    return GuideContext(tokenizer=context.tokenizer, vocab_size=context.vocab_size,
                        eos_token_ids=context.eos_token_ids, compile_timeout_s=seconds)


def compile_children() -> list[int]:
    """Pids of this process's children that are compile workers."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"_compile_worker" in cmdline:
            found.append(int(entry.name))
    return found


def settle(predicate: object, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(predicate())  # type: ignore[operator]


def test_lmfe_runaway_regex_is_killed_at_the_deadline(context: GuideContext) -> None:
    guided_decoder(GuideSpec("regex", "warm[0-9]"), "lm-format-enforcer", context)  # tokenizer data built
    threads = threading.active_count()
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"guide compilation exceeded 1 s"):
        guided_decoder(GuideSpec("regex", RUNAWAY_REGEX), "lm-format-enforcer", with_timeout(context, 1.0))
    assert time.monotonic() - start < 3
    # nothing keeps computing: no worker process, no extra thread, no CPU spent while we sleep
    assert settle(lambda: not compile_children()), compile_children()
    assert settle(lambda: threading.active_count() <= threads), threading.enumerate()
    cpu = time.process_time()
    time.sleep(1.5)
    assert time.process_time() - cpu < 0.15


def test_lmfe_schema_patterns_are_built_at_compile_time(tokenizer: Tokenizer, context: GuideContext) -> None:
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
              "required": ["code"]}
    spec = GuideSpec("json", json.dumps(schema))
    state = guided_decoder(spec, "lm-format-enforcer", context).new_state()
    assert replay(state, tokenizer.encode('{"code": "AB123"}', add_special_tokens=False), context) is None
    runaway = {"type": "object", "properties": {"x": {"type": "string", "pattern": RUNAWAY_REGEX}}}
    with pytest.raises(InvalidRequest, match="exceeded"):
        guided_decoder(GuideSpec("json", json.dumps(runaway)), "lm-format-enforcer", with_timeout(context, 1.0))


def test_a_timed_out_compile_does_not_hold_up_exit(engine_dir: Path) -> None:
    """A process whose guide compile timed out exits at once (it used to wait for the compile)."""
    script = f"""
import time
from trtserver.errors import InvalidRequest
from trtserver.guided import GuideContext, GuideSpec
from trtserver.tokenizer import Tokenizer
from trtserver_guided.plugin import guided_decoder
tok = Tokenizer.from_dir({str(engine_dir)!r})
ctx = GuideContext(tokenizer=tok, vocab_size=tok.vocab_size, eos_token_ids=tok.eos_token_ids, compile_timeout_s=1.0)
try:
    guided_decoder(GuideSpec("regex", {RUNAWAY_REGEX!r}), "lm-format-enforcer", ctx)
except InvalidRequest as exc:
    print("refused:", exc, flush=True)
print("exiting", time.monotonic(), flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not exit: {out.decode()}")
    assert proc.returncode == 0, err.decode()[-2000:]
    lines = out.decode().splitlines()
    assert lines[0].startswith("refused: guide compilation exceeded 1 s")
    exited = time.monotonic()
    assert exited - float(lines[1].split()[1]) < 20  # interpreter teardown only, on a loaded machine


@pytest.mark.parametrize("spec", [
    GuideSpec("regex", "[^x]{1,100000}"),
    GuideSpec("regex", "(.{1,1000}){1,1000}"),
    GuideSpec("grammar", 'root ::= a{100}\na ::= b{100}\nb ::= [^x]{100}'),
    GuideSpec("json", json.dumps({"type": "string", "pattern": "[a-z]{1,1000000}"})),
    GuideSpec("choice", tuple("x" * 1000 + str(i) for i in range(1000))),
])
def test_xgrammar_refuses_what_it_cannot_compile_quickly(spec: GuideSpec, context: GuideContext) -> None:
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="'xgrammar'"):
        guided_decoder(spec, "xgrammar", context)
    assert time.monotonic() - start < 1


def test_xgrammar_keeps_ordinary_repetitions(tokenizer: Tokenizer, context: GuideContext) -> None:
    state = guided_decoder(GuideSpec("regex", r"[a-z]{1,200}-\d{3,4}"), "xgrammar", context).new_state()
    assert replay(state, tokenizer.encode("hello-1234", add_special_tokens=False), context) is None


@pytest.mark.timeout(60)
def test_a_cheap_compile_does_not_wait_behind_slow_ones(context: GuideContext) -> None:
    """Four slow outlines compiles at once, then a trivial one: it is served within seconds, and a
    cached guide at once."""
    cached = GuideSpec("choice", ("cached", "guide"))
    guided_decoder(cached, "outlines", context)
    slow_ctx = with_timeout(context, 8.0)
    errors: list[BaseException] = []

    def slow(n: int) -> None:
        try:
            guided_decoder(GuideSpec("regex", f"(a|b)*a(a|b){{{12 + n}}}"), "outlines", slow_ctx)
        except APIError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=slow, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    guided_decoder(cached, "outlines", context)
    assert time.monotonic() - start < 0.1
    guided_decoder(GuideSpec("choice", ("yes", "no", "maybe")), "outlines", slow_ctx)
    assert time.monotonic() - start < 6
    for thread in threads:
        thread.join()
    assert len(errors) == 4  # each slow one was ended at its deadline
    assert settle(lambda: not compile_children()), compile_children()


def test_llguidance_large_choice_is_followed(tokenizer: Tokenizer, context: GuideContext) -> None:
    items = tuple(f"item{i}" for i in range(10_000))
    decoder = guided_decoder(GuideSpec("choice", items), "llguidance", context)
    state = decoder.new_state()
    assert replay(state, tokenizer.encode("item9999", add_special_tokens=False), context) is None
    eos = context.eos_token_ids[0]
    assert eos in allowed(state, context)
    state = decoder.new_state()
    assert replay(state, tokenizer.encode("item99999", add_special_tokens=False), context) is not None


@pytest.mark.parametrize("spec", [GuideSpec("regex", "a{1000000}"), GuideSpec("grammar", 'root ::= "a"{1000000}')])
def test_llguidance_refuses_what_its_limits_cannot_follow(spec: GuideSpec, context: GuideContext) -> None:
    with pytest.raises(InvalidRequest, match="llguidance cannot follow"):
        guided_decoder(spec, "llguidance", context)


def test_llguidance_error_state_allows_nothing(tokenizer: Tokenizer, context: GuideContext) -> None:
    """A matcher that runs into a limit after the first steps: from then on an all-zero mask and no
    token accepted, and the guide does not claim to be complete."""
    # a grammar rule of 3,000 alternatives: more than an Earley row may hold, once it is reached
    grammar = 'start: ("zq" | "qz") (" xj" | " jx") (" zq" | " qz") word\nword: ' + " | ".join(f'" w{i}"' for i in range(3000))
    state = guided_decoder(GuideSpec("grammar", grammar), "llguidance", context).new_state()
    for step in range(40):
        ids = allowed(state, context)
        if len(ids) == 0:
            break
        token = int(ids[0])
        if not state.accept_token(token):
            break
    assert state.error, "the limit was not reached"  # type: ignore[attr-defined]
    assert len(allowed(state, context)) == 0
    assert not state.is_terminated()
    assert not state.accept_token(tokenizer.encode("a", add_special_tokens=False)[0])


@pytest.mark.parametrize("backend", ("lm-format-enforcer",))
def test_a_dead_end_is_not_the_end(backend: str, context: GuideContext) -> None:
    """LMFE cannot spell characters made of byte pieces: nothing is allowed, and that is not completion."""
    state = guided_decoder(GuideSpec("regex", "龘"), backend, context).new_state()
    assert len(allowed(state, context)) == 0
    assert not state.is_terminated()


def test_shutdown_ends_pending_compiles_at_once(context: GuideContext) -> None:
    from trtserver_guided import plugin

    guided_decoder(GuideSpec("regex", "warm[0-9]"), "lm-format-enforcer", context)
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            guided_decoder(GuideSpec("regex", RUNAWAY_REGEX + "x"), "lm-format-enforcer", with_timeout(context, 30))
        except APIError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert settle(lambda: bool(compile_children()), 10), "the compile did not start"
    start = time.monotonic()
    plugin.stop_compiles()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - start < 2
    assert outcome and outcome[0].status == 503
    assert settle(lambda: not compile_children()), compile_children()


def test_a_compile_asked_for_before_shutdown_starts_no_worker_after_it() -> None:
    """A compile whose thread reaches its worker only after ``kill_all`` (it waited for a lane, or was not yet
    scheduled) gets the shutdown's 503 and starts no process: nothing runs on to its deadline."""
    from trtserver.errors import Overloaded

    from trtserver_guided import worker

    asked = worker.kills()
    worker.kill_all()
    lanes = worker.Lanes("test", fast=1, slow=1, slow_after_s=1.0)
    before = compile_children()
    with pytest.raises(Overloaded):
        worker.within(asked, lambda: worker.run_in_worker("interegular", {"patterns": ["a+"]}, 30, lanes, 512))
    assert compile_children() == before == []
    # asked for after it, a compile starts its worker as ever
    fsms = worker.within(worker.kills(), lambda: worker.run_in_worker("interegular", {"patterns": ["a+"]}, 30,
                                                                      lanes, 512))
    assert fsms

"""Keep the hook surface honest: every hook documented (docstring and docs/plugins.md, generated),
every hook tested, and the operator controls (listing, allow-list, broken plugin) working."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtserver import hookspecs
from trtserver.plugins import CORE_PLUGINS, new_plugin_manager

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "plugins.md"
HOOK_TESTS = REPO / "tests" / "unit" / "test_hooks.py"

PM = new_plugin_manager()
HOOKS = sorted(name for name in dir(PM.hook) if name.startswith("trtserver_"))


def gen_hooks_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("trtserver_docs_gen_hooks", REPO / "docs" / "gen_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hook_names_match_hookspecs() -> None:
    assert HOOKS == sorted(hookspecs.HOOK_NAMES) and len(HOOKS) >= 9


@pytest.mark.parametrize("name", HOOKS)
def test_hook_has_docstring_with_returns(name: str) -> None:
    doc = getattr(PM.hook, name).spec.function.__doc__ or ""
    assert ":returns:" in doc, f"{name}'s docstring has no :returns:"
    for arg in getattr(PM.hook, name).spec.argnames:
        assert f":param {arg}:" in doc, f"{name}'s docstring does not describe {arg}"


@pytest.mark.parametrize("name", HOOKS)
def test_hook_is_documented_with_exact_signature(name: str) -> None:
    signature = f"{name}({', '.join(getattr(PM.hook, name).spec.argnames)})"
    assert signature in DOC.read_text(), f"docs/plugins.md lacks {signature}"


def test_docs_hook_section_is_generated() -> None:
    gen = gen_hooks_module()
    text = DOC.read_text()
    assert gen.render(text) == text, "docs/plugins.md is stale: run python docs/gen_hooks.py"
    for name in ("TokenConstraint", "GuidedDecoder", "LogitsProcessor", "StopChecker"):
        assert f"`{name}" in text or f".{name}`" in text


@pytest.mark.parametrize("name", HOOKS)
def test_every_hook_has_a_test(name: str) -> None:
    tree = ast.parse(HOOK_TESTS.read_text())
    tests = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert f"test_hook_{name}" in tests, f"tests/unit/test_hooks.py has no test_hook_{name}"


# --- operator controls: `trtserver plugins`, the allow-list, a broken plugin -------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "TRTSERVER_LOAD_PLUGINS"}
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "trtserver.cli", "plugins", *args], capture_output=True,
                          text=True, env=environment, timeout=120, cwd=REPO)


def test_plugins_cli_lists_name_version_hooks() -> None:
    result = run_cli("--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["trtserver.builtins.engines"]["hooks"] == ["trtserver_register_engines"]
    assert plugins["trtserver.builtins.engines"]["source"] == "core"
    core = {n for n, p in plugins.items() if p["source"] == "core"}
    assert plugins["fingerprint"]["version"] == "0.1.0"
    assert plugins["fingerprint"]["hooks"] == ["trtserver_system_fingerprint"]
    assert plugins["stops"]["hooks"] == ["trtserver_stop_checkers"]
    assert plugins["prompt_log"]["hooks"] == ["trtserver_app_created", "trtserver_request_received"]
    assert plugins["banned_words"]["hooks"] == ["trtserver_app_created", "trtserver_logits_processors",
                                                "trtserver_request_received"]
    assert all(p["source"] == "entry point" for n, p in plugins.items() if n not in core)


def test_plugins_cli_lists_what_each_plugin_registers() -> None:
    result = run_cli("--json")
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    assert plugins["trtserver.builtins.engines"]["registers"] == {"engines": ["torch", "trtllm"]}
    assert plugins["trtserver.builtins.hermes_tool_parser"]["registers"] == {"tool_parsers": ["hermes"]}
    guided = plugins["guided"]["registers"]["guided_backends"]
    assert {"xgrammar", "llguidance", "outlines", "lm-format-enforcer", "auto"} <= set(guided)
    assert plugins["fingerprint"]["registers"] == {}
    text = run_cli()
    assert text.returncode == 0, text.stderr
    assert "    engines: torch, trtllm" in text.stdout.splitlines()
    assert any(line.startswith("    guided backends: ") and "xgrammar" in line for line in text.stdout.splitlines())


def test_plugins_cli_stops_on_two_plugins_registering_one_name(tmp_path: Path) -> None:
    clash = tmp_path / "clash_plugin.py"
    clash.write_text("from trtserver import hookimpl\n\n@hookimpl\ndef trtserver_register_guided_backends(register):\n"
                     "    register('XGrammar', lambda spec, context: None)\n")
    result = run_cli("--plugin", str(clash))
    assert result.returncode == 3
    assert "guided decoding backend 'xgrammar' is registered by both" in result.stderr
    assert "'clash_plugin'" in result.stderr and "'guided'" in result.stderr


def test_broken_plugin_stops_with_exit_3_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('this plugin is broken')\n")
    result = run_cli("--plugin", str(broken))
    assert result.returncode == 3
    assert "broken_plugin" in result.stderr and "this plugin is broken" in result.stderr


def test_allowlist_env_excludes_plugins(tmp_path: Path) -> None:
    core = set(CORE_PLUGINS)  # trtserver's own modules always load
    extra = tmp_path / "extra_plugin.py"
    extra.write_text("from trtserver import hookimpl\n\n@hookimpl\ndef trtserver_stop_checkers():\n    return None\n")
    result = run_cli("--json", "--plugin", str(extra), env={"TRTSERVER_LOAD_PLUGINS": "fingerprint"})
    assert result.returncode == 0, result.stderr
    assert {p["name"] for p in json.loads(result.stdout)} == core | {"fingerprint"}
    result = run_cli("--json", env={"TRTSERVER_LOAD_PLUGINS": ""})
    assert {p["name"] for p in json.loads(result.stdout)} == core
    result = run_cli("--json", "--plugin", str(extra), env={"TRTSERVER_LOAD_PLUGINS": "extra_plugin"})
    assert {p["name"] for p in json.loads(result.stdout)} == core | {"extra_plugin"}


def test_trace_plugins_logs_each_hook_call_with_its_duration() -> None:
    import structlog.testing

    from trtserver.plugins import load_plugins, new_plugin_manager, trace_hook_calls

    pm = new_plugin_manager()
    load_plugins(pm, allowlist=[])
    trace_hook_calls(pm)
    with structlog.testing.capture_logs() as logs:
        pm.hook.trtserver_register_engines(register=lambda name, factory: None)
    calls = [entry for entry in logs if entry["event"] == "hook_called"]
    assert [c["hook"] for c in calls] == ["trtserver_register_engines"]
    assert "trtserver.builtins.engines" in calls[0]["plugins"]
    assert calls[0]["ms"] >= 0 and calls[0]["raised"] is None

"""Loading plugins: built-ins, then entry points in group ``trtserver``, then ``--plugin`` names.

``TRTSERVER_LOAD_PLUGINS`` (or ``plugin_allowlist``) restricts what loads: a comma-separated list
of plugin names; an empty string loads none but trtserver's own core. A plugin that fails to
import or register stops start-up with an error naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle
import pluggy
import structlog

from trtserver import hookspecs

ENTRY_POINT_GROUP = "trtserver"
ALLOWLIST_ENV = "TRTSERVER_LOAD_PLUGINS"

# modules inside trtserver itself that implement hooks (the engines every server has, default plugins)
CORE_PLUGINS: tuple[str, ...] = ("trtserver.builtins.engines", "trtserver.quota",
                                 "trtserver.builtins.hermes_tool_parser", "trtserver.builtins.bad_words")


class PluginLoadError(RuntimeError):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"plugin {name!r} failed to load: {reason}")
        self.plugin_name = name


@dataclass(frozen=True, slots=True)
class PluginInfo:
    name: str
    version: str | None
    hooks: tuple[str, ...]
    source: str  # core | entry point | --plugin


TRACE_ENV = "TRTSERVER_TRACE_PLUGINS"


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if os.environ.get(TRACE_ENV) == "1":
        trace_hook_calls(pm)
    return pm


def trace_hook_calls(pm: pluggy.PluginManager) -> None:
    """Log every hook call: which plugins answered, how long it took, whether it raised."""
    log = structlog.get_logger("trtserver.plugins")
    started = threading.local()  # hooks also run in worker threads (guided compiles)

    def before(hook_name: str, impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
        stack = getattr(started, "stack", None) or []
        stack.append(time.perf_counter())
        started.stack = stack

    def after(outcome: pluggy.Result[Any], hook_name: str, impls: Sequence[pluggy.HookImpl],
              kwargs: Mapping[str, Any]) -> None:
        elapsed = time.perf_counter() - started.stack.pop()
        log.info("hook_called", hook=hook_name, plugins=[impl.plugin_name for impl in impls],
                 ms=round(elapsed * 1000, 3), raised=type(outcome.exception).__name__ if outcome.exception else None)

    pm.add_hookcall_monitoring(before, after)


def allowlist_from_env() -> list[str] | None:
    value = os.environ.get(ALLOWLIST_ENV)
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _import_path_or_module(spec: str) -> ModuleType:
    path = Path(spec)
    if spec.endswith(".py") or path.exists():
        module_name = f"trtserver_plugin_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError(f"cannot load {spec}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
        # its classes and functions cannot be imported by name in the engine process: what its hooks
        # return for a request (logits processors, guides) crosses there by value
        cloudpickle.register_pickle_by_value(module)
        return module
    return importlib.import_module(spec)


def _register(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    try:
        pm.register(plugin, name=name)
    except Exception as exc:  # pluggy validation errors, duplicate names
        raise PluginLoadError(name, str(exc)) from exc


def load_plugins(pm: pluggy.PluginManager, *, extra: Iterable[str] = (),
                 allowlist: Iterable[str] | None = None) -> None:
    """Register core modules, installed entry points and ``extra`` module names or file paths."""
    allowed = set(allowlist) if allowlist is not None else None
    for module_name in CORE_PLUGINS:
        _register(pm, importlib.import_module(module_name), module_name)
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and entry_point.name not in allowed:
            continue
        if pm.has_plugin(entry_point.name):
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise PluginLoadError(entry_point.name, f"{type(exc).__name__}: {exc}") from exc
        _register(pm, plugin, entry_point.name)
    for spec in extra:
        name = Path(spec).stem if spec.endswith(".py") else spec
        if allowed is not None and name not in allowed:
            continue
        try:
            module = _import_path_or_module(spec)
        except Exception as exc:
            raise PluginLoadError(name, f"{type(exc).__name__}: {exc}") from exc
        _register(pm, module, name)
    pm.check_pending()


def list_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    versions: dict[str, str] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.dist is not None:
            versions[entry_point.name] = entry_point.dist.version
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        source = "core" if name in CORE_PLUGINS else ("entry point" if name in versions else "--plugin")
        version = versions.get(name) or getattr(plugin, "__version__", None)
        infos.append(PluginInfo(name, version, hooks, source))
    return sorted(infos, key=lambda info: (info.source != "core", info.name))


async def await_me_maybe(value: object) -> object:
    if inspect.isawaitable(value):
        return await value
    return value

"""Loading plugins: built-ins, then entry points in group ``trtserver``, then ``--plugin`` names.

``TRTSERVER_LOAD_PLUGINS`` (or ``plugin_allowlist``) restricts what loads: a comma-separated list
of plugin names; an empty string loads none but trtserver's own core. A plugin that fails to
import or register, or that registers a name (``REGISTRIES``: engines, tool-call parsers, guided
backends) another plugin registers too, stops start-up with an error naming it.

Each plugin's settings are its own ``[plugins.<name>]`` table of the TOML file:
``config.plugin_config(name)`` as a dict, or ``plugin_settings(config, name, Struct)`` validated.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle
import msgspec
import pluggy
import structlog

from trtserver import hookspecs

if TYPE_CHECKING:
    from trtserver.config import ServerConfig

SettingsT = TypeVar("SettingsT")

ENTRY_POINT_GROUP = "trtserver"
ALLOWLIST_ENV = "TRTSERVER_LOAD_PLUGINS"

# modules inside trtserver itself that implement hooks (the engines every server has, default plugins)
CORE_PLUGINS: tuple[str, ...] = ("trtserver.builtins.engines", "trtserver.builtins.quota_store",
                                 "trtserver.builtins.hermes_tool_parser", "trtserver.builtins.bad_words")


def guided_backend_key(name: str) -> str:
    """Guided-decoding backend names match whatever their case and surrounding spaces."""
    return name.strip().lower()


@dataclass(frozen=True, slots=True)
class Registry:
    """A start-up hook through which plugins register things by name."""

    hook: str
    what: str  # what one registered thing is called, in errors
    normalize: Callable[[str], str] | None = None


REGISTRIES: dict[str, Registry] = {
    "engines": Registry("trtserver_register_engines", "engine"),
    "tool_parsers": Registry("trtserver_register_tool_parsers", "tool-call parser"),
    "guided_backends": Registry("trtserver_register_guided_backends", "guided decoding backend", guided_backend_key),
}


class PluginLoadError(RuntimeError):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"plugin {name!r} failed to load: {reason}")
        self.plugin_name = name


class PluginConfigError(PluginLoadError):
    """A plugin's ``[plugins.<name>]`` table does not validate; start-up stops with this message."""

    def __init__(self, name: str, reason: str) -> None:
        RuntimeError.__init__(self, f"plugin {name!r}: invalid settings in [plugins.{name}]: {reason}")
        self.plugin_name = name


def plugin_settings(config: ServerConfig, name: str, kind: type[SettingsT]) -> SettingsT:
    """A plugin's ``[plugins.<name>]`` table validated into ``kind`` (a msgspec Struct), or
    ``PluginConfigError`` naming the plugin and the setting. Call it from a start-up hook."""
    try:
        return msgspec.convert(config.plugin_config(name), kind, strict=False)
    except msgspec.ValidationError as exc:
        raise PluginConfigError(name, str(exc)) from None


@dataclass(frozen=True, slots=True)
class PluginInfo:
    name: str
    version: str | None
    hooks: tuple[str, ...]
    source: str  # core | entry point | --plugin
    registers: dict[str, tuple[str, ...]] = field(default_factory=dict)  # by registry (REGISTRIES), the names


@dataclass(frozen=True, slots=True)
class Registration:
    """One name a plugin registered through a ``trtserver_register_*`` hook."""

    factory: Any
    plugin: str


def registrations(pm: pluggy.PluginManager, registry: str) -> dict[str, Registration]:
    """What plugins register through one of the ``REGISTRIES`` (``register(name, factory)``), by
    name. A name registered twice, by one plugin or two, or a name that is not a non-empty string,
    raises ``PluginLoadError`` naming the plugins."""
    spec = REGISTRIES[registry]
    found: dict[str, Registration] = {}
    hook = getattr(pm.hook, spec.hook)
    impls = hook.get_hookimpls()
    # one plugin at a time, so that a clash can name who registered the name first
    for impl in reversed(impls):
        plugin_name = impl.plugin_name

        def register(name: str, factory: Any, plugin_name: str = plugin_name) -> None:
            if not isinstance(name, str) or not name.strip():
                raise PluginLoadError(plugin_name, f"{spec.what} name must be a non-empty string, not {name!r}")
            key = spec.normalize(name) if spec.normalize is not None else name
            if key in found:
                raise PluginLoadError(plugin_name, f"{spec.what} {key!r} is registered by both "
                                                   f"{found[key].plugin!r} and {plugin_name!r}")
            found[key] = Registration(factory, plugin_name)

        others = [other.plugin for other in impls if other is not impl]
        pm.subset_hook_caller(spec.hook, remove_plugins=others)(register=register)
    return found


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
        if pm.is_registered(module):  # named again here, already loaded as an entry point
            continue
        _register(pm, module, name)
    pm.check_pending()
    for registry in REGISTRIES:  # a name two plugins claim stops start-up here, before the engine loads
        registrations(pm, registry)


def list_plugins(pm: pluggy.PluginManager) -> list[PluginInfo]:
    versions: dict[str, str] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.dist is not None:
            versions[entry_point.name] = entry_point.dist.version
    registered: dict[str, dict[str, list[str]]] = {}
    for registry in REGISTRIES:
        for key, registration in registrations(pm, registry).items():
            registered.setdefault(registration.plugin, {}).setdefault(registry, []).append(key)
    infos = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = tuple(sorted(caller.name for caller in pm.get_hookcallers(plugin) or []))
        source = "core" if name in CORE_PLUGINS else ("entry point" if name in versions else "--plugin")
        version = versions.get(name) or getattr(plugin, "__version__", None)
        registers = {registry: tuple(sorted(names)) for registry, names in registered.get(name, {}).items()}
        infos.append(PluginInfo(name, version, hooks, source, registers))
    return sorted(infos, key=lambda info: (info.source != "core", info.name))


async def await_me_maybe(value: object) -> object:
    if inspect.isawaitable(value):
        return await value
    return value

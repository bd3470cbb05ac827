"""``trtserver serve | build | plugins | bundle``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from trtserver import __version__
from trtserver.config import ServerConfig, build_config, load_config_file


def _list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


@dataclass(frozen=True)
class Setting:
    """One ServerConfig field as the CLI and docs/settings.md show it."""

    name: str
    kind: Any  # the field's type without its Annotated metadata
    default: Any  # msgspec.NODEFAULT when required
    description: str

    @property
    def flag(self) -> str | None:
        """The ``serve`` flag, or None for tables that only the TOML file can hold."""
        if self.name == "engine_dir":
            return "ENGINE_DIR"
        if self.name == "plugins":
            return PLUGIN_FLAG
        return None if "dict" in str(self.kind) else "--" + self.name.replace("_", "-")


# the one flag for the ``plugins`` setting: repeatable, one module or file each, added to the file's list
PLUGIN_FLAG = "--plugin"


def _strip(kind: Any) -> tuple[Any, str]:
    """(the type without Annotated, the description of its outermost Meta that has one)."""
    description = ""
    while typing.get_origin(kind) is typing.Annotated:
        for meta in typing.get_args(kind)[1:]:
            if isinstance(meta, msgspec.Meta) and meta.description and not description:
                description = meta.description
        kind = typing.get_args(kind)[0]
    return kind, description


def settings() -> list[Setting]:
    """Every ServerConfig field with its description, in declaration order."""
    out = []
    for field in msgspec.structs.fields(ServerConfig):
        kind, description = _strip(field.type)
        default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
        out.append(Setting(field.name, kind, default, description))
    return out


def _help(setting: Setting) -> str:
    shown = setting.default
    if isinstance(shown, bool):
        shown = "on" if shown else "off"
    elif shown in (None, [], msgspec.NODEFAULT):
        return setting.description.replace("%", "%%")
    return f"{setting.description} (default: {shown})".replace("%", "%%")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field, from the struct itself, so the two never drift."""
    parser.add_argument("--config", help="TOML file with a [server] table; flags override it")
    for setting in settings():
        flag, kind, help_text = setting.flag, setting.kind, _help(setting)
        text = str(kind)
        if flag is None:
            continue  # tables (quotas) come from the TOML file only
        if flag == "ENGINE_DIR":
            parser.add_argument("engine_dir", help=help_text)
        elif flag == PLUGIN_FLAG:
            parser.add_argument(flag, action="append", dest=setting.name, default=None, metavar="MODULE_OR_PATH",
                                help=help_text + "; each --plugin adds one to the config file's list (repeatable)")
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(kind) is typing.Literal:  # before the "int" test: Literal["int8", ...]
            parser.add_argument(flag, choices=typing.get_args(kind), default=None, help=help_text)
        elif "list[str]" in text:
            parser.add_argument(flag, type=_list, default=None, help=help_text + " (comma-separated)")
        elif "int" in text and "float" not in text:
            parser.add_argument(flag, type=int, default=None, help=help_text)
        elif "float" in text:
            parser.add_argument(flag, type=float, default=None, help=help_text)
        else:
            parser.add_argument(flag, default=None, help=help_text)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values: dict[str, object] = load_config_file(args.config) if args.config else {}
    for field in msgspec.structs.fields(ServerConfig):
        value = getattr(args, field.name, None)
        if value is None:
            continue
        if field.name == "plugins":  # --plugin adds to the file's list
            from_file = values.get("plugins")
            value = [*(from_file if isinstance(from_file, list) else []), *value]
        values[field.name] = value
    return build_config(values)


def serve(args: argparse.Namespace) -> int:

    from trtserver.allocator import return_large_blocks
    from trtserver.http.app import create_app
    from trtserver.logs import configure_logging
    from trtserver.plugins import PluginLoadError

    try:
        config = config_from_args(args)
    except (msgspec.ValidationError, ValueError, OSError) as exc:
        print(f"trtserver: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    if config.engine_process:  # not where the model's own tensors come and go each step in this process
        return_large_blocks()
    try:
        app = create_app(config)
    except PluginLoadError as exc:
        print(f"trtserver: {exc}", file=sys.stderr)
        return 3
    from trtserver.http.run import run_server

    if config.event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if config.event_loop == "uvloop":
                print("trtserver: --event-loop uvloop, but uvloop is not installed", file=sys.stderr)
                return 2
        else:
            return int(uvloop.run(run_server(app, config)))
    return asyncio.run(run_server(app, config))


def plugins_command(args: argparse.Namespace) -> int:
    from trtserver.plugins import (
        PluginLoadError,
        allowlist_from_env,
        list_plugins,
        load_plugins,
        new_plugin_manager,
    )

    pm = new_plugin_manager()
    try:
        load_plugins(pm, extra=args.plugin or [], allowlist=allowlist_from_env())
        infos = list_plugins(pm)  # a name two plugins register stops here, as it stops serve
    except PluginLoadError as exc:
        print(f"trtserver: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(msgspec.json.encode(infos).decode())
        return 0
    width = max([32, *(len(info.name) + 1 for info in infos)])
    for info in infos:
        print(f"{info.name:{width}} {info.version or '-':10} {info.source:12} {', '.join(info.hooks)}")
        for registry, names in info.registers.items():
            print(f"    {registry.replace('_', ' ')}: {', '.join(names)}")
    return 0


def build(args: argparse.Namespace) -> int:
    from build_engines.cli import BUILD_ERRORS, run_build

    try:
        path = run_build(args)
    except BUILD_ERRORS as exc:
        print(f"trtserver build: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trtserver", description=__doc__)
    parser.add_argument("--version", action="version", version=f"trtserver {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="serve an engine directory over HTTP")
    _add_serve_arguments(serve_parser)
    serve_parser.set_defaults(func=serve)

    build_parser = commands.add_parser("build", help="make an engine directory from a model")
    from build_engines.cli import add_build_arguments

    add_build_arguments(build_parser)
    build_parser.set_defaults(func=build)

    plugins_parser = commands.add_parser("plugins", help="list loaded plugins, their hooks and what they register "
                                                         "(engines, tool-call parsers, guided-decoding backends)")
    plugins_parser.add_argument("--plugin", action="append", help="also load this module or file")
    plugins_parser.add_argument("--json", action="store_true")
    plugins_parser.set_defaults(func=plugins_command)

    bundle_parser = commands.add_parser("bundle", help="write an offline install bundle for an air-gapped host")
    from trtserver.bundle import add_bundle_arguments, bundle_command

    add_bundle_arguments(bundle_parser)
    bundle_parser.set_defaults(func=bundle_command)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

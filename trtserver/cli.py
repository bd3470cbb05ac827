"""``trtserver serve | build | plugins``."""

from __future__ import annotations

import argparse
import asyncio
import sys
import typing
from collections.abc import Sequence

import msgspec

from trtserver import __version__
from trtserver.config import ServerConfig, build_config, load_config_file


def _list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field, from the struct itself, so the two never drift."""
    parser.add_argument("engine_dir", help="engine directory (made by `trtserver build`)")
    parser.add_argument("--config", help="TOML file with a [server] table; flags override it")
    parser.add_argument("--plugin", action="append", dest="plugin_specs", default=None, metavar="MODULE_OR_PATH",
                        help="load this plugin module or .py file too (repeatable)")
    for field in msgspec.structs.fields(ServerConfig):
        if field.name == "engine_dir":
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = field.type
        text = str(kind)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(kind) is typing.Literal:  # before the "int" test: Literal["int8", ...]
            parser.add_argument(flag, choices=typing.get_args(kind), default=None)
        elif "list[str]" in text:
            parser.add_argument(flag, type=_list, default=None, help="comma-separated")
        elif "dict" in text:
            continue  # tables (quotas) come from the TOML file only
        elif "int" in text and "float" not in text:
            parser.add_argument(flag, type=int, default=None)
        elif "float" in text:
            parser.add_argument(flag, type=float, default=None)
        else:
            parser.add_argument(flag, default=None)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values: dict[str, object] = load_config_file(args.config) if args.config else {}
    for field in msgspec.structs.fields(ServerConfig):
        value = getattr(args, field.name, None)
        if value is not None:
            values[field.name] = value
    if getattr(args, "plugin_specs", None):
        from_file = values.get("plugins")
        values["plugins"] = [*(from_file if isinstance(from_file, list) else []), *args.plugin_specs]
    return build_config(values)


def serve(args: argparse.Namespace) -> int:

    from trtserver.logs import configure_logging
    from trtserver.plugins import PluginLoadError
    from trtserver.server import create_app

    try:
        config = config_from_args(args)
    except (msgspec.ValidationError, ValueError, OSError) as exc:
        print(f"trtserver: invalid configuration: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_format, config.log_level)
    try:
        app = create_app(config)
    except PluginLoadError as exc:
        print(f"trtserver: {exc}", file=sys.stderr)
        return 3
    from trtserver.lifecycle import run_server

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
    except PluginLoadError as exc:
        print(f"trtserver: {exc}", file=sys.stderr)
        return 3
    infos = list_plugins(pm)
    if args.json:
        print(msgspec.json.encode(infos).decode())
        return 0
    for info in infos:
        print(f"{info.name:32} {info.version or '-':10} {info.source:12} {', '.join(info.hooks)}")
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

    plugins_parser = commands.add_parser("plugins", help="list loaded plugins and their hooks")
    plugins_parser.add_argument("--plugin", action="append", help="also load this module or file")
    plugins_parser.add_argument("--json", action="store_true")
    plugins_parser.set_defaults(func=plugins_command)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

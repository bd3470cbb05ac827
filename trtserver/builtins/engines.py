"""The engines every trtserver has, registered through the same hook a plugin would use."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trtserver.hookspecs import hookimpl

if TYPE_CHECKING:
    from trtserver.config import ServerConfig
    from trtserver.engine.base import Engine


def _torch_engine(config: ServerConfig) -> Engine:
    from trtserver.engine.torch.engine import TorchEngine

    return TorchEngine(config)


def _trtllm_engine(config: ServerConfig) -> Engine:
    from trtserver.engine.trtllm import TrtllmEngine

    return TrtllmEngine(config)


@hookimpl
def trtserver_register_engines(register: Callable[[str, Callable[[ServerConfig], Engine]], None]) -> None:
    register("torch", _torch_engine)
    register("trtllm", _trtllm_engine)

"""The wire between the server and its engine process (``process.py`` and ``worker.py``).

Frames are ``multiprocessing.connection``'s: a 4-byte big-endian length, then one message, a
msgspec Struct in msgpack with its tag: the server sends ``Start`` then ``Add`` / ``Abort`` /
``Stop``; the engine answers ``Ready`` or ``Failed``, then one ``Step`` per step (deltas, errors,
stats), encoded and decoded in C. A request crosses once inside ``Add``, pickled with cloudpickle,
because plugins' per-step objects (guided decoders, logits-processor factories) ride on it. The
served model's tokenizer, which such objects often hold, is never copied: it crosses as a
reference to the engine process's own tokenizer.
"""

from __future__ import annotations

import io
import pickle
import struct

import cloudpickle
import msgspec

from trtserver import errors
from trtserver.config import ServerConfig
from trtserver.engine.base import EngineStats, GenerationRequest, SequenceOutput

HEADER = struct.Struct("!i")
_TOKENIZER = "tokenizer"


# ---- server -> engine ------------------------------------------------------------------------------
class Start(msgspec.Struct, tag="start", array_like=True):
    config: ServerConfig
    seed: int | None
    quantize: str


class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str  # beside the pickle, so a request that fails to unpickle there still fails here
    blob: bytes
    plain: bool  # no plugin object rides on it: it unpickles at once (others may compile a guide)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    index: int | None = None


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


Command = Start | Add | Abort | Stop


# ---- engine -> server ------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    """What the engine process settled where the model loaded."""

    dtype: str
    quantization: str | None
    device: str


class Failed(msgspec.Struct, tag="failed", array_like=True):
    reason: str


class ErrorRecord(msgspec.Struct, array_like=True):
    """A request's error: it crosses by class name, not by pickle."""

    request_id: str
    name: str
    message: str
    param: str | None


class Step(msgspec.Struct, tag="step", array_like=True):
    outputs: list[SequenceOutput]
    errors: list[ErrorRecord]
    stats: EngineStats


Startup = Ready | Failed

_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
startup_decoder = msgspec.msgpack.Decoder(Startup)
_step_decoder = msgspec.msgpack.Decoder(Step)


def encode(message: Command | Startup | Step) -> bytes:
    return _encoder.encode(message)


def frame(message: Command | Startup | Step) -> bytes:
    """``message`` with its length header, as ``Connection.send_bytes`` writes it."""
    payload = _encoder.encode(message)
    return HEADER.pack(len(payload)) + payload


def encode_step(outputs: list[SequenceOutput], failed: list[tuple[str, BaseException]],
                stats: EngineStats) -> bytes:
    records = [ErrorRecord(rid, type(exc).__name__, getattr(exc, "message", None) or str(exc),
                           getattr(exc, "param", None)) for rid, exc in failed]
    return _encoder.encode(Step(outputs, records, stats))


def decode_step(payload: memoryview | bytes) -> tuple[list[SequenceOutput], list[tuple[str, BaseException]],
                                                        EngineStats]:
    step = _step_decoder.decode(payload)
    return step.outputs, [(r.request_id, rebuild_error(r.name, r.message, r.param)) for r in step.errors], step.stats


def rebuild_error(name: str, message: str, param: str | None) -> BaseException:
    """The client sees the same error as with the engine in process: API errors keep their class
    (a LoRA adapter's 404 stays a 404); anything else is the engine's failure (500)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.APIError):
        return cls(message, param=param)
    return errors.EngineError(f"{name}: {message}")


class _RequestPickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, tokenizer: object) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tokenizer = tokenizer

    def persistent_id(self, obj: object) -> str | None:
        return _TOKENIZER if obj is self._tokenizer else None


class _RequestUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tokenizer: object) -> None:
        super().__init__(file)
        self._tokenizer = tokenizer

    def persistent_load(self, pid: object) -> object:
        if pid != _TOKENIZER:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tokenizer


def encode_request(request: GenerationRequest, tokenizer: object) -> bytes:
    """The ``Add`` frame's message; raises ``EngineError`` when a plugin's object cannot be pickled,
    before anything is queued.

    A request with no guided decoder and no logits processors holds only our own dataclasses: the C
    pickler takes it, without cloudpickle's Python per object. The engine process unpickles both
    the same way."""
    plain = request.guided is None and not request.logits_processors
    if plain:
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        buffer = io.BytesIO()
        try:
            _RequestPickler(buffer, tokenizer).dump(request)
        except Exception as exc:  # noqa: BLE001 - pickling raises many types
            raise errors.EngineError(
                f"a plugin's guided decoder or logits processor cannot be sent to the engine process ({exc!r}); "
                "its objects must be picklable by cloudpickle, or start the server with --no-engine-process"
            ) from exc
        blob = buffer.getvalue()
    return _encoder.encode(Add(request.request_id, blob, plain))


def rebuild_request(blob: bytes, tokenizer: object) -> GenerationRequest:
    """Unpickle a request (its plugin objects rebuilt here, a guide compiled); raises ``EngineError``."""
    try:
        request = _RequestUnpickler(io.BytesIO(blob), tokenizer).load()
    except errors.APIError:  # a guide that cannot compile here: the client's 400
        raise
    except Exception as exc:  # noqa: BLE001 - a plugin's object failed to rebuild here
        raise errors.EngineError(f"the request could not be rebuilt in the engine process: {exc!r}") from exc
    if not isinstance(request, GenerationRequest):
        raise errors.EngineError(f"expected a GenerationRequest, got {type(request).__name__}")
    return request


def decode_request(payload: memoryview | bytes, tokenizer: object) -> tuple[str, GenerationRequest | Exception]:
    """(request id, the request or why it could not be rebuilt) from an ``Add`` message."""
    add = command_decoder.decode(payload)
    assert isinstance(add, Add)
    try:
        return add.request_id, rebuild_request(add.blob, tokenizer)
    except errors.APIError as exc:
        return add.request_id, exc

"""The wire between the server and its engine process (``process.py`` and ``worker.py``).

Frames are ``multiprocessing.connection``'s: a 4-byte big-endian length, then the payload, whose
first byte says what it is. What crosses per step (deltas, stats) is msgpack through msgspec,
encoded and decoded in C; a request crosses once, pickled with cloudpickle, because plugins'
per-step objects (guided decoders, logits-processor factories) ride on it. The served model's
tokenizer, which such objects often hold, is never copied: it crosses as a reference to the
engine process's own tokenizer.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import cloudpickle
import msgspec

from trtserver import errors
from trtserver.engine.base import EngineStats, GenerationRequest, SequenceOutput

# server -> engine
CONFIG, ADD, ABORT, STOP = b"C", b"A", b"X", b"S"
# engine -> server
READY, FAILED, STEP = b"R", b"F", b"O"

HEADER = struct.Struct("!i")
_TOKENIZER = "tokenizer"

# (request id, exception class name, message, param): errors cross by name, not by pickle
ErrorRecord = tuple[str, str, str, str | None]
StepMessage = tuple[list[SequenceOutput], list[ErrorRecord], EngineStats]

_step_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(StepMessage)


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload) + 1) + kind + payload


def encode_step(outputs: list[SequenceOutput], failed: list[tuple[str, BaseException]],
                stats: EngineStats) -> bytes:
    records = [(rid, type(exc).__name__, getattr(exc, "message", None) or str(exc), getattr(exc, "param", None))
               for rid, exc in failed]
    return STEP + _step_encoder.encode((outputs, records, stats))


def decode_step(payload: memoryview | bytes) -> tuple[list[SequenceOutput], list[tuple[str, BaseException]],
                                                        EngineStats]:
    outputs, records, stats = _step_decoder.decode(payload)
    return outputs, [(rid, rebuild_error(name, message, param)) for rid, name, message, param in records], stats


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
    """Raises ``EngineError`` when a plugin's object cannot be pickled, before anything is queued.

    A request with no guided decoder and no logits processors holds only our own dataclasses: the C
    pickler takes it (8 against 23 µs warm, and none of cloudpickle's Python per object on this
    server's cold caches). The engine process unpickles both the same way."""
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
    # the id travels beside the pickle, so a request that fails to unpickle there still fails here;
    # ``plain`` says no plugin object rides on it, so it unpickles at once (others may compile a guide)
    return ADD + msgspec.msgpack.encode((request.request_id, blob, plain))


def split_request(payload: memoryview | bytes) -> tuple[str, bytes, bool]:
    """(request id, the pickled request, whether it holds no plugin objects)."""
    return msgspec.msgpack.decode(payload, type=tuple[str, bytes, bool])


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
    """(request id, the request or why it could not be unpickled)."""
    request_id, blob, _ = split_request(payload)
    try:
        return request_id, rebuild_request(blob, tokenizer)
    except errors.APIError as exc:
        return request_id, exc


def encode_plain(kind: bytes, value: Any) -> bytes:
    return kind + msgspec.msgpack.encode(value)


def decode_plain(payload: memoryview | bytes) -> Any:
    return msgspec.msgpack.decode(payload)

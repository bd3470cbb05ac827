"""Request bodies: the JSON a route takes, read within its deadline, decoded from its encoding,
refused when nested too deeply, then parsed into the route's Struct with unknown fields set apart."""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
import numpy as np
import structlog
from aiohttp import web, web_protocol
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD

from trtserver import errors
from trtserver.protocol import FieldError

log = structlog.get_logger("trtserver.http.body")
RequestT = TypeVar("RequestT", bound=msgspec.Struct)

# what aiohttp decodes (br and zstd only where their packages are installed)
BODY_ENCODINGS = ("identity", "gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, decoded from its Content-Encoding; a body that does not arrive within
    ``timeout_s`` is a 408, one that cannot be decoded or deframed a 400."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError as exc:
        raise errors.RequestReadTimeout(f"the request body did not arrive within {timeout_s} s") from exc
    except web_protocol.RequestPayloadError as exc:
        encoding = request.headers.get("Content-Encoding")
        what = f"is not valid {encoding} data" if encoding else "is malformed"
        raise errors.InvalidRequest(f"The request body {what}", param=None) from exc


# bytes that open and close a JSON object or array, everything else weighs nothing
_NESTING = np.zeros(256, dtype=np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_depth(body: bytes) -> int:
    """How deeply a JSON text nests objects and arrays, without parsing it (so without recursion):
    brackets inside strings do not count."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= 1:
        return opens
    if b'"' in body:
        body = _STRINGS.sub(b"", body)
    levels = np.cumsum(_NESTING[np.frombuffer(body, dtype=np.uint8)], dtype=np.int32)
    return int(levels.max(initial=0))


async def read_json(request: web.Request, *, max_depth: int, timeout_s: float) -> bytes:
    """The body of a JSON request, decoded from its Content-Encoding, no deeper than ``max_depth``."""
    content_type = request.headers.get("Content-Type", "application/json")
    if not (content_type.startswith("application/json") or "+json" in content_type):
        raise errors.UnsupportedMediaType(f"Unsupported Media Type: expected application/json, got {content_type}")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in BODY_ENCODINGS:
        raise errors.UnsupportedMediaType(f"Unsupported Content-Encoding: expected one of {', '.join(BODY_ENCODINGS)}",
                                          code="unsupported_content_encoding")
    body = await _read_body(request, timeout_s)
    depth = json_depth(body)
    if depth > max_depth:
        raise errors.InvalidRequest(f"Request body is nested {depth} levels deep; at most {max_depth} "
                                    "are accepted", param=None, code="json_too_deep")
    return body


def parse(body: bytes, decoder: msgspec.json.Decoder[RequestT], known: frozenset[str]
          ) -> tuple[RequestT, dict[str, object]]:
    """The body as the route's Struct, checked (``check()``) where it has rules between fields; unknown
    fields are returned (and logged by name), ``extra_body`` merged."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError as exc:
        raise errors.InvalidRequest("Request body must be a JSON object", param=None) from exc
    except msgspec.DecodeError as exc:
        raise errors.from_validation_error(exc) from exc
    if "extra_body" in fields:
        try:
            extra = msgspec.json.decode(fields["extra_body"], type=dict[str, msgspec.Raw] | None)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise errors.InvalidRequest("extra_body must be an object", param="extra_body") from exc
        for key, value in (extra or {}).items():
            fields.setdefault(key, value)
        body = msgspec.json.encode(fields)
    unknown = {key: msgspec.json.decode(value) for key, value in fields.items() if key not in known}
    if unknown:
        # names only, and few and short: a client chooses them
        log.info("unknown_fields_ignored", fields=sorted(name[:64] for name in unknown)[:16], count=len(unknown))
    try:
        parsed = decoder.decode(body)
        check = getattr(parsed, "check", None)
        if check is not None:
            check()
    except FieldError as exc:
        raise errors.InvalidRequest(str(exc), param=exc.param) from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.from_validation_error(exc) from exc
    return parsed, unknown

"""Every failure a client can see, as one exception hierarchy mapped once to the OpenAI envelope.

``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; ``http/app.py`` does the
mapping in one middleware (and once more for errors that happen after an SSE stream started).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec


class APIError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})

    def envelope(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class Unsupported(InvalidRequest):
    """A valid request this model or engine cannot serve (feature not available)."""

    code = "unsupported"


class AuthenticationError(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"
    code = "model_not_found"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(APIError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ExpectationFailed(APIError):
    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class Overloaded(APIError):
    status = 503
    type = "server_overloaded"
    code = "overloaded"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message, param=param, code=code, headers=headers)
        self.headers.setdefault("Retry-After", "1")  # a 503 always tells the client when to come back


class RequestTimeout(APIError):
    status = 504
    type = "timeout_error"
    code = "request_timeout"


class RequestReadTimeout(APIError):
    """The client took too long to send its request's headers or body."""

    status = 408
    type = "invalid_request_error"
    code = "request_read_timeout"


class EngineError(APIError):
    status = 500
    type = "internal_error"
    code = "engine_error"


def param_from_validation_error(exc: msgspec.ValidationError) -> str | None:
    """``Expected `float`, got `str` - at `$.temperature``` -> ``temperature``."""
    text = str(exc)
    marker = " - at `$"
    if marker not in text:
        return None
    path = text.rsplit(marker, 1)[1].rstrip("`").lstrip(".")
    # `prompt[0]` -> `prompt`, `logit_bias[...]` -> `logit_bias`: name the field, not the element
    path = re.sub(r"\[[^\]]*\]", "", path)
    return path or None


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> InvalidRequest:
    if isinstance(exc, msgspec.ValidationError):
        param = param_from_validation_error(exc)
        message = str(exc).replace("`$.", "`").replace("`$`", "the request body")
        return InvalidRequest(message, param=param)
    return InvalidRequest(f"Request body is not valid JSON: {exc}", param=None)

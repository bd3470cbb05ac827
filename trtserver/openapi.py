"""``/openapi.json``, generated from the msgspec structs so it cannot drift from what is parsed."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from trtserver import __version__
from trtserver.protocol import CompletionRequest, CompletionResponse, ErrorResponse, ModelList

ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model",
                  "413": "Body too large", "415": "Not JSON", "429": "Over quota",
                  "503": "Loading, draining or overloaded"}


def _error_responses() -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {code: {"description": text, "content": {"application/json": {"schema": ref}}}
            for code, text in ERROR_STATUSES.items()}


@cache
def openapi_document() -> dict[str, Any]:
    (request, response, error, models), components = msgspec.json.schema_components(
        [CompletionRequest, CompletionResponse, ErrorResponse, ModelList],
        ref_template="#/components/schemas/{name}")
    # msgspec can only say "an array of (string | int | [int])"; the server takes one kind per array
    components["CompletionRequest"]["properties"]["prompt"] = {"anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                                    "minItems": 1}, "minItems": 1},
    ]}
    return {
        "openapi": "3.1.0",
        "info": {"title": "trtserver", "version": __version__,
                 "description": "OpenAI-compatible legacy completions API with vLLM, OctoAI and Nebius extensions"},
        "paths": {
            "/v1/completions": {"post": {
                "operationId": "createCompletion",
                "parameters": [{"name": "ai_project_id", "in": "query", "required": False,
                                "schema": {"type": "string"}}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {"description": "A completion, or with stream=true an SSE stream of chunks",
                            "content": {"application/json": {"schema": response},
                                        "text/event-stream": {"schema": {"type": "string"}}}},
                    **_error_responses(),
                },
            }},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "The served model", "content": {"application/json": {"schema": models}}},
                "401": _error_responses()["401"]}}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "Ready"}, "503": {"description": "Loading or draining"}}}},
        },
        "components": {"schemas": components},
    }

"""``/openapi.json``, generated from the msgspec structs so it cannot drift from what is parsed."""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec

from trtserver import __version__
from trtserver.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

ERROR_STATUSES = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model",
                  "413": "Body too large", "415": "Not JSON", "429": "Over quota",
                  "503": "Loading, draining or overloaded"}


# as quota.py checks it: 1 to 128 printable characters (printable ASCII here)
PROJECT_ID = {"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[ -~]+$"}


def _error_responses() -> dict[str, Any]:
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {code: {"description": text, "content": {"application/json": {"schema": ref}}}
            for code, text in ERROR_STATUSES.items()}


@cache
def openapi_document() -> dict[str, Any]:
    (request, response, error, models, chat, chat_response, chat_chunk, card, tok, tok_response, detok,
     detok_response), components = msgspec.json.schema_components(
        [CompletionRequest, CompletionResponse, ErrorResponse, ModelList, ChatCompletionRequest,
         ChatCompletionResponse, ChatCompletionChunk, ModelCard, TokenizeRequest, TokenizeResponse,
         DetokenizeRequest, DetokenizeResponse],
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
                 "description": "OpenAI-compatible completions and chat APIs with vLLM, OctoAI and Nebius "
                                "extensions"},
        "paths": {
            "/v1/completions": {"post": {
                "operationId": "createCompletion",
                "parameters": [{"name": "ai_project_id", "in": "query", "required": False,
                                "schema": PROJECT_ID}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
                "responses": {
                    "200": {"description": "A completion, or with stream=true an SSE stream of chunks",
                            "content": {"application/json": {"schema": response},
                                        "text/event-stream": {"schema": {"type": "string"}}}},
                    **_error_responses(),
                },
            }},
            "/v1/chat/completions": {"post": {
                "operationId": "createChatCompletion",
                "parameters": [{"name": "ai_project_id", "in": "query", "required": False,
                                "schema": PROJECT_ID}],
                "requestBody": {"required": True, "content": {"application/json": {"schema": chat}}},
                "responses": {
                    "200": {"description": "A chat completion, or with stream=true an SSE stream of chunks",
                            "content": {"application/json": {"schema": chat_response},
                                        "text/event-stream": {"schema": chat_chunk}}},
                    **_error_responses(),
                },
            }},
            "/v1/models": {"get": {"operationId": "listModels", "responses": {
                "200": {"description": "The served model and its LoRA adapters",
                        "content": {"application/json": {"schema": models}}},
                "401": _error_responses()["401"]}}},
            "/v1/models/{model_id}": {"get": {
                "operationId": "retrieveModel",
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "One model", "content": {"application/json": {"schema": card}}},
                              "401": _error_responses()["401"], "404": _error_responses()["404"]}}},
            "/tokenize": {"post": {
                "operationId": "tokenize",
                "requestBody": {"required": True, "content": {"application/json": {"schema": tok}}},
                "responses": {"200": {"description": "The prompt's token ids",
                                      "content": {"application/json": {"schema": tok_response}}},
                              **_error_responses()}}},
            "/detokenize": {"post": {
                "operationId": "detokenize",
                "requestBody": {"required": True, "content": {"application/json": {"schema": detok}}},
                "responses": {"200": {"description": "The tokens' text",
                                      "content": {"application/json": {"schema": detok_response}}},
                              **_error_responses()}}},
            "/version": {"get": {"operationId": "version", "responses": {
                "200": {"description": "The server's version", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"version": {"type": "string"}}}}}}}}},
            "/metrics": {"get": {"operationId": "metrics", "responses": {
                "200": {"description": "Prometheus metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"operationId": "openapi", "responses": {
                "200": {"description": "This document", "content": {"application/json": {"schema": {
                    "type": "object"}}}}}}},
            "/health": {"get": {"operationId": "health", "responses": {
                "200": {"description": "Ready"}, "503": {"description": "Loading or draining"}}}},
        },
        "components": {"schemas": components},
    }

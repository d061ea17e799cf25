"""The served OpenAPI document (`/openapi.json`) and its Swagger page (`/docs`).

Request bodies are the protocol's pydantic models; every error response is the OpenAI error
object; a generation's 200 is JSON or, with `"stream": true`, server-sent events.
"""
from __future__ import annotations

from typing import Any

from slipstream.server.protocol import (
    ERROR_CODES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from slipstream.server.responses import ResponsesRequest

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"], "enum": sorted(ERROR_CODES) + [None]}}}},
}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
         "properties": {k: {"type": "integer", "minimum": 0}
                        for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _generation(obj: str, content: str, content_schema: dict[str, Any], finish_reasons: list[str]) -> dict[str, Any]:
    """A generation's JSON response (chat and completions): the head, usage, and choices holding `content`."""
    return {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": {"$ref": "#/components/schemas/Usage"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", content, "finish_reason"],
                "properties": {"index": {"type": "integer"}, content: content_schema,
                               "finish_reason": {"enum": finish_reasons},
                               "logprobs": {"type": ["object", "null"]}}}}},
    }


CHAT_RESPONSE = _generation("chat.completion", "message", {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
                   "reasoning_content": {"type": "string"},
                   "tool_calls": {"type": "array", "items": {"$ref": "#/components/schemas/ToolCallOut"}}}},
    ["stop", "length", "abort", "tool_calls"])
COMPLETION_RESPONSE = _generation("text_completion", "text", {"type": "string"}, ["stop", "length", "abort"])
TOOL_CALL_OUT = {"type": "object", "required": ["id", "type", "function"],
                 "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "properties": {"name": {"type": "string"},
                                                            "arguments": {"type": "string"}}}}}
RESPONSE = {
    "type": "object", "required": ["id", "object", "created_at", "model", "status", "output", "usage"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "response"}, "created_at": {"type": "integer"},
        "model": {"type": "string"}, "status": {"enum": ["completed", "incomplete"]},
        "output": {"type": "array", "items": {"type": "object", "required": ["type", "id"], "properties": {
            "type": {"enum": ["message", "function_call", "reasoning"]}, "id": {"type": "string"}}}},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"]}},
}
MODEL = {"type": "object", "required": ["id", "object", "max_model_len"],
         "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                        "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}


def _errors() -> dict[str, Any]:
    return {"default": {"description": "An OpenAI-shaped error", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _post(model: type, op_id: str, ok: dict[str, Any], summary: str, stream: bool = False) -> dict[str, Any]:
    if stream:
        # one server-sent event: `data` is a JSON chunk, an error object or "[DONE]"
        event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"},
                                                                        "event": {"type": "string"}}}
        ok = dict(ok, content=dict(ok["content"], **{"text/event-stream": {"schema": event}}))
    return {"post": {"operationId": op_id, "summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": REF.format(model=model.__name__)}}}},
                     "responses": {"200": ok, **_errors()}}}


def _get(op_id: str, ok: dict[str, Any], summary: str, params: list | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": {"200": ok, **_errors()}}
    if params:
        op["parameters"] = params
    return {"get": op}


def openapi_document(title: str, version: str, api_key: bool) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA, "Usage": USAGE, "Model": MODEL, "ToolCallOut": TOOL_CALL_OUT}
    for m in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ResponsesRequest):
        s = m.model_json_schema(ref_template=REF)
        schemas.update(s.pop("$defs", {}))
        schemas[m.__name__] = s
    paths = {
        "/v1/chat/completions": _post(ChatCompletionRequest, "createChatCompletion", _json(CHAT_RESPONSE),
                                      "Chat completion (streamed as server-sent events with stream: true)", True),
        "/v1/completions": _post(CompletionRequest, "createCompletion", _json(COMPLETION_RESPONSE),
                                 "Text completion (streamed as server-sent events with stream: true)", True),
        "/v1/responses": _post(ResponsesRequest, "createResponse", _json(RESPONSE),
                               "Responses API (streamed as typed server-sent events with stream: true)", True),
        "/tokenize": _post(TokenizeRequest, "tokenize", _json({
            "type": "object", "required": ["tokens", "count", "max_model_len"],
            "properties": {"tokens": {"type": "array", "items": {"type": "integer"}}, "count": {"type": "integer"},
                           "max_model_len": {"type": "integer"}}}), "Tokenize a prompt or a conversation"),
        "/detokenize": _post(DetokenizeRequest, "detokenize", _json({
            "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
            "Token ids back to text"),
        "/v1/models": _get("listModels", _json({"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}}}),
            "The served model"),
        "/v1/models/{model}": _get("retrieveModel", _json({"$ref": "#/components/schemas/Model"}), "One model",
                                   [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]),
        "/health": _get("health", {"description": "Serving (503 while starting, draining or failed)"},
                        "Liveness and readiness"),
        "/version": _get("version", _json({"type": "object", "required": ["version"],
                                           "properties": {"version": {"type": "string"}}}), "Server version"),
    }
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                           "components": {"schemas": schemas}}
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
        for p in ("/health", "/version"):
            for op in paths[p].values():
                op["security"] = []
    return doc


def docs_html(openapi_url: str = "/openapi.json") -> str:
    from fastapi.openapi.docs import get_swagger_ui_html

    return bytes(get_swagger_ui_html(openapi_url=openapi_url, title="Slipstream API").body).decode()

"""The Responses API (`POST /v1/responses`) as a translation layer over the chat machinery.

A Responses request becomes a chat request (instructions -> a system message, input items ->
messages, flat function tools -> chat tools, `text.format` -> `response_format`,
`max_output_tokens` -> `max_completion_tokens`), which is prepared, constrained, generated and read
(content, reasoning, tool calls) exactly as a chat completion; `OutputItems` turns the chat deltas
into Responses output items and, when streaming, into the typed events the `openai` SDK parses
(response.created ... response.output_text.delta ... response.completed). Nothing is stored, so
`previous_response_id` is answered with a 400 (send the whole conversation as `input`).
"""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

from pydantic import Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import Response

from slipstream.server.async_engine import EngineDrainingError, EngineFailedError, RequestStream
from slipstream.server.protocol import (
    ChatCompletionRequest,
    _FieldError,
    _format_errors,
    _Strict,
    bad_request,
    parse_body,
)
from slipstream.server.state import AppState
from slipstream.server.streaming import ClientGone, SSEResponse, collect, json_bytes, stream_error

if TYPE_CHECKING:
    from slipstream.server.routes import Prepared

INT64 = 2 ** 63 - 1
# routes.py lists this module's route and this module uses routes.py's chat preparation: imported in
# the functions that need it


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)

    @model_validator(mode="after")
    def _checks(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise _FieldError("previous_response_id", "this server stores no responses: send the whole conversation "
                              "as input instead of previous_response_id", "previous_response_not_supported")
        return self


# -- Responses request -> chat request ----------------------------------------------------------------

def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(p.get("text"), str):
                raise bad_request(f"{where}[{i}] must be a text part (input_text / output_text); other content "
                                  "types are not supported", f"{where}[{i}]", "unsupported_parameter")
            parts.append(p["text"])
        return "\n".join(parts)
    raise bad_request(f"{where} must be a string or a list of text parts", where, "invalid_type")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        msgs.append({"role": "user", "content": req.input})
        return msgs
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            msgs.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            name, args, cid = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, cid)):
                raise bad_request(f"{where}: a function_call item needs string call_id, name and arguments", where)
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls") is not None:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = item.get("call_id"), item.get("output")
            if not isinstance(cid, str):
                raise bad_request(f"{where}: a function_call_output item needs its call_id", where)
            msgs.append({"role": "tool", "tool_call_id": cid, "content": _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue   # earlier reasoning is not fed back to the model
        else:
            raise bad_request(f"{where}: input items of type {str(kind)[:40]!r} are not supported", where,
                              "unsupported_parameter")
    if not msgs:
        raise bad_request("input holds no message", "input")
    return msgs


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    if req.tools is None:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported", f"tools[{i}]", "invalid_tool")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t and t[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format", "invalid_type")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    return {"type": fmt.get("type")}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": _messages(req), "stream": req.stream}
    for src, dst in (("model", "model"), ("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("seed", "seed"),
                     ("user", "user")):
        value = getattr(req, src)
        if value is not None:
            body[dst] = value
    tools = _tools(req)
    if tools:
        body["tools"] = tools
    if req.tool_choice is not None:
        body["tool_choice"] = _tool_choice(req.tool_choice)
    rf = _response_format(req.text)
    if rf is not None:
        body["response_format"] = rf
    effort = (req.reasoning or {}).get("effort")
    if effort in ("none", "minimal"):
        body["chat_template_kwargs"] = {"enable_thinking": False}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _format_errors(e, ChatCompletionRequest) from None


def prepare_response(S: AppState, raw: bytes) -> tuple[ResponsesRequest, Prepared]:
    from slipstream.server.routes import prepare_chat_request

    data = parse_body(raw, S.config.max_json_depth)
    try:
        req = ResponsesRequest.model_validate(data)
    except ValidationError as e:
        raise _format_errors(e, ResponsesRequest) from None
    return req, prepare_chat_request(S, to_chat(req))


# -- chat deltas -> output items and events -------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """Builds the Responses `output` from one choice's chat deltas; each step's events come back
    from `add` / `close` (a non-streamed response just ignores them)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None    # the item deltas are going to
        self._open_key: tuple | None = None
        self._seq = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def add(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "reasoning_content" in delta:
            out += self._ensure(("reasoning",), lambda: {"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                                         "content": [{"type": "reasoning_text", "text": ""}],
                                                         "status": "in_progress"})
            item = self._open
            assert item is not None
            item["content"][0]["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=item["id"], output_index=self._index,
                                  content_index=0, delta=delta["reasoning_content"]))
        if "content" in delta and delta["content"]:
            out += self._ensure(("message",), self._message)
            item = self._open
            assert item is not None
            item["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self._index,
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if "id" in tc:
                out += self._ensure(("call", tc["index"]), lambda tc=tc, fn=fn: {
                    "type": "function_call", "id": _new_id("fc"), "call_id": tc["id"], "name": fn.get("name", ""),
                    "arguments": "", "status": "in_progress"})
            item = self._open
            if item is not None and fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index, delta=fn["arguments"]))
        return out

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _message(self) -> dict[str, Any]:
        return {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    def _ensure(self, key: tuple, make: Any) -> list[dict[str, Any]]:
        if self._open_key == key:
            return []
        out = self.close()
        item = make()
        self.items.append(item)
        self._open, self._open_key = item, key
        shell = dict(item, content=[]) if item["type"] == "message" else item
        out.append(self.event("response.output_item.added", output_index=self._index, item=_copy(shell)))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self._index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return out

    def close(self) -> list[dict[str, Any]]:
        """Finish the open item (its .done events)."""
        item, self._open, self._open_key = self._open, None, None
        if item is None:
            return []
        item["status"] = "completed"
        i = self.items.index(item)
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                  part=_copy(part)))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=i, item=_copy(item)))
        return out


def _copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _response(req: ResponsesRequest, head: dict[str, Any], status: str, items: list[dict[str, Any]],
              finish_reason: str | None, n_prompt: int, n_output: int, reasoning_chars: int = 0) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    usage = None
    if status != "in_progress":
        usage = {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": n_output, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": n_prompt + n_output}
    return {**head, "object": "response", "status": status, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": head["model"], "output": items, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": req.reasoning, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation or "disabled",
            "metadata": req.metadata or {}, "user": req.user, "usage": usage}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


# -- the route ----------------------------------------------------------------------------------------

async def create_response(S: AppState, request: Request) -> Response:
    from slipstream.server.routes import chat_outputs, json_response, request_id_of

    req, prep = await S.pool.run(prepare_response, S, await request.body())
    if req.stream and len(prep.items) != 1:
        raise bad_request("the Responses API makes one answer per request")
    stream = await S.submit(prep.items, prep.req.priority, "input")
    head = {"id": _new_id("resp"), "created_at": int(time.time()), "model": S.model_id}
    if req.stream:
        return SSEResponse(_events(S, req, prep, head, stream, request_id_of(request)), stream)
    try:
        choices = await collect(request, stream, 1, S.config.retry_after_s)
    except ClientGone:
        return Response(status_code=499)
    chat = chat_outputs(prep, choices)[0]
    items = OutputItems()
    for d in _deltas_of(chat):
        items.add(d)
    items.close()
    c = choices[0]
    return json_response(_response(req, head, _status(c.finish_reason), items.items, c.finish_reason,
                                   prep.n_prompt, len(c.token_ids)))


def _deltas_of(chat: Any) -> list[dict[str, Any]]:
    """A finished chat output as deltas, in the order a stream would give them."""
    out: list[dict[str, Any]] = []
    if chat.reasoning:
        out.append({"reasoning_content": chat.reasoning})
    if chat.content:
        out.append({"content": chat.content})
    for i, tc in enumerate(chat.tool_calls):
        out.append({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                    "function": {"name": tc["function"]["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": tc["function"]["arguments"]}}]})
    return out


def _sse(ev: dict[str, Any]) -> bytes:
    return b"event: " + ev["type"].encode() + b"\ndata: " + json_bytes(ev) + b"\n\n"


async def _events(S: AppState, req: ResponsesRequest, prep: Prepared, head: dict[str, Any], stream: RequestStream,
                  request_id: str) -> AsyncIterator[bytes]:
    assert prep.output is not None
    chat = prep.output.new()
    items = OutputItems()
    n_output = 0
    finish: str | None = None
    snapshot = _response(req, head, "in_progress", [], None, prep.n_prompt, 0)
    yield _sse(items.event("response.created", response=snapshot))
    yield _sse(items.event("response.in_progress", response=snapshot))
    try:
        async for ev in stream:
            n_output += len(ev.token_ids)
            deltas = chat.feed(ev.text)
            if ev.finished:
                deltas += chat.finish()
                finish = ev.finish_reason
            for d in deltas:
                for out in items.add(d):
                    yield _sse(out)
        for out in items.close():
            yield _sse(out)
        done = _response(req, head, _status(finish), items.items, finish, prep.n_prompt, n_output)
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        yield _sse(items.event(kind, response=done))
    except (EngineFailedError, EngineDrainingError) as e:
        err = stream_error(e, request_id)
        yield b"event: error\n" + err
    except Exception as e:   # a bug: logged by stream_error's caller path; the client gets an error event
        import logging
        logging.getLogger("slipstream.server").exception("responses stream failed (request id %s)", request_id)
        yield b"event: error\n" + stream_error(e, request_id)

"""The routes, each a plain function of the app state and the request: `async def route(S, request)`.

The CPU-heavy part of a generation request (parsing and validating the body, rendering the chat
template, tokenizing, checking the limits) is one `prepare_*` function run on the worker pool; the
event loop only submits to the engine and writes the answer. `ROUTES` lists them for `build_app`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from slipstream.engine.sampling import SamplingParams
from slipstream.server.async_engine import StreamEvent
from slipstream.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    constraint_param,
    error_body,
    parse_request,
)
from slipstream.server.responses import create_response
from slipstream.server.state import AppState
from slipstream.server.streaming import ClientGone, EventStreamResponse, Shape, collect, json_bytes, usage
from slipstream.structured.chat_output import OutputConfig
from slipstream.structured.constraint import Constraint
from slipstream.structured.reasoning import starts_in_reasoning
from slipstream.structured.tool_parsers import make_parser
from slipstream.structured.tool_prompt import template_messages
from slipstream.structured.tool_schema import named_constraint, required_constraint

Route = Callable[[AppState, Request], Awaitable[Response]]


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(obj), status_code=status, media_type="application/json", headers=headers)


def request_id_of(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or f"req-{uuid.uuid4().hex[:24]}"


def _render_template(S: AppState, msgs: list[dict[str, str]], add_generation_prompt: bool | None = None) -> str:
    import jinja2

    try:
        if add_generation_prompt is None:
            return S.llm.chat_prompt(msgs)
        return S.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:   # the template's own message (raise_exception): the user's to read
        raise bad_request(f"could not render the chat template: {str(e)[:500]}", "messages") from None


# -- preparing a request (worker threads) -------------------------------------------------------------

@dataclass
class Prepared:
    req: Any
    items: list[tuple[list[int], SamplingParams]]
    n_prompt: int
    output: OutputConfig | None = None    # chat: how each choice's text becomes content / reasoning / tool calls


def _render_chat(S: AppState, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 kwargs: dict[str, Any]) -> str:
    import jinja2

    if tools is None and not kwargs:
        return _render_template(S, msgs)
    try:
        return S.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools, **kwargs)
    except jinja2.TemplateError as e:
        raise bad_request(f"could not render the chat template: {str(e)[:500]}", "messages") from None


def prepare_chat(S: AppState, raw: bytes) -> Prepared:
    return prepare_chat_request(S, parse_request(ChatCompletionRequest, raw, S.config.max_json_depth))


def prepare_chat_request(S: AppState, req: ChatCompletionRequest) -> Prepared:
    """The CPU work of a chat request (also the Responses API's, which translates into one)."""
    S.check_model(req.model)
    S.check_stops(req.stop)
    S.check_choices(req.n, 1, "n")
    mode = req.tool_mode
    tools = req.tool_list if mode is not None else []
    msgs = [m.as_template_message() for m in req.messages]
    S.check_chars(sum(len(m["content"]) for m in msgs), "conversation", "messages")
    msgs, template_tools = template_messages(msgs, tools, S.template_renders_tools)
    prompt = _render_chat(S, msgs, template_tools, dict(req.chat_template_kwargs or {}))
    ids = S.tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = S.max_tokens_for(len(ids), req.requested_max_tokens, "messages", "messages")

    constraint: Constraint | None = req.constraint
    param = constraint_param(req)
    output = OutputConfig(reasoning=S.reasoning, in_reasoning=S.reasoning and starts_in_reasoning(prompt),
                          include_reasoning=req.include_reasoning)
    if mode == "auto":
        output.tool_mode, output.parser = "auto", make_parser(S.tool_parser, [t.as_openai() for t in tools])
    elif mode == "required":
        output.tool_mode, param = "required", "tool_choice"
        constraint = required_constraint(tools, req.parallel_tool_calls is not False)
    elif mode is not None:
        output.tool_mode, output.function, param = "named", mode, "tool_choice"
        constraint = named_constraint(next(t for t in tools if t.name == mode))
    extra: dict[str, Any] = {}
    if constraint is not None:
        S.check_constraint(constraint, param)
        extra["constraint"] = constraint
    # a parser that reads special tokens ([TOOL_CALLS] is one) needs them in the text
    skip = req.skip_special_tokens
    if skip is None and output.parser is not None and output.parser.name == "mistral":
        skip = False
    if skip is not None:
        extra["skip_special_tokens"] = skip
    params = S.sampling(req, max_tokens, req.num_logprobs, req.n, extra)
    return Prepared(req, [(ids, p) for p in params], len(ids), output)


def prepare_completion(S: AppState, raw: bytes) -> Prepared:
    req: CompletionRequest = parse_request(CompletionRequest, raw, S.config.max_json_depth)
    S.check_model(req.model)
    S.check_stops(req.stop)
    prompts = req.prompts()
    S.check_choices(req.n, len(prompts), "n" if len(prompts) == 1 else "prompt")
    extra: dict[str, Any] = {}
    if req.constraint is not None:
        S.check_constraint(req.constraint, constraint_param(req))
        extra["constraint"] = req.constraint
    if req.skip_special_tokens is not None:
        extra["skip_special_tokens"] = req.skip_special_tokens
    items: list[tuple[list[int], SamplingParams]] = []
    n_prompt = 0
    for k, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        if isinstance(p, str):
            S.check_chars(len(p), "prompt", param)
            ids = S.tokenizer.encode(p, add_special_tokens=True)
        else:
            ids = list(p)
        max_tokens = S.max_tokens_for(len(ids), req.max_tokens, "prompt", param)
        items += [(ids, sp) for sp in S.sampling(req, max_tokens, req.logprobs, req.n, extra)]
        n_prompt += len(ids)
    return Prepared(req, items, n_prompt)


def prepare_tokenize(S: AppState, raw: bytes) -> dict[str, Any]:
    req: TokenizeRequest = parse_request(TokenizeRequest, raw, S.config.max_json_depth)
    S.check_model(req.model)
    if req.messages is not None:
        msgs = [m.as_template_message() for m in req.messages]
        S.check_chars(sum(len(m["content"]) for m in msgs), "conversation", "messages")
        text = _render_template(S, msgs, req.add_generation_prompt)
        special = False if req.add_special_tokens is None else req.add_special_tokens
    else:
        assert req.prompt is not None
        S.check_chars(len(req.prompt), "prompt", "prompt")
        text = req.prompt
        special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = S.tokenizer.encode(text, add_special_tokens=special)
    return {"tokens": ids, "count": len(ids), "max_model_len": S.max_model_len}


def prepare_detokenize(S: AppState, raw: bytes) -> dict[str, Any]:
    req: DetokenizeRequest = parse_request(DetokenizeRequest, raw, S.config.max_json_depth)
    S.check_model(req.model)
    vocab = S.tokenizer.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise bad_request(f"token id {req.tokens[bad]} is outside the vocabulary (0..{vocab - 1})", f"tokens[{bad}]")
    return {"prompt": S.tokenizer.decode(req.tokens, skip_special_tokens=False)}


# -- generation ------------------------------------------------------------------------------------

def _chat_shape(S: AppState, prep: Prepared, head: dict[str, Any]) -> Shape:
    req: ChatCompletionRequest = prep.req
    cfg = prep.output or OutputConfig()
    outputs = [cfg.new() for _ in range(req.n)]

    def render(ev: StreamEvent) -> list[dict[str, Any]]:
        lp = {"content": S.chat_logprobs(ev.logprobs), "refusal": None} if req.logprobs and ev.token_ids else None
        o = outputs[ev.index]
        deltas = o.feed(ev.text)
        if ev.finished:
            deltas += o.finish()
        if not deltas and lp is not None and not ev.finished:
            deltas = [{"content": ""}]
        out = []
        for d in deltas:
            out.append({"index": ev.index, "delta": d, "logprobs": lp, "finish_reason": None})
            lp = None
        if ev.finished:
            out.append({"index": ev.index, "delta": {}, "logprobs": lp,
                        "finish_reason": o.finish_reason(ev.finish_reason)})
        return out

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(req.n)]
    return Shape(dict(head, object="chat.completion.chunk"), render, opening, req.include_usage, prep.n_prompt)


def _completion_shape(S: AppState, prep: Prepared, head: dict[str, Any]) -> Shape:
    req: CompletionRequest = prep.req
    offsets = [0] * len(prep.items)

    def render(ev: StreamEvent) -> list[dict[str, Any]]:
        lp = None
        if req.logprobs is not None and ev.token_ids:
            lp, offsets[ev.index] = S.completion_logprobs(ev.logprobs, offsets[ev.index])
        if ev.text or ev.finished or lp is not None:
            return [{"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}]
        return []

    return Shape(dict(head, object="text_completion"), render, [], req.include_usage, prep.n_prompt)


async def _generate(S: AppState, request: Request, prepare: Callable[[AppState, bytes], Prepared],
                    param: str, id_prefix: str, shape_of: Callable[[AppState, Prepared, dict], Shape],
                    final: Callable[[AppState, Prepared, list], list[dict[str, Any]]], obj: str) -> Response:
    prep = await S.pool.run(prepare, S, await request.body())
    stream = await S.submit(prep.items, prep.req.priority, param)
    head = {"id": f"{id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": S.model_id}
    if prep.req.stream:
        return EventStreamResponse(shape_of(S, prep, head), stream, request_id_of(request))
    try:
        choices = await collect(request, stream, len(prep.items), S.config.retry_after_s)
    except ClientGone:
        return Response(status_code=499)
    return json_response(dict(head, object=obj, choices=final(S, prep, choices),
                              usage=usage(prep.n_prompt, sum(len(c.token_ids) for c in choices))))


def chat_outputs(prep: Prepared, choices: list) -> list[Any]:
    """Each choice's text read as the chat API returns it (content, reasoning, tool calls)."""
    cfg = prep.output or OutputConfig()
    outs = []
    for c in choices:
        o = cfg.new()
        o.feed("".join(c.text))
        o.finish()
        outs.append(o)
    return outs


def _chat_choices(S: AppState, prep: Prepared, choices: list) -> list[dict[str, Any]]:
    req = prep.req
    return [{"index": i, "message": o.message(),
             "logprobs": {"content": S.chat_logprobs(c.logprobs), "refusal": None} if req.logprobs else None,
             "finish_reason": o.finish_reason(c.finish_reason)}
            for i, (c, o) in enumerate(zip(choices, chat_outputs(prep, choices)))]


def _completion_choices(S: AppState, prep: Prepared, choices: list) -> list[dict[str, Any]]:
    req = prep.req
    return [{"index": i, "text": "".join(c.text),
             "logprobs": S.completion_logprobs(c.logprobs, 0)[0] if req.logprobs is not None else None,
             "finish_reason": c.finish_reason} for i, c in enumerate(choices)]


async def chat_completions(S: AppState, request: Request) -> Response:
    return await _generate(S, request, prepare_chat, "messages", "chatcmpl", _chat_shape, _chat_choices,
                           "chat.completion")


async def completions(S: AppState, request: Request) -> Response:
    return await _generate(S, request, prepare_completion, "prompt", "cmpl", _completion_shape, _completion_choices,
                           "text_completion")


async def tokenize(S: AppState, request: Request) -> Response:
    return json_response(await S.pool.run(prepare_tokenize, S, await request.body()))


async def detokenize(S: AppState, request: Request) -> Response:
    return json_response(await S.pool.run(prepare_detokenize, S, await request.body()))


# -- plain routes ---------------------------------------------------------------------------------------

async def health(S: AppState, request: Request) -> Response:
    retry = {"Retry-After": str(S.config.retry_after_s)}
    if S.draining or not S.engine.accepting:
        return json_response(error_body("the server is shutting down", "server_error", None, "server_shutting_down"),
                             503, retry)
    if not S.engine.is_running:
        return json_response(error_body("the engine is not running", "server_error", None, "engine_unavailable"),
                             503, retry)
    return Response(status_code=200)


async def version(S: AppState, request: Request) -> Response:
    from slipstream import __version__
    return json_response({"version": __version__})


async def metrics(S: AppState, request: Request) -> Response:
    return Response(S.metrics.render(), media_type=S.metrics.content_type)


def model_card(S: AppState) -> dict[str, Any]:
    return {"id": S.model_id, "object": "model", "created": S.created, "owned_by": "slipstream",
            "root": S.llm.model_name, "parent": None, "max_model_len": S.max_model_len}


async def models(S: AppState, request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(S)]})


async def model(S: AppState, request: Request) -> Response:
    S.check_model(request.path_params["model"])
    return json_response(model_card(S))


# (method, path, route)
ROUTES: list[tuple[str, str, Route]] = [
    ("GET", "/health", health),
    ("GET", "/version", version),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{model:path}", model),
    ("POST", "/tokenize", tokenize),
    ("POST", "/detokenize", detokenize),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/responses", create_response),
]

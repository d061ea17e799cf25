"""Request models of the OpenAI-compatible API, their validation, and OpenAI-shaped errors.

Requests are validated strictly, as OpenAI does: a wrong type is not coerced ("2" is not an
integer), unknown fields are rejected ("Unrecognized request argument supplied: foo"), and every
problem becomes a 400 naming the parameter. vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, priority) are accepted at the top level.
Responses are built as plain dicts by the app (they are written once per token when streaming).

Every error carries a stable `code` a client can branch on (see `ERROR_CODES`).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from slipstream.engine.sampling import MAX_LOGPROBS
from slipstream.structured.constraint import Constraint, ConstraintError
from slipstream.structured.tool_schema import Tool, check_unique, tool_from_openai

MAX_N = 128                     # as OpenAI
MAX_COMPLETION_LOGPROBS = 5     # the legacy completions API's limit
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


# the stable `code` of every error the server returns, with its HTTP status
ERROR_CODES = {
    "invalid_json": 400, "json_too_deep": 400, "invalid_encoding": 400, "invalid_type": 400,
    "invalid_value": 400, "missing_required_parameter": 400, "unknown_parameter": 400,
    "unsupported_parameter": 400, "context_length_exceeded": 400, "prompt_too_long": 400,
    "too_many_choices": 400, "invalid_api_key": 401, "host_not_allowed": 400, "not_found": 404,
    "model_not_found": 404, "method_not_allowed": 405, "request_timeout": 408,
    "request_too_large": 413, "unsupported_media_type": 415, "internal_error": 500,
    "queue_full": 503, "server_busy": 503, "server_shutting_down": 503, "too_many_connections": 503,
    "engine_unavailable": 503,
    # structured output and tools
    "invalid_json_schema": 400, "invalid_grammar": 400, "invalid_tool": 400, "invalid_tool_choice": 400,
    "previous_response_not_supported": 400,
}


class APIError(Exception):
    """An error returned to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, code: str, retry_after_s: int = 1) -> APIError:
    """A 503 for a condition that passes: the client may retry after `retry_after_s`."""
    return APIError(503, message, "server_error", None, code, {"Retry-After": str(retry_after_s)})


# -- models -------------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A tool call in an assistant message of the history (as a response gave it)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None          # role "tool": the call this message answers
    tool_calls: list[ToolCallIn] | None = None
    reasoning_content: str | None = None     # an assistant's reasoning, as a response gave it
    # what an assistant message read back from a response carries (so a client can append it to
    # the history as it is); only empty values are accepted
    refusal: str | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("a message needs content (a string or a list of text parts)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.function_call or self.audio:
            raise ValueError("function_call (deprecated) and audio in messages are not supported")
        return self

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "\n".join(p.text for p in content or [])

    def as_template_message(self) -> dict[str, Any]:
        """The message as a chat template expects it: content joined into one string, a tool call's
        arguments as an object (what templates serialize with tojson)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _args_object(c.function.arguments)}}
                for c in self.tool_calls]
        return msg


def _args_object(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _SamplingRequest(_Strict):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None   # count and length: the server's limits
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    skip_special_tokens: bool | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs (and its older guided_* fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: Constraint | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _common_checks(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "The 'stream_options' parameter is only allowed when "
                                                "'stream' is enabled.")
        if self.logit_bias:
            raise _FieldError("logit_bias", "logit_bias is not supported", "unsupported_parameter")
        self._constraint = self._read_constraint()
        return self

    @property
    def constraint(self) -> Constraint | None:
        """What the output must match (not yet compiled for the tokenizer)."""
        return self._constraint

    def _read_constraint(self) -> Constraint | None:
        found: list[tuple[str, Constraint]] = []
        try:
            if self.response_format is not None:
                c = _response_format(self.response_format)
                if c is not None:
                    found.append(("response_format", c))
            if self.structured_outputs is not None:
                found.append(("structured_outputs", _structured_outputs(self.structured_outputs)))
            if self.guided_json is not None:
                schema = self.guided_json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except ValueError:
                        raise ConstraintError("guided_json must be a JSON schema", "invalid_json_schema") from None
                found.append(("guided_json", Constraint.json_schema(schema)))
            if self.guided_regex is not None:
                found.append(("guided_regex", Constraint.regex(self.guided_regex)))
            if self.guided_choice is not None:
                found.append(("guided_choice", Constraint.choice(self.guided_choice)))
            if self.guided_grammar is not None:
                found.append(("guided_grammar", Constraint.grammar(self.guided_grammar)))
        except ConstraintError as e:
            param = constraint_param(self)
            raise _FieldError(param, str(e), e.code) from None
        if len(found) > 1:
            raise _FieldError(found[1][0], f"give one output constraint; got {found[0][0]} and {found[1][0]}")
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keyword arguments, except max_tokens, seed and logprobs."""
        kw: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
        }
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = self.top_k
        if self.min_p is not None:
            kw["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            kw["repetition_penalty"] = self.repetition_penalty
        if self.stop_token_ids:
            kw["stop_token_ids"] = self.stop_token_ids
        return kw


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: variables for the chat template (e.g. {"enable_thinking": false}); whether to return reasoning
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    _tools: list[Tool] = PrivateAttr(default_factory=list)
    _tool_choice: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _FieldError("top_logprobs", "top_logprobs requires logprobs to be true")
        self._tools = _read_tools(self.tools)
        self._tool_choice = _read_tool_choice(self.tool_choice, self._tools)
        if self._tool_choice not in (None, "none", "auto") and self.constraint is not None:
            raise _FieldError("tool_choice", "tool_choice 'required' or a named function already constrains the "
                              "output; drop response_format / structured_outputs")
        if self.chat_template_kwargs is not None:
            for key in ("messages", "tools", "add_generation_prompt", "documents"):
                if key in self.chat_template_kwargs:
                    raise _FieldError("chat_template_kwargs", f"chat_template_kwargs may not set {key!r}")
        return self

    @property
    def tool_list(self) -> list[Tool]:
        """The function tools, checked (empty when none were given)."""
        return self._tools

    @property
    def tool_mode(self) -> str | None:
        """None (no tools or tool_choice "none"), "auto", "required", or the name of the forced function."""
        return None if not self._tools or self._tool_choice == "none" else self._tool_choice

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the number of alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


PromptIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: str | PromptIds | Annotated[list[str], Field(min_length=1)] \
        | Annotated[list[PromptIds], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=1)       # OpenAI's and vLLM's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.echo:
            raise _FieldError("echo", "echo is not supported", "unsupported_parameter")
        if self.suffix:
            raise _FieldError("suffix", "suffix is not supported", "unsupported_parameter")
        if self.best_of not in (None, 1):
            raise _FieldError("best_of", "best_of > 1 is not supported", "unsupported_parameter")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s): one string or token list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _FieldError("prompt", "give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


# -- structured output and tools ------------------------------------------------------------------

def constraint_param(req: Any) -> str:
    """The request field that carries its output constraint."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name, None) is not None:
            return name
    return "response_format"


def _response_format(rf: dict[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ConstraintError("response_format json_schema needs a 'json_schema' object", "invalid_json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ConstraintError("response_format.json_schema needs a 'name' of 1 to 64 characters",
                                  "invalid_json_schema")
        schema = js.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ConstraintError("response_format.json_schema.schema must be a JSON schema object",
                                  "invalid_json_schema")
        return Constraint.json_schema(schema)
    raise ConstraintError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "invalid_value")


def _structured_outputs(so: dict[str, Any]) -> Constraint:
    """vLLM's `structured_outputs`: exactly one of json, json_object, regex, choice, grammar."""
    known = {"json", "json_object", "regex", "choice", "grammar"}
    options = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}
    unknown = sorted(set(so) - known - options)
    if unknown:
        raise ConstraintError(f"structured_outputs does not take {unknown[0]!r} (json, json_object, regex, choice, "
                              "grammar)", "invalid_value")
    given = [k for k in ("json", "json_object", "regex", "choice", "grammar") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise ConstraintError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
                              "invalid_value")
    key, value = given[0], so[given[0]]
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ConstraintError("structured_outputs.json must be a JSON schema", "invalid_json_schema") from None
        return Constraint.json_schema(value)
    if key == "json_object":
        return Constraint.json_object()
    if key == "choice" and isinstance(value, list):
        return Constraint.choice(value)
    if key == "choice" or not isinstance(value, str):
        raise ConstraintError(f"structured_outputs.{key} has the wrong type", "invalid_value")
    return Constraint.regex(value) if key == "regex" else Constraint.grammar(value)


def _read_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    out = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise _FieldError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                              "invalid_tool")
        try:
            out.append(tool_from_openai(t["function"], where))
        except ConstraintError as e:
            raise _FieldError(where, str(e), e.code) from None
    try:
        check_unique(out)
    except ConstraintError as e:
        raise _FieldError("tools", str(e), e.code) from None
    return out


def _read_tool_choice(choice: str | dict[str, Any] | None, tools: list[Tool]) -> str | None:
    """None/"none"/"auto"/"required", or the forced function's name."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice != "none" and not tools:
            raise _FieldError("tool_choice", f"tool_choice {choice!r} needs tools", "invalid_tool_choice")
        return choice
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise _FieldError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "invalid_tool_choice")
    if name not in {t.name for t in tools}:
        raise _FieldError("tool_choice", f"tool_choice names the function {name[:80]!r}, which is not in tools",
                          "invalid_tool_choice")
    return name


# -- parsing ------------------------------------------------------------------------------------

class _FieldError(ValueError):
    """A cross-field check's failure, naming its parameter."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


def _param_name(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "constrained-str", "constrained-int"}


def _clean_loc(loc: tuple) -> tuple:
    """Drop the union-member tags pydantic puts in locations ('str', 'list[int]', 'function-after[...]')."""
    return tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS))


def _format_errors(exc: ValidationError, model: type[BaseModel]) -> APIError:
    errors = exc.errors(include_url=False)
    for e in errors:  # our own cross-field checks carry their parameter
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _FieldError):
            return bad_request(ctx_err.message, ctx_err.param, ctx_err.code)
    # of a union's per-member errors, a broken constraint says more than a wrong type
    first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
    locs = [_clean_loc(tuple(e["loc"])) for e in errors]
    # a union reports one error per member: name their common parameter
    loc = locs[0]
    for other in locs[1:]:
        n = 0
        while n < min(len(loc), len(other)) and loc[n] == other[n]:
            n += 1
        loc = loc[:n]
    param = _param_name(loc) or None
    if first["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    msg = first["msg"].removeprefix("Value error, ")
    if len(errors) > 1 and all(e["type"].endswith("_type") for e in errors):
        msg = "Input has the wrong type"
    got = first.get("input")
    shown = "" if first["type"] in ("too_short", "too_long") or isinstance(got, (dict, list)) else \
        f" (got {json.dumps(got)[:100]})" if _jsonable(got) else ""
    code = "invalid_type" if first["type"].endswith("_type") else "invalid_value"
    return bad_request(f"Invalid value for '{param}': {msg}{shown}" if param else msg, param, code)


def _jsonable(x: Any) -> bool:
    try:
        json.dumps(x)
        return True
    except (TypeError, ValueError):
        return False


def parse_body(raw: bytes, max_depth: int = 32) -> dict[str, Any]:
    """The request body as a JSON object, or a 400: not JSON, nested deeper than `max_depth`, or
    holding a string that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800")."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise bad_request(f"The JSON body is nested too deeply (the limit is {max_depth} levels).", None,
                          "json_too_deep") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", None, "invalid_json")
    _check_tree(data, max_depth)
    return data


def _check_tree(data: Any, max_depth: int) -> None:
    """Depth and string encoding of a parsed body, iteratively (no recursion on hostile input)."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        node, depth, loc = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    param = _param_name(loc) or None
                    raise bad_request(f"Invalid value for '{param}': the string holds a lone UTF-16 surrogate, "
                                      "which is not valid Unicode" if param else
                                      "A key of the body holds a lone UTF-16 surrogate", param,
                                      "invalid_encoding") from None
            continue
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                raise bad_request(f"The JSON body is nested too deeply (the limit is {max_depth} levels).",
                                  None, "json_too_deep")
            if isinstance(node, dict):
                for k, v in node.items():
                    stack.append((k, depth, loc))
                    stack.append((v, depth + 1, loc + (k,)))
            else:
                stack.extend((v, depth + 1, loc + (i,)) for i, v in enumerate(node))


def parse_request(model: type[BaseModel], raw: bytes, max_depth: int = 32) -> Any:
    data = parse_body(raw, max_depth)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _format_errors(e, model) from None

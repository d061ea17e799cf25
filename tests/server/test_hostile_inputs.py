"""The bad-input catalogue: malformed, extreme and hostile requests against the live server (the
default model, default settings). Every one must get a 4xx with an OpenAI-shaped error and a
stable code, or a 200; never a 5xx; and the server must stay healthy after each."""
from __future__ import annotations

import json

import httpx
import pytest

from slipstream.server.protocol import ERROR_CODES

CHAT, COMP, TOK, DETOK = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
RESP = "/v1/responses"
MSGS = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def _deep(n: int) -> bytes:
    return b'{"messages": ' + b"[" * n + b"]" * n + b"}"


# (id, method, path, body: dict | bytes | None, headers)
CASES: list[tuple[str, str, str, object, dict]] = []


def case(id: str, path: str, body: object, method: str = "POST", headers: dict | None = None) -> None:
    CASES.append((id, method, path, body, JSON if headers is None else headers))


# -- bodies that are not the JSON object we want ----------------------------------------------------
for p in (CHAT, COMP, TOK, DETOK, RESP):
    tag = p.strip("/").replace("/", "-")
    case(f"{tag}-empty-body", p, b"")
    case(f"{tag}-malformed", p, b'{"messages": [')
    case(f"{tag}-null", p, b"null")
    case(f"{tag}-array", p, b"[1, 2]")
    case(f"{tag}-string", p, b'"hello"')
    case(f"{tag}-deep-100k", p, _deep(100_000))
    case(f"{tag}-deep-40", p, _deep(40))
    case(f"{tag}-invalid-utf8", p, b'{"prompt": "\xff\xfe"}')
    case(f"{tag}-lone-surrogate-key", p, b'{"a\\ud800": 1}')
    case(f"{tag}-text-plain", p, {"prompt": "x"}, headers={"content-type": "text/plain"})
    case(f"{tag}-no-content-type", p, {"prompt": "x"}, headers={})
    case(f"{tag}-form", p, b"prompt=x", headers={"content-type": "application/x-www-form-urlencoded"})

# -- lone surrogates and odd unicode in every string field -----------------------------------------------
SURR = "a\ud800b"
case("surrogate-chat-content", CHAT, {"messages": [{"role": "user", "content": SURR}], "max_tokens": 1})
case("surrogate-chat-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURR}]}]})
case("surrogate-chat-name", CHAT, {"messages": [{"role": "user", "content": "x", "name": SURR}]})
case("surrogate-model", CHAT, {"model": SURR, "messages": MSGS})
case("surrogate-stop", CHAT, {"messages": MSGS, "stop": [SURR]})
case("surrogate-user", CHAT, {"messages": MSGS, "user": SURR})
case("surrogate-prompt", COMP, {"prompt": SURR, "max_tokens": 1})
case("surrogate-prompt-list", COMP, {"prompt": ["ok", SURR], "max_tokens": 1})
case("surrogate-tokenize", TOK, {"prompt": SURR})
case("surrogate-tokenize-model", TOK, {"model": SURR, "prompt": "x"})
case("low-surrogate", COMP, {"prompt": "\udc00", "max_tokens": 1})
case("nul-char", COMP, {"prompt": "a\u0000b", "max_tokens": 1})
case("emoji", CHAT, {"messages": [{"role": "user", "content": "🙂 👋🏽 é 日本"}], "max_tokens": 1})
case("rtl-and-zwj", COMP, {"prompt": "\u202eabc\u200d", "max_tokens": 1})
case("bom-in-string", COMP, {"prompt": "\ufeffhi", "max_tokens": 1})

# -- wrong types and out-of-range values, field by field ----------------------------------------------
CHAT_BAD = {
    "model": [1, [], {}],
    "messages": [None, {}, [1], [{"role": "user", "content": 1}], [{"role": "nobody", "content": "x"}],
                 [{"content": "x"}], [{"role": "user", "content": [{"type": "text"}]}]],
    "max_tokens": [0, -5, "3", 1.5, True, 10 ** 30],
    "max_completion_tokens": [0, "x"],
    "temperature": [-0.1, 2.01, "warm", None if False else [1]],
    "top_p": [0, 1.5, "x"],
    "n": [0, 129, -1, 1.0],
    "stream": ["yes", 1],
    "stop": [5, [1, 2], [""], ""],
    "seed": [2 ** 64, "1", 1.5],
    "presence_penalty": [-2.5, 3],
    "frequency_penalty": [9, "x"],
    "logit_bias": [{"1": 100}, "x"],
    "logprobs": ["true", 1],
    "top_logprobs": [-1, 21, "x"],
    "top_k": [-2, "x"],
    "min_p": [-0.1, 1.1],
    "repetition_penalty": [0, -1],
    "stop_token_ids": [[-1], "x", [1.5]],
    "priority": [2 ** 70, "x"],
    "response_format": [{"type": "json_object"}, "x"],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "tool_choice": ["required", 5],
    "stream_options": [{"include_usage": True}, {"bogus": 1}],
    "ignore_eos": ["x"],
    "unknown_field": [1],
}
for field, values in CHAT_BAD.items():
    for i, v in enumerate(values):
        case(f"chat-{field}-{i}", CHAT, {"messages": MSGS, "max_tokens": 1, field: v})

COMP_BAD = {
    "prompt": [None, [], [[]], [1, "a"], "", [-1], [10 ** 9], {"x": 1}, [[1], ["a"]]],
    "max_tokens": [0, "x", 100_000],
    "logprobs": [6, -1, True],
    "echo": [True],
    "suffix": ["tail"],
    "best_of": [3, 0],
    "n": [0, 200],
    "temperature": [3],
}
for field, values in COMP_BAD.items():
    for i, v in enumerate(values):
        body = {"prompt": "Hi", "max_tokens": 1, field: v}
        case(f"completion-{field}-{i}", COMP, body)

for i, body in enumerate([{}, {"prompt": "x", "messages": MSGS}, {"prompt": 5}, {"messages": []},
                          {"prompt": "x", "add_special_tokens": "yes"}, {"prompt": "x", "extra": 1}]):
    case(f"tokenize-{i}", TOK, body)
for i, body in enumerate([{}, {"tokens": "x"}, {"tokens": [-1]}, {"tokens": [10 ** 12]}, {"tokens": [1.5]},
                          {"tokens": [[1]]}, {"tokens": [1], "model": "nope"}]):
    case(f"detokenize-{i}", DETOK, body)

# -- limits: sizes that could stall the server -------------------------------------------------------------
case("ten-stops", CHAT, {"messages": MSGS, "stop": [str(i) for i in range(10)]})
case("stop-1mb", CHAT, {"messages": MSGS, "stop": ["x" * 1_000_000]})
case("stop-300-chars", COMP, {"prompt": "Hi", "stop": "y" * 300})
case("prompt-over-chars", COMP, {"prompt": "a" * 300_000, "max_tokens": 1})
case("chat-over-chars", CHAT, {"messages": [{"role": "user", "content": "b " * 150_000}]})
case("tokenize-over-chars", TOK, {"prompt": "c" * 300_000})
case("n-times-prompts", COMP, {"prompt": ["hi"] * 1000, "n": 128, "max_tokens": 1})
case("prompts-500", COMP, {"prompt": ["hi"] * 500, "max_tokens": 1})
case("many-messages", CHAT, {"messages": [{"role": "user", "content": "x"}] * 20_000, "max_tokens": 1})
case("prompt-over-context", COMP, {"prompt": "hello " * 9000, "max_tokens": 1})
case("ids-over-context", COMP, {"prompt": [100] * 9000, "max_tokens": 1})
case("body-5mb", COMP, {"prompt": "z" * (5 * 1024 * 1024)})
case("huge-number", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e999}')
case("nan", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}')
case("infinity", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}')
case("duplicate-keys", COMP, b'{"prompt": "a", "prompt": "b", "max_tokens": 1}')
case("long-model-name", CHAT, {"model": "m" * 100_000, "messages": MSGS})

# -- structured output and tools: bad schemas, grammars, tools, tool_choice -----------------------------------
def _schema(schema: object, name: object = "x") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
STRUCTURED_BAD = {
    "schema-invalid-type": {"response_format": _schema({"type": "strin"})},
    "schema-lookbehind-pattern": {"response_format": _schema({"type": "string", "pattern": "(?<=a)b"})},
    "schema-not-an-object": {"response_format": _schema("x")},
    "schema-without-name": {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    "schema-name-too-long": {"response_format": _schema({}, "n" * 65)},
    "response-format-yaml": {"response_format": {"type": "yaml"}},
    "guided-json-not-json": {"guided_json": "{not json"},
    "grammar-unbalanced": {"guided_grammar": "root ::= ("},
    "grammar-empty": {"guided_grammar": "  "},
    "regex-unbalanced": {"guided_regex": "(["},
    "regex-lookahead": {"structured_outputs": {"regex": "a(?=b)"}},
    "choice-empty": {"guided_choice": []},
    "structured-two-keys": {"structured_outputs": {"regex": "a", "choice": ["b"]}},
    "structured-unknown-key": {"structured_outputs": {"yaml": "a"}},
    "structured-choice-not-list": {"structured_outputs": {"choice": "a"}},
    "two-constraints": {"response_format": {"type": "json_object"}, "guided_regex": "a"},
    "tool-without-name": {"tools": [{"type": "function", "function": {"parameters": {}}}]},
    "tool-empty-name": {"tools": [{"type": "function", "function": {"name": " "}}]},
    "tool-name-with-space": {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
    "tool-not-a-function": {"tools": [{"type": "web_search"}]},
    "tool-parameters-string": {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
    "tool-duplicate-names": {"tools": [FN, FN]},
    "tool-choice-unknown-function": {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}},
    "tool-choice-bad-shape": {"tools": [FN], "tool_choice": {"type": "function"}},
    "tool-choice-bad-string": {"tools": [FN], "tool_choice": "always"},
    "tool-choice-without-tools": {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    "tool-required-bad-schema": {"tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
    "tool-choice-with-response-format": {"tools": [FN], "tool_choice": "required",
                                         "response_format": {"type": "json_object"}},
    "tool-message-without-call-id": {"messages": [{"role": "tool", "content": "3"}]},
    "tool-calls-on-a-user-message": {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
    "tool-call-without-function": {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
    "template-kwargs-override-messages": {"chat_template_kwargs": {"messages": []}},
    "template-kwargs-not-object": {"chat_template_kwargs": "x"},
}
for name, extra in STRUCTURED_BAD.items():
    case(f"chat-{name}", CHAT, {"messages": MSGS, "max_tokens": 1, **extra})
case("completion-bad-schema", COMP, {"prompt": "Hi", "max_tokens": 1, "response_format": _schema({"type": 5})})
case("completion-bad-regex", COMP, {"prompt": "Hi", "max_tokens": 1, "guided_regex": "a{2,1}"})
case("completion-tools", COMP, {"prompt": "Hi", "max_tokens": 1, "tools": [FN]})

# -- the Responses API ---------------------------------------------------------------------------------------
for name, body in {
    "previous-response-id": {"input": "hi", "previous_response_id": "resp_1"},
    "no-input": {"instructions": "x"},
    "input-number": {"input": 5},
    "input-empty-list": {"input": []},
    "input-unknown-item": {"input": [{"type": "computer_call", "id": "x"}]},
    "input-bad-role": {"input": [{"role": "robot", "content": "x"}]},
    "input-image-part": {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    "input-call-without-id": {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    "output-without-call-id": {"input": [{"type": "function_call_output", "output": "x"}]},
    "tool-web-search": {"input": "hi", "tools": [{"type": "web_search"}]},
    "tool-without-name": {"input": "hi", "tools": [{"type": "function", "parameters": {}}]},
    "tool-choice-unknown": {"input": "hi", "tools": [{"type": "function", "name": "f"}],
                            "tool_choice": {"type": "function", "name": "g"}},
    "format-schema-without-name": {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
    "format-bad-schema": {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                             "schema": {"type": "strin"}}}},
    "format-not-object": {"input": "hi", "text": {"format": "json"}},
    "max-output-tokens-0": {"input": "hi", "max_output_tokens": 0},
    "temperature-3": {"input": "hi", "temperature": 3},
    "unknown-field": {"input": "hi", "frobnicate": 1},
    "metadata-not-strings": {"input": "hi", "metadata": {"a": 1}},
}.items():
    case(f"responses-{name}", RESP, body)

# -- routes, methods, headers --------------------------------------------------------------------------------
case("unknown-route", "/v1/nothing", {})
case("get-chat", CHAT, None, method="GET")
case("put-completions", COMP, {"prompt": "x"}, method="PUT")
case("delete-models", "/v1/models", None, method="DELETE")
case("unknown-model-card", "/v1/models/gpt-5", None, method="GET")
case("model-card-surrogate-path", "/v1/models/%ED%A0%80", None, method="GET")
case("evil-host", "/v1/models", None, method="GET", headers={"host": "evil.example:8000"})
case("evil-host-post", COMP, {"prompt": "x"}, headers={**JSON, "host": "attacker.test"})
case("bearer-without-key-set", "/v1/models", None, method="GET", headers={"authorization": "Bearer whatever"})

# -- fine requests at the edges: 200 ----------------------------------------------------------------------------
case("ok-charset", COMP, {"prompt": "Hi", "max_tokens": 1}, headers={"content-type": "application/json; charset=utf-8"})
case("ok-uppercase-type", COMP, {"prompt": "Hi", "max_tokens": 1}, headers={"content-type": "Application/JSON"})
case("ok-four-stops", CHAT, {"messages": MSGS, "max_tokens": 1, "stop": ["a", "b", "c", "d"]})
case("ok-n2-logprobs", CHAT, {"messages": MSGS, "max_tokens": 1, "n": 2, "logprobs": True, "top_logprobs": 2})
case("ok-ids", COMP, {"prompt": [1, 2, 3], "max_tokens": 1})
case("ok-stream", COMP, {"prompt": "Hi", "max_tokens": 1, "stream": True})
case("ok-json-object", CHAT, {"messages": MSGS, "max_tokens": 2, "response_format": {"type": "json_object"}})
case("ok-choice", COMP, {"prompt": "Hi", "max_tokens": 2, "structured_outputs": {"choice": ["a", "b"]}})
case("ok-tool-required", CHAT, {"messages": MSGS, "max_tokens": 2, "tools": [FN], "tool_choice": "required"})
case("ok-responses", RESP, {"input": "Hi", "max_output_tokens": 2})
case("ok-deep-but-allowed", TOK, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})


def test_the_catalogue_is_big_enough():
    assert len(CASES) >= 150, len(CASES)
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("method,path,body,headers", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_4xx_never_5xx(server, method, path, body, headers):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    with httpx.Client(timeout=60) as h:
        r = h.request(method, server + path, content=content, headers=headers)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        if r.status_code != 200:
            assert r.headers["content-type"].startswith("application/json"), r.headers
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["code"] in ERROR_CODES and ERROR_CODES[err["code"]] == r.status_code, err
            for leak in ("Traceback", "RecursionError", "UnicodeEncodeError", "File \""):
                assert leak not in err["message"], err
        assert h.get(server + "/health").status_code == 200, "the server must stay healthy"


REFUSED = [c for c in CASES if c[0].startswith(("responses-", "completion-bad-", "completion-tools"))
           or any(c[0] == f"chat-{name}" for name in STRUCTURED_BAD)]


@pytest.mark.parametrize("method,path,body,headers", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_bad_schemas_grammars_and_tools_are_refused_with_a_reason(server, method, path, body, headers):
    """Not just "not a 5xx": each of these is a 400 naming what is wrong."""
    r = httpx.request(method, server + path, content=json.dumps(body).encode(), headers=headers, timeout=60)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["code"] in ERROR_CODES, err

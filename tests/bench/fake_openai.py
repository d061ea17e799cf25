"""A tiny fake OpenAI-compatible streaming server for the bench tests (run in-process by conftest.py).

Two flavours on one server:
* ``BASE``          vLLM-like: sends ``usage`` in streams (with include_usage), honours ``ignore_eos``,
                    has ``/tokenize`` + ``/detokenize`` (vLLM request/response shapes).
* ``BASE/strict``   as ``BASE`` but answers 400 to a request with ``min_tokens`` (a strict server).
* ``BASE/nousage``  llama-cpp-python-like: no usage in streams, honours ``min_tokens`` (not
                    ``ignore_eos``), has ``/extras/tokenize`` + ``/extras/detokenize``.

Tokens are whitespace-separated words. A chat prompt counts its words + 3 per message + 1; a raw
prompt its words + 1. Generation: the role chunk at once (chat), the first content chunk after
``TTFT_S``, then one content chunk (one token, "w<i> ") every ``ITL_S``, except that every chunk of
the vLLM flavour after the first carries two tokens when the prompt contains "PAIRS". Without a
fixed length a request stops after ``NATURAL_TOKENS`` tokens (finish "stop"). A last user message
containing "FAIL" gets HTTP 500; "MIDFAIL" gets an error event after two chunks.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TTFT_S = 0.040
ITL_S = 0.010
NATURAL_TOKENS = 5


def make_app() -> FastAPI:
    app = FastAPI()
    vocab: dict[str, int] = {}
    inv: dict[int, str] = {}
    app.state.requests = []

    def tokenize(text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in vocab:
                vocab[w] = len(vocab) + 1
                inv[vocab[w]] = w
            ids.append(vocab[w])
        return ids

    def prompt_tokens(body: dict) -> int:
        if "messages" in body:
            return sum(len(m["content"].split()) + 3 for m in body["messages"]) + 1
        return len(body["prompt"].split()) + 1

    def last_text(body: dict) -> str:
        return body["messages"][-1]["content"] if "messages" in body else body["prompt"]

    async def completions(request: Request, usage_mode: bool, chat: bool, strict: bool = False):
        body = await request.json()
        app.state.requests.append(body)
        if strict and "min_tokens" in body:
            return JSONResponse({"error": {"message": "unknown field min_tokens"}}, status_code=400)
        text = last_text(body)
        if "FAIL" in text and "MIDFAIL" not in text:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        max_tokens = int(body.get("max_tokens") or 16)
        fixed = body.get("ignore_eos") if usage_mode else int(body.get("min_tokens") or 0) >= max_tokens
        n = max_tokens if fixed else min(max_tokens, NATURAL_TOKENS)
        finish = "length" if n == max_tokens else "stop"
        pt = prompt_tokens(body)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(content: str | None, fin: str | None = None) -> str:
            if chat:
                delta = {} if content is None else {"content": content}
                ch = {"index": 0, "delta": delta, "finish_reason": fin}
            else:
                ch = {"index": 0, "text": content or "", "finish_reason": fin}
            return "data: " + json.dumps({"id": "x", "object": obj, "choices": [ch]}) + "\n\n"

        if not body.get("stream"):
            words = " ".join(f"w{i}" for i in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": words}, "finish_reason": finish}
                      if chat else {"index": 0, "text": words, "finish_reason": finish})
            return JSONResponse({"id": "x", "object": "chat.completion" if chat else "text_completion",
                                 "choices": [choice],
                                 "usage": {"prompt_tokens": pt, "completion_tokens": n, "total_tokens": pt + n}})

        pairs = usage_mode and "PAIRS" in text

        async def gen():
            if chat:
                yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [
                    {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}) + "\n\n"
            await asyncio.sleep(TTFT_S)
            i = 0
            while i < n:
                k = 2 if (pairs and i > 0 and i + 1 < n) else 1
                if i > 0:
                    await asyncio.sleep(ITL_S)
                yield chunk("".join(f"w{j} " for j in range(i, i + k)))
                i += k
                if "MIDFAIL" in text and i >= 2:
                    yield "data: " + json.dumps({"error": {"message": "injected mid-stream failure"}}) + "\n\n"
                    return
            yield chunk(None, finish)
            if usage_mode and (body.get("stream_options") or {}).get("include_usage"):
                yield "data: " + json.dumps({"id": "x", "object": obj, "choices": [],
                                             "usage": {"prompt_tokens": pt, "completion_tokens": n,
                                                       "total_tokens": pt + n}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    for prefix, usage_mode in (("", True), ("/nousage", False), ("/strict", True)):
        def bind(usage_mode=usage_mode, strict=prefix == "/strict"):
            async def chat_ep(request: Request):
                return await completions(request, usage_mode, True, strict)

            async def comp_ep(request: Request):
                return await completions(request, usage_mode, False, strict)

            return chat_ep, comp_ep

        chat_ep, comp_ep = bind()
        app.add_api_route(prefix + "/v1/chat/completions", chat_ep, methods=["POST"])
        app.add_api_route(prefix + "/v1/completions", comp_ep, methods=["POST"])

        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        app.add_api_route(prefix + "/v1/models", models, methods=["GET"])

    async def vllm_tokenize(request: Request):
        body = await request.json()
        ids = tokenize(body["prompt"])
        return {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    async def vllm_detokenize(request: Request):
        body = await request.json()
        return {"prompt": " ".join(inv[i] for i in body["tokens"])}

    async def extras_tokenize(request: Request):
        body = await request.json()
        return {"tokens": tokenize(body["input"])}

    async def extras_detokenize(request: Request):
        body = await request.json()
        return {"text": " ".join(inv[i] for i in body["tokens"])}

    app.add_api_route("/tokenize", vllm_tokenize, methods=["POST"])
    app.add_api_route("/detokenize", vllm_detokenize, methods=["POST"])
    app.add_api_route("/nousage/extras/tokenize", extras_tokenize, methods=["POST"])
    app.add_api_route("/nousage/extras/detokenize", extras_detokenize, methods=["POST"])
    return app

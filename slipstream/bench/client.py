"""One asyncio + httpx client: streaming requests to an OpenAI-compatible endpoint, timed per chunk.

Every request is a streaming POST (``stream: true``, ``stream_options.include_usage: true``). The
response body is read with ``aiter_bytes`` (no compression is asked for) and split into server-sent events by :class:`SSEDecoder`
(our own parser; no SSE library); the arrival time of each network read is taken with
``time.perf_counter()`` and given to every event completed by that read. Token counts come from the
``usage`` object of the stream; servers that send none (llama-cpp-python's server) are filled in
after the timed run (see :func:`fill_token_counts`), never by counting chunks unless nothing else is
possible (then the source says ``"chunks"``).

Failures (connection errors, HTTP errors, an ``error`` object in the stream, a stream without any
content) become a :class:`RequestResult` with ``ok=False`` and the reason; they never raise.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import httpx

from slipstream.bench.metrics import RequestResult


# --------------------------------------------------------------------------- SSE


@dataclass
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


class SSEDecoder:
    """Incremental server-sent-events parser (the WHATWG rules that matter for LLM streams).

    ``feed(bytes)`` returns the events completed by those bytes. Lines end with CRLF, LF or CR (a CR
    at the end of a read is held back in case an LF follows); a line ``field: value`` sets a field
    (one leading space of the value is dropped); lines starting with ``:`` are comments; several
    ``data`` lines join with ``\\n``; a blank line dispatches the event (an event without data
    lines is dropped). UTF-8 split across reads is decoded correctly. ``close()`` dispatches a last
    event that was not terminated by a blank line.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None

    def feed(self, chunk: bytes | str) -> list[SSEEvent]:
        text = chunk if isinstance(chunk, str) else self._utf8.decode(chunk)
        self._buf += text
        events: list[SSEEvent] = []
        while True:
            i = _line_end(self._buf)
            if i < 0:
                break
            line = self._buf[:i]
            if self._buf[i] == "\r":
                if i + 1 == len(self._buf):   # a lone CR at the end: maybe half of a CRLF; wait
                    break
                step = 2 if self._buf[i + 1] == "\n" else 1
            else:
                step = 1
            self._buf = self._buf[i + step:]
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        return events

    def close(self) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        tail = self._utf8.decode(b"", final=True)
        self._buf += tail
        if self._buf:
            for line in self._buf.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
                ev = self._line(line)
                if ev is not None:
                    events.append(ev)
            self._buf = ""
        ev = self._line("")
        if ev is not None:
            events.append(ev)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            if not self._data:
                self._event = ""
                return None
            ev = SSEEvent("\n".join(self._data), self._event or "message", self._id)
            self._data, self._event = [], ""
            return ev
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        return None


def _line_end(s: str) -> int:
    a, b = s.find("\n"), s.find("\r")
    if a < 0:
        return b
    if b < 0:
        return a
    return min(a, b)


# --------------------------------------------------------------------------- target


@dataclass
class Target:
    """An OpenAI-compatible endpoint to measure."""

    base_url: str                     # scheme://host:port[/prefix]; a trailing /v1 is accepted
    model: str | None = None
    api_key: str | None = None
    endpoint: str = "chat"            # "chat" -> /v1/chat/completions, "completions" -> /v1/completions
    label: str = "target"
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        url = self.base_url.rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        self.base_url = url
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url + ("/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions")

    def headers(self) -> dict[str, str]:
        h = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass
class Prompt:
    """One request of a workload: chat messages (or a raw prompt for the completions endpoint)."""

    messages: list[dict[str, str]]
    max_tokens: int
    fixed_length: bool = False        # ask the server to ignore EOS and produce max_tokens tokens
    expected_prompt_tokens: int | None = None   # known when the workload built it to a token length

    def prompt_text(self) -> str:
        """The text sent to /v1/completions: the messages' contents, one after another."""
        return "\n\n".join(m["content"] for m in self.messages)


def make_client(timeout_s: float = 600.0) -> httpx.AsyncClient:
    # no proxies from the environment (benchmarks talk to loopback servers), no connection cap
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))


def build_payload(target: Target, p: Prompt, *, temperature: float, stream: bool = True,
                  fixed_fields: Sequence[str] = ("ignore_eos", "min_tokens")) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": p.max_tokens, "temperature": temperature}
    if target.model:
        body["model"] = target.model
    if target.endpoint == "chat":
        body["messages"] = p.messages
    else:
        body["prompt"] = p.prompt_text()
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if p.fixed_length:
        if "ignore_eos" in fixed_fields:
            body["ignore_eos"] = True     # vLLM, SGLang, Slipstream
        if "min_tokens" in fixed_fields:
            body["min_tokens"] = p.max_tokens   # vLLM, llama-cpp-python
    body.update(target.extra_body)
    return body


def _content_of(obj: dict[str, Any], endpoint: str) -> str:
    text = ""
    for ch in obj.get("choices") or []:
        if endpoint == "chat":
            delta = ch.get("delta") or {}
            for key in ("content", "reasoning_content", "reasoning"):
                v = delta.get(key)
                if isinstance(v, str):
                    text += v
        else:
            v = ch.get("text")
            if isinstance(v, str):
                text += v
    return text


def _finish_of(obj: dict[str, Any]) -> str | None:
    for ch in obj.get("choices") or []:
        if ch.get("finish_reason"):
            return ch["finish_reason"]
    return None


async def send_request(client: httpx.AsyncClient, target: Target, p: Prompt, *, temperature: float = 0.0,
                       fixed_fields: Sequence[str] = ("ignore_eos", "min_tokens"), index: int = 0,
                       clock: Callable[[], float] = time.perf_counter) -> RequestResult:
    """Send one streaming request and time its content chunks; never raises for request failures."""
    body = build_payload(target, p, temperature=temperature, fixed_fields=fixed_fields)
    r = RequestResult(ok=False, send=clock(), max_tokens=p.max_tokens, index=index)
    dec = SSEDecoder()
    done = False
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers()) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                r.error = f"HTTP {resp.status_code}: {_error_message(raw)}"
                r.end = clock()
                return r
            async for raw in resp.aiter_bytes():
                now = clock()
                for ev in dec.feed(raw):
                    done = _handle_event(r, ev, now, target.endpoint) or done
                if r.error or done:      # nothing is expected after [DONE]
                    break
            if not done and not r.error:
                now = clock()
                for ev in dec.close():
                    done = _handle_event(r, ev, now, target.endpoint) or done
    except (httpx.HTTPError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    r.end = clock()
    if r.error is None and not r.chunk_times:
        r.error = "stream ended without content" + ("" if done else " (no [DONE])")
    r.ok = r.error is None
    return r


def _handle_event(r: RequestResult, ev: SSEEvent, now: float, endpoint: str) -> bool:
    """Apply one SSE event to the result; True for the final [DONE]."""
    data = ev.data.strip()
    if data == "[DONE]":
        return True
    if ev.event == "error":
        r.error = f"stream error: {data[:300]}"
        return False
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        r.error = f"bad JSON in stream: {data[:120]!r}"
        return False
    if not isinstance(obj, dict):
        return False
    if obj.get("error"):
        err = obj["error"]
        r.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
        return False
    text = _content_of(obj, endpoint)
    if text:
        r.chunk_times.append(now)
        r.text += text
    fin = _finish_of(obj)
    if fin:
        r.finish_reason = fin
    usage = obj.get("usage")
    if isinstance(usage, dict):
        if usage.get("completion_tokens") is not None:
            r.output_tokens = int(usage["completion_tokens"])
            r.output_tokens_source = "usage"
        if usage.get("prompt_tokens") is not None:
            r.prompt_tokens = int(usage["prompt_tokens"])
            r.prompt_tokens_source = "usage"
    if isinstance(obj.get("timings"), dict):
        r.server_timings = obj["timings"]
    return False


def _error_message(raw: str) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj.get("detail", obj)) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300]
    except (json.JSONDecodeError, AttributeError):
        return raw.strip()[:300]


# --------------------------------------------------------------------------- helpers over HTTP


async def discover_model(client: httpx.AsyncClient, target: Target) -> str | None:
    """The first model id of GET /v1/models, or None."""
    try:
        resp = await client.get(target.base_url + "/v1/models", headers=target.headers())
        if resp.status_code == 200:
            data = resp.json().get("data") or []
            if data:
                return str(data[0].get("id"))
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return None


async def complete_once(client: httpx.AsyncClient, target: Target, p: Prompt, *, temperature: float = 0.0,
                        fixed_fields: Sequence[str] = ()) -> tuple[int, dict[str, Any] | str]:
    """A non-streaming request: (status, JSON body or error text)."""
    body = build_payload(target, p, temperature=temperature, stream=False, fixed_fields=fixed_fields)
    try:
        resp = await client.post(target.url, json=body, headers={**target.headers(), "Accept": "application/json"})
    except (httpx.HTTPError, OSError) as e:
        return 0, f"{type(e).__name__}: {e}"
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, resp.text


class HttpTokenizer:
    """The server's own tokenizer over HTTP, where it has one. Tried in order:
    vLLM/SGLang ``POST /tokenize {"model", "prompt"}`` + ``/detokenize {"model", "tokens"}``;
    llama.cpp's native server ``POST /tokenize {"content"}`` + ``/detokenize {"tokens"}``;
    llama-cpp-python ``POST /extras/tokenize {"input"}`` + ``/extras/detokenize {"tokens"}``.
    Tokenization is raw text (no chat template, no BOS where the server lets us say so)."""

    def __init__(self, client: httpx.AsyncClient, target: Target) -> None:
        self.client, self.target = client, target
        self.kind: str | None = None

    _KINDS = {
        "vllm": ("/tokenize", lambda m, t: {"model": m, "prompt": t, "add_special_tokens": False},
                 "/detokenize", lambda m, ids: {"model": m, "tokens": ids}, ("prompt", "text")),
        "llama.cpp": ("/tokenize", lambda m, t: {"content": t, "add_special": False},
                      "/detokenize", lambda m, ids: {"tokens": ids}, ("content",)),
        "llama-cpp-python": ("/extras/tokenize", lambda m, t: {"input": t, "model": m},
                             "/extras/detokenize", lambda m, ids: {"tokens": ids, "model": m}, ("text",)),
    }

    async def probe(self) -> str | None:
        for kind in self._KINDS:
            self.kind = kind
            ids = await self.tokenize("Hello world")
            if ids:
                back = await self.detokenize(ids)
                if back is not None and "Hello" in back:
                    return kind
        self.kind = None
        return None

    async def tokenize(self, text: str) -> list[int] | None:
        if self.kind is None:
            return None
        path, make, *_ = self._KINDS[self.kind]
        try:
            resp = await self.client.post(self.target.base_url + path, json=make(self.target.model, text),
                                          headers=self.target.headers())
            if resp.status_code != 200:
                return None
            obj = resp.json()
            toks = obj.get("tokens") if isinstance(obj, dict) else None
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return toks
        except (httpx.HTTPError, ValueError):
            pass
        return None

    async def detokenize(self, ids: list[int]) -> str | None:
        if self.kind is None:
            return None
        _, _, path, make, keys = self._KINDS[self.kind]
        try:
            resp = await self.client.post(self.target.base_url + path, json=make(self.target.model, ids),
                                          headers=self.target.headers())
            if resp.status_code != 200:
                return None
            obj = resp.json()
            for k in keys:
                if isinstance(obj, dict) and isinstance(obj.get(k), str):
                    return obj[k]
        except (httpx.HTTPError, ValueError):
            pass
        return None


# --------------------------------------------------------------------------- running many requests


Progress = Callable[[RequestResult], None]


async def run_closed_loop(send: Callable[[int], Awaitable[RequestResult]], n: int, concurrency: int,
                          on_done: Progress | None = None,
                          clock: Callable[[], float] = time.perf_counter) -> tuple[list[RequestResult], float]:
    """`concurrency` workers, each sending the next of `n` requests as soon as its previous one is
    done (closed loop). Returns the results in workload order and the wall time (s)."""
    results: list[RequestResult | None] = [None] * n
    next_i = 0

    async def worker() -> None:
        nonlocal next_i
        while next_i < n:
            i = next_i
            next_i += 1
            res = await send(i)
            results[i] = res
            if on_done:
                on_done(res)

    t0 = clock()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, n)))))
    return [r for r in results if r is not None], clock() - t0


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of `n` Poisson arrivals at `rate` req/s (all 0 for inf)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_poisson(send: Callable[[int], Awaitable[RequestResult]], n: int, rate: float, seed: int,
                      on_done: Progress | None = None,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[list[RequestResult], float]:
    """Open loop: request i is sent at its Poisson arrival time whatever is still running."""
    offsets = poisson_offsets(n, rate, seed)
    t0 = clock()

    async def one(i: int) -> RequestResult:
        delay = t0 + offsets[i] - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        res = await send(i)
        if on_done:
            on_done(res)
        return res

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return list(results), clock() - t0


# --------------------------------------------------------------------------- token counts after the run


async def fill_token_counts(client: httpx.AsyncClient, target: Target, results: Sequence[RequestResult],
                            prompts: Sequence[Prompt], tokenizer: HttpTokenizer | None,
                            prompt_cache: dict[str, int] | None = None, probe_prompts: bool = True) -> list[str]:
    """Fill the token counts a server's stream did not report (after the timed run, so the extra
    requests never overlap it). Output tokens: ``finish_reason == "length"`` means exactly
    ``max_tokens`` ("max_tokens"); else the server's tokenizer on the text ("retokenized"); else the
    number of content chunks ("chunks", a last resort, reported as a warning). Prompt tokens: the
    workload's own count when it built the prompt to a length ("workload"); else one non-streaming
    ``max_tokens=1`` request per distinct prompt, read from its ``usage`` ("probe"). Returns
    warnings."""
    warnings: list[str] = []
    n_chunks = 0
    cache = prompt_cache if prompt_cache is not None else {}
    for r in results:
        if not r.ok:
            continue
        p = prompts[r.index]
        if r.output_tokens is None:
            if r.finish_reason == "length" and r.max_tokens:
                r.output_tokens, r.output_tokens_source = r.max_tokens, "max_tokens"
            else:
                ids = await tokenizer.tokenize(r.text) if tokenizer and tokenizer.kind else None
                if ids is not None:
                    r.output_tokens, r.output_tokens_source = len(ids), "retokenized"
                else:
                    r.output_tokens, r.output_tokens_source = len(r.chunk_times), "chunks"
                    n_chunks += 1
        if r.prompt_tokens is None:
            if p.expected_prompt_tokens is not None:
                r.prompt_tokens, r.prompt_tokens_source = p.expected_prompt_tokens, "workload"
            elif probe_prompts:
                key = json.dumps([target.endpoint, p.messages], sort_keys=True)
                if key not in cache:
                    probe = Prompt(p.messages, max_tokens=1)
                    status, body = await complete_once(client, target, probe)
                    usage = body.get("usage") if isinstance(body, dict) else None
                    if status == 200 and isinstance(usage, dict) and usage.get("prompt_tokens") is not None:
                        cache[key] = int(usage["prompt_tokens"])
                if key in cache:
                    r.prompt_tokens, r.prompt_tokens_source = cache[key], "probe"
    if n_chunks:
        warnings.append(f"{target.label}: {n_chunks} request(s) had no usage and no tokenizer endpoint; "
                        "their output tokens are the number of content chunks")
    return warnings

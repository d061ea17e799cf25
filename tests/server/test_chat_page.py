"""The chat page at `/`, driven as a person uses it: Debian's Chromium (Playwright, the system browser,
no download) against a real `slipstream serve` of the default model on 127.0.0.1. It types a message,
waits for the streamed answer, reads the TTFT and tok/s readout, stops a long answer (and checks the
server has nothing left running and every KV block back), keeps conversations across a reload, asks
for the API key on a server that has one, and renders hostile markdown safely; a screenshot goes to
the test's temporary folder (its path is printed).

How the page is served (content types, headers, no key needed, the Host check, every file it loads
present) is checked over HTTP on a model-less server, so it runs even where no browser can.
Where Playwright or Chromium is missing, the browser tests are skipped with that reason.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from server_support import metrics

from slipstream.server.config import ServerConfig

pytest.importorskip("fastapi")

CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome")
STREAM_TIMEOUT_MS = 90_000


def find_chromium() -> str | None:
    """The browser to drive: $SLIPSTREAM_CHROMIUM, else Debian's chromium (the binary behind its launcher script)."""
    explicit = os.environ.get("SLIPSTREAM_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).exists() or shutil.which(explicit) else None
    for name in CHROMIUM_CANDIDATES:
        path = name if Path(name).is_absolute() and os.access(name, os.X_OK) else shutil.which(name)
        if path:
            return path
    return None


# -- the page over HTTP (no browser, no model) ------------------------------------------------------

@pytest.fixture(scope="module")
def keyed_fake_server() -> Iterator:
    from fake_engine import FakeEngine
    from server_support import ThreadedServer

    with ThreadedServer(ServerConfig(api_key="page-test-key"), engine=FakeEngine(step_s=0.0005)) as srv:
        yield srv


def _page_files(base: str) -> dict[str, httpx.Response]:
    """`/` and every file it loads, found by following the HTML's src/href and the modules' imports."""
    seen: dict[str, httpx.Response] = {}
    todo = ["/"]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        r = httpx.get(base + path, timeout=30)
        seen[path] = r
        if r.status_code != 200:
            continue
        refs = re.findall(r'(?:src|href)="(/static/[^"]+)"', r.text)
        refs += ["/static/" + m for m in re.findall(r'from "\./([\w.-]+\.js)"', r.text)]
        todo += [ref for ref in refs if ref not in seen]
    return seen


def test_page_and_its_files_are_served_without_the_key(keyed_fake_server):
    base = keyed_fake_server.base_url
    files = _page_files(base)
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    assert {"/", "/static/chat.js", "/static/chat.css", "/static/markdown.js", "/static/api.js",
            "/static/store.js", "/static/icon.svg"} <= set(files), sorted(files)
    for path, r in files.items():
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
        want = "text/html" if path == "/" else types[Path(path).suffix]
        assert r.headers["content-type"].startswith(want), (path, r.headers["content-type"])
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["x-content-type-options"] == "nosniff"
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert "connect-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["etag"].startswith('"')
    # the page needs no key; the API it calls does
    assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
    ok = httpx.get(base + "/v1/models", headers={"authorization": "Bearer page-test-key"}, timeout=30)
    assert ok.status_code == 200


def test_page_revalidates_and_answers_head(keyed_fake_server):
    base = keyed_fake_server.base_url
    first = httpx.get(base + "/static/chat.js", timeout=30)
    again = httpx.get(base + "/static/chat.js", headers={"if-none-match": first.headers["etag"]}, timeout=30)
    assert again.status_code == 304 and again.content == b""
    other = httpx.get(base + "/static/chat.js", headers={"if-none-match": '"stale"'}, timeout=30)
    assert other.status_code == 200 and other.content == first.content
    head = httpx.head(base + "/", timeout=30)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(httpx.get(base + "/", timeout=30).content)


@pytest.mark.parametrize("method,path,headers,status,code", [
    ("GET", "/static/nothing.js", {}, 404, "not_found"),
    ("GET", "/static/%2e%2e/app.py", {}, 404, "not_found"),   # ".." (clients normalize a bare one)
    ("GET", "/app.py", {}, 401, "invalid_api_key"),             # outside the page: the API's rules
    ("GET", "/static/", {}, 404, "not_found"),
    ("DELETE", "/", {}, 405, "method_not_allowed"),
    ("POST", "/", {"content-type": "application/json"}, 405, "method_not_allowed"),
    ("POST", "/", {"content-type": "text/plain"}, 415, "unsupported_media_type"),
    ("GET", "/", {"host": "evil.example"}, 400, "host_not_allowed"),
    ("GET", "/static/chat.js", {"host": "attacker.test:80"}, 400, "host_not_allowed"),
])
def test_page_errors_are_openai_shaped(keyed_fake_server, method, path, headers, status, code):
    r = httpx.request(method, keyed_fake_server.base_url + path, headers=headers, content=b"{}", timeout=30)
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == code


# -- the page in a browser ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install -e '.[test]'): no browser test")
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium found (Debian: apt-get install chromium, which `make test-tools` does as root; "
                    "or set SLIPSTREAM_CHROMIUM): the chat page's browser test cannot run")
    pw = sync_api.sync_playwright().start()
    try:
        try:
            b = pw.chromium.launch(executable_path=executable, headless=True)
        except Exception as e:   # a browser that is there but cannot start here (sandbox, libraries)
            pytest.skip(f"Chromium at {executable} would not start under Playwright: {str(e)[:300]}")
        yield b
        b.close()
    finally:
        pw.stop()


@pytest.fixture
def page(browser, request) -> Iterator:
    """A fresh browser context (empty localStorage) and page; console errors fail the test."""
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    pg = context.new_page()
    problems: list[str] = []
    pg.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    pg.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    pg.set_default_timeout(STREAM_TIMEOUT_MS)
    yield pg
    context.close()
    # a 401 the page is expected to meet shows up as a failed resource in the console
    problems = [p for p in problems if "401" not in p]
    assert not problems, problems


def _settings(pg, **values) -> None:
    for name, value in values.items():
        pg.fill(f"#{name}", str(value))
        pg.dispatch_event(f"#{name}", "change")


def _last_answer(pg) -> dict:
    """The last assistant message as the page stored it (raw text and stats), from localStorage."""
    return pg.evaluate("""() => {
        const list = JSON.parse(localStorage.getItem('slipstream.chat.conversations.v1'));
        const id = JSON.parse(localStorage.getItem('slipstream.chat.current.v1'));
        const c = list.find((x) => x.id === id);
        return c.messages[c.messages.length - 1];
    }""")


def _wait_idle(pg) -> None:
    pg.wait_for_selector("#send:not([hidden])", state="visible")
    pg.wait_for_selector("#stop", state="hidden")


def _model_id(base: str, key: str | None = None) -> str:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


def test_chat_streams_an_answer_with_its_speed(page, server, tmp_path, capsys):
    import openai

    model = _model_id(server)
    page.goto(server + "/")
    page.wait_for_function("(m) => document.getElementById('model').textContent === m", arg=model)
    assert page.is_hidden("#key-dialog"), "no key is asked for on an open server"
    _settings(page, temperature=0, max_tokens=24, system="You are a terse assistant.")
    page.click("#prompt")
    page.keyboard.type("Name three colours.")
    page.keyboard.press("Shift+Enter")          # a new line, not a send
    page.keyboard.type("One line each.")
    assert page.input_value("#prompt") == "Name three colours.\nOne line each."
    assert page.locator(".msg").count() == 0
    page.keyboard.press("Enter")
    page.wait_for_selector(".msg.assistant")
    _wait_idle(page)

    answer = _last_answer(page)
    # the streamed text, assembled by the page, is the server's own greedy answer to the same request
    # (the session server runs --exact: its greedy tokens do not depend on the prefix cache the repeat hits)
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as client:
        ref = client.chat.completions.create(model=model, max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours.\nOne line each."}])
    assert answer["content"] == ref.choices[0].message.content
    assert answer["content"].strip()
    # the readout: TTFT, a positive tok/s, the token count from the stream's usage
    stats = page.locator(".msg.assistant .stats")
    readout = stats.inner_text()
    tok_s = float(re.search(r"([\d.]+) tok/s", readout).group(1))
    assert tok_s > 0, readout
    assert float(stats.get_attribute("data-tok-s")) > 0
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert int(stats.get_attribute("data-tokens")) == ref.usage.completion_tokens, readout
    assert re.search(r"TTFT \d+ ms", readout) and f"{ref.usage.completion_tokens} tokens" in readout, readout
    assert page.inner_text(".msg.user .body") == "Name three colours.\nOne line each."

    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    with capsys.disabled():
        print(f"\nchat page screenshot: {shot}")

    # the conversation outlives a reload; a new chat and a delete work on the kept list
    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.locator("#conversations li").count() == 1
    assert page.inner_text("#conversations li .open").startswith("Name three colours.")
    assert page.input_value("#temperature") == "0", "the settings are kept too"
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0 and page.locator("#conversations li").count() == 2
    page.locator("#conversations li .delete").last.click()
    assert page.locator("#conversations li").count() == 1


def test_stop_ends_a_long_answer_and_frees_the_server(page, server, tmp_path, capsys):
    page.goto(server + "/")
    page.wait_for_function("() => document.getElementById('model').textContent !== 'connecting…'")
    _settings(page, temperature=0, max_tokens=2000)
    page.fill("#prompt", "Write a very long story about a dragon.")
    page.click("#send")
    page.wait_for_selector("#stop", state="visible")
    # the answer grows, and the server has it running
    page.wait_for_function("() => Number(document.querySelector('.msg.assistant .stats')?.dataset.tokens) >= 30")
    t0 = time.monotonic()
    while metrics(server).get("slipstream_num_requests_running", 0) < 1:
        assert time.monotonic() - t0 < 30, "the server shows no running request while the page streams"
        time.sleep(0.1)
    page.click("#stop")
    _wait_idle(page)
    stopped = _last_answer(page)
    assert stopped["stats"]["finish"] == "abort", stopped["stats"]
    assert "stopped" in page.inner_text(".msg.assistant .stats")
    n_chars = len(stopped["content"])
    assert 0 < n_chars
    time.sleep(1.0)
    assert len(_last_answer(page)["content"]) == n_chars, "the answer kept growing after stop"
    assert len(page.inner_text(".msg.assistant .body")) <= n_chars + 10
    # the server let go of it: nothing running or waiting, every KV block free again
    t0 = time.monotonic()
    while True:
        m = metrics(server)
        left = {k: m.get(f"slipstream_{k}", 0) for k in ("num_requests_running", "num_requests_waiting",
                                                         "kv_blocks_in_use")}
        if not any(left.values()):
            break
        assert time.monotonic() - t0 < 15, f"the stopped request is still on the server: {left}"
        time.sleep(0.2)
    assert stopped["stats"]["tokens"] < 2000
    shot = tmp_path / "chat-page-stopped.png"
    page.screenshot(path=str(shot))
    with capsys.disabled():
        print(f"\nchat page screenshot (stopped answer): {shot}")


def test_api_key_is_asked_for_and_kept(browser, keyed_fake_server, tmp_path, capsys):
    """On a server with a key (the real app and HTTP stack over the scripted engine: no second model
    to load) the page asks for the key, says when it is wrong, keeps the right one and uses it."""
    srv = keyed_fake_server
    context = browser.new_context(viewport={"width": 390, "height": 780})   # a phone's width
    try:
        page = context.new_page()
        page.set_default_timeout(STREAM_TIMEOUT_MS)
        page.goto(srv.base_url + "/")
        page.wait_for_selector("#key-dialog[open]")
        assert "needs an API key" in page.inner_text("#key-reason")
        page.fill("#key-input", "wrong")
        page.keyboard.press("Enter")
        page.wait_for_function("() => document.getElementById('key-reason').textContent.includes('did not accept')")
        assert page.is_visible("#key-dialog")
        page.fill("#key-input", "page-test-key")
        page.click("#key-save")
        model = _model_id(srv.base_url, "page-test-key")
        page.wait_for_function("(m) => document.getElementById('model').textContent === m", arg=model)
        assert page.is_hidden("#key-dialog")
        assert page.evaluate("localStorage.getItem('slipstream.chat.apiKey')") == "page-test-key"
        # at this width the settings are a drawer behind the gear button
        assert page.is_hidden("#max_tokens")
        page.click("#toggle-settings")
        _settings(page, max_tokens=8)
        page.click("#toggle-settings")
        assert page.is_hidden("#settings")
        page.fill("#prompt", "Hi!")
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.assistant")
        _wait_idle(page)
        assert _last_answer(page)["content"].strip()
        assert not _last_answer(page).get("error")
        shot = tmp_path / "chat-page-phone.png"
        page.screenshot(path=str(shot))
        with capsys.disabled():
            print(f"\nchat page screenshot (phone width, keyed server): {shot}")
        # a reload uses the kept key: no prompt
        page.reload()
        page.wait_for_function("(m) => document.getElementById('model').textContent === m", arg=model)
        assert page.is_hidden("#key-dialog")
        # forgotten, it is asked for again
        page.click("#toggle-settings")
        page.click("#forget-key")
        assert page.evaluate("localStorage.getItem('slipstream.chat.apiKey')") is None
        page.reload()
        page.wait_for_selector("#key-dialog[open]")
    finally:
        context.close()


HOSTILE = [
    "<script>window.__pwned = 1</script>",
    "<img src=x onerror=\"window.__pwned = 1\">",
    "[click](javascript:window.__pwned=1) [data](data:text/html,<b>x</b>) [vb](vbscript:x)",
    "[x](https://e.com\" onmouseover=\"window.__pwned=1)",
    "`<b>code</b>` and **<i>bold</i>**",
    "```html\n<script>window.__pwned = 1</script>\n```",
    "```\nunclosed fence <svg onload=window.__pwned=1>",
    "> <iframe src=javascript:1></iframe>",
    "# <a href=javascript:1>h</a>\n- <style>body{display:none}</style>\n1. ok",
    "\u0000\u00000\u0000 https://ok.example/a?b=1&c=\"><script>x</script>",
]


def test_markdown_renders_and_never_runs_what_it_is_given(page, server):
    page.goto(server + "/")
    result = page.evaluate("""async (cases) => {
        const { renderMarkdown } = await import('/static/markdown.js');
        const out = [];
        for (const text of cases) {
            const div = document.createElement('div');
            div.innerHTML = renderMarkdown(text);
            document.body.append(div);
            const tags = [...div.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
            const attrs = [...div.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name));
            const hrefs = [...div.querySelectorAll('a')].map((a) => a.href);
            out.push({ tags, attrs, hrefs, text: div.textContent });
            div.remove();
        }
        const sample = renderMarkdown('# Title\\nSome **bold**, *it* and `code`.\\n\\n- a\\n- b\\n\\n' +
                                      '1. one\\n2. two\\n\\n```py\\nx = 1 < 2\\n```\\n[link](https://example.com)');
        await new Promise((r) => setTimeout(r, 200));
        return { out, sample, pwned: window.__pwned === 1 };
    }""", HOSTILE)
    assert not result["pwned"]
    allowed = {"p", "br", "code", "pre", "strong", "em", "del", "a", "ul", "ol", "li", "blockquote", "hr",
               "h1", "h2", "h3", "h4", "h5", "h6"}
    for case, r in zip(HOSTILE, result["out"]):
        assert set(r["tags"]) <= allowed, (case, r)
        assert set(r["attrs"]) <= {"href", "target", "rel", "class", "data-lang", "start"}, (case, r)
        assert all(h.startswith(("http://", "https://", "mailto:")) for h in r["hrefs"]), (case, r)
    assert "<script>" in result["out"][0]["text"], "escaped markup is shown as text"
    sample = result["sample"]
    for piece in ("<h1>Title</h1>", "<strong>bold</strong>", "<em>it</em>", "<code>code</code>",
                  "<ul><li>a</li><li>b</li></ul>", "<ol><li>one</li><li>two</li></ol>",
                  '<pre><code class="language-py" data-lang="py">x = 1 &lt; 2</code></pre>',
                  '<a href="https://example.com" target="_blank" rel="noopener noreferrer">link</a>'):
        assert piece in sample, (piece, sample)


def test_reasoning_content_shows_as_a_thinking_block(page, server):
    """The page folds `reasoning_content` deltas into a collapsible block, and a code block in the
    answer gets a working copy button (the stream is scripted here, so this runs whatever the
    served model does)."""
    model = _model_id(server)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model}

    def chunk(delta: dict, finish: str | None = None) -> str:
        body = dict(head, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
        return f"data: {json.dumps(body)}\n\n"

    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    sse = "".join([chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Let me "}),
                   chunk({"reasoning_content": "think."}), chunk({"content": "The **answer**."}),
                   chunk({"content": "\n\n```sh\necho '<hi>'\n"}), chunk({"content": "```"}), chunk({}, "stop"),
                   f"data: {json.dumps(dict(head, choices=[], usage=usage))}\n\n", "data: [DONE]\n\n"])
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=sse))
    page.goto(server + "/")
    page.fill("#prompt", "Why?")
    page.keyboard.press("Enter")
    _wait_idle(page)
    block = page.locator(".msg.assistant details.thinking")
    assert block.is_visible() and block.get_attribute("open") is None, "shown, folded"
    assert not page.is_visible(".msg.assistant .thinking-body")
    page.click(".msg.assistant details.thinking summary")     # unfolds
    assert page.inner_text(".msg.assistant .thinking-body") == "Let me think."
    assert page.inner_html(".msg.assistant .body > p") == "The <strong>answer</strong>."
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server)
    page.click(".msg.assistant pre button.copy")
    page.wait_for_function("() => document.querySelector('.msg.assistant pre button.copy').textContent === 'Copied'")
    assert page.evaluate("navigator.clipboard.readText()") == "echo '<hi>'"
    assert _last_answer(page)["reasoning"] == "Let me think."
    assert page.locator(".msg.assistant .stats").get_attribute("data-tokens") == "4"

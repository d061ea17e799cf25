// The chat page: conversations in the browser, answers streamed from /v1/chat/completions, a stop
// button that aborts the request (the server then aborts the generation and frees its KV blocks),
// live TTFT and tokens/s, and the API key asked for when the server answers 401.

import { ApiError, fetchModel, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { DEFAULT_SETTINGS, Store } from "./store.js";

const $ = (id) => document.getElementById(id);
const store = new Store();
const ui = {
  messages: $("messages"), empty: $("empty"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
  composer: $("composer"), model: $("model"), list: $("conversations"), sidebar: $("sidebar"),
  settings: $("settings"), keyDialog: $("key-dialog"), keyInput: $("key-input"), keyReason: $("key-reason"),
  forgetKey: $("forget-key"),
};
const FIELDS = ["system", "temperature", "top_p", "max_tokens", "seed"];

let model = null;          // the served model's id (null until /v1/models answers)
let running = null;        // {controller} of the answer being streamed

// -- the API key ---------------------------------------------------------------------------------

let keyWaiters = [];

// Opens the key dialog; resolves with the key entered, or null when cancelled.
function askForKey(reason) {
  ui.keyReason.textContent = reason;
  ui.keyInput.value = "";
  if (!ui.keyDialog.open) ui.keyDialog.showModal();
  ui.keyInput.focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function answerKeyDialog(key) {
  if (ui.keyDialog.open) ui.keyDialog.close();
  const waiters = keyWaiters;
  keyWaiters = [];
  for (const w of waiters) w(key);
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = ui.keyInput.value.trim();
  if (!key) return;
  store.apiKey = key;
  ui.forgetKey.hidden = false;
  answerKeyDialog(key);
});
$("key-cancel").addEventListener("click", () => answerKeyDialog(null));
ui.keyDialog.addEventListener("cancel", () => answerKeyDialog(null));
ui.forgetKey.addEventListener("click", () => {
  store.apiKey = "";
  ui.forgetKey.hidden = true;
});

// Runs `call(key)`; on a 401 asks for a key and tries again with it (until cancelled).
async function withKey(call) {
  for (;;) {
    try {
      return await call(store.apiKey);
    } catch (e) {
      if (!(e instanceof ApiError) || e.status !== 401) throw e;
      const reason = store.apiKey ? "The server did not accept the key. Enter it again." : "This server needs an API key.";
      const key = await askForKey(reason);
      if (key === null) throw e;
    }
  }
}

// -- the model -----------------------------------------------------------------------------------

async function loadModel() {
  try {
    const card = await withKey(fetchModel);
    model = card ? card.id : null;
    ui.model.textContent = model || "no model";
    if (card && card.max_model_len) ui.model.title = `The served model (context ${card.max_model_len} tokens)`;
  } catch (e) {
    ui.model.textContent = e.status === 401 ? "API key needed" : "server unreachable";
  }
}

// -- settings ------------------------------------------------------------------------------------

function showSettings(s) {
  for (const f of FIELDS) $(f).value = s[f] ?? "";
}

function readSettings() {
  const s = {};
  for (const f of FIELDS) s[f] = $(f).value;
  return s;
}

for (const f of FIELDS) $(f).addEventListener("change", () => store.saveSettings(readSettings()));
$("reset-settings").addEventListener("click", () => {
  store.saveSettings({ ...DEFAULT_SETTINGS });
  showSettings(store.settings);
});

// The request's sampling fields, from the settings; empty or invalid numbers are left out (the
// server's defaults apply), so a half-typed value never breaks a request.
function samplingOf(s) {
  const out = {};
  const num = (v) => (v === "" || v === null || v === undefined ? NaN : Number(v));
  const t = num(s.temperature), p = num(s.top_p), m = num(s.max_tokens), seed = num(s.seed);
  if (Number.isFinite(t) && t >= 0 && t <= 2) out.temperature = t;
  if (Number.isFinite(p) && p > 0 && p <= 1) out.top_p = p;
  if (Number.isInteger(m) && m >= 1) out.max_tokens = m;
  if (Number.isInteger(seed) && seed >= 0) out.seed = seed;
  return out;
}

// -- conversations -------------------------------------------------------------------------------

function renderList() {
  ui.list.replaceChildren();
  for (const c of store.sorted()) {
    const li = document.createElement("li");
    li.className = c.id === store.currentId ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = c.title;
    open.title = c.title;
    if (c.id === store.currentId) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => { if (!running) { store.select(c.id); renderAll(); closeDrawers(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "\u00d7";
    del.setAttribute("aria-label", `Delete conversation: ${c.title}`);
    del.title = "Delete";
    del.addEventListener("click", () => {
      if (running && c.id === store.currentId) return;
      store.remove(c.id);
      renderAll();
    });
    li.append(open, del);
    ui.list.append(li);
  }
}

function formatStats(st) {
  if (!st) return "";
  const parts = [];
  if (st.ttft_ms !== null && st.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(st.ttft_ms)} ms`);
  parts.push(st.tok_s ? `${st.tok_s.toFixed(1)} tok/s` : "\u2013 tok/s");
  parts.push(`${st.exact ? "" : "~"}${st.tokens} tokens`);   // "~": counted from the stream's chunks
  const ends = { abort: "stopped", length: "max tokens reached", stop: "" };
  const end = st.finish ? (ends[st.finish] ?? st.finish) : "";
  if (end) parts.push(end);
  return parts.join(" \u00b7 ");
}

// One message's element: {root, body, thinking, thinkingBody, stats}.
function messageView(m) {
  const root = document.createElement("article");
  root.className = `msg ${m.role}`;
  const who = document.createElement("h3");
  who.className = "who";
  who.textContent = m.role === "user" ? "You" : "Assistant";
  root.append(who);
  const thinking = document.createElement("details");
  thinking.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const thinkingBody = document.createElement("div");
  thinkingBody.className = "thinking-body";
  thinking.append(summary, thinkingBody);
  thinking.hidden = !m.reasoning;
  const body = document.createElement("div");
  body.className = "body";
  const stats = document.createElement("p");
  stats.className = "stats";
  root.append(thinking, body);
  if (m.role === "assistant") root.append(stats);
  const view = { root, body, thinking, thinkingBody, stats };
  paint(view, m);
  return view;
}

function paint(view, m) {
  if (m.role === "user") view.body.textContent = m.content;
  else {
    view.body.innerHTML = renderMarkdown(m.content);
    if (navigator.clipboard) {   // a secure context (localhost or https): a copy button per code block
      for (const pre of view.body.querySelectorAll("pre")) {
        const copy = document.createElement("button");
        copy.type = "button";
        copy.className = "copy";
        copy.textContent = "Copy";
        copy.setAttribute("aria-label", "Copy the code");
        pre.prepend(copy);
      }
    }
  }
  if (m.reasoning) {
    view.thinking.hidden = false;
    view.thinkingBody.innerHTML = renderMarkdown(m.reasoning);
  }
  if (m.error) {
    const err = document.createElement("p");
    err.className = "error";
    err.setAttribute("role", "alert");
    err.textContent = m.error;
    view.body.append(err);
  }
  view.stats.textContent = formatStats(m.stats);
  if (m.stats) {
    view.stats.dataset.tokS = m.stats.tok_s ? m.stats.tok_s.toFixed(3) : "";
    view.stats.dataset.ttftMs = m.stats.ttft_ms ?? "";
    view.stats.dataset.tokens = m.stats.tokens;
  }
}

function renderMessages() {
  const c = store.current;
  ui.messages.replaceChildren();
  if (!c || !c.messages.length) {
    ui.messages.append(ui.empty);
    return;
  }
  for (const m of c.messages) ui.messages.append(messageView(m).root);
  scrollToEnd(true);
}

function renderAll() {
  renderList();
  renderMessages();
}

function scrollToEnd(force) {
  const el = ui.messages;
  const near = el.scrollHeight - el.scrollTop - el.clientHeight < 120;
  if (force || near) el.scrollTop = el.scrollHeight;
}

// -- sending and streaming -----------------------------------------------------------------------

function setRunning(r) {
  running = r;
  ui.send.hidden = !!r;
  ui.stop.hidden = !r;
  ui.composer.setAttribute("aria-busy", r ? "true" : "false");
  if (r) ui.stop.focus();
  else ui.prompt.focus();
}

function history(c, settings) {
  const msgs = [];
  if (settings.system && settings.system.trim()) msgs.push({ role: "system", content: settings.system });
  for (const m of c.messages) {
    if (m.role === "user" || (m.role === "assistant" && m.content)) msgs.push({ role: m.role, content: m.content });
  }
  return msgs;
}

async function send() {
  const text = ui.prompt.value;
  if (running || !text.trim()) return;
  const c = store.current || store.create();
  c.messages.push({ role: "user", content: text });
  store.touch(c);
  ui.prompt.value = "";
  const settings = readSettings();
  store.saveSettings(settings);
  const request = { messages: history(c, settings), ...samplingOf(settings) };
  if (model) request.model = model;
  const answer = { role: "assistant", content: "", reasoning: "", stats: null };
  c.messages.push(answer);
  store.save();
  renderList();
  // appended, not re-rendered: a screen reader announces only what is new in the log
  ui.empty.remove();
  const view = messageView(answer);
  ui.messages.append(messageView(c.messages[c.messages.length - 2]).root, view.root);
  scrollToEnd(true);
  view.root.setAttribute("aria-busy", "true");
  await stream(c, answer, view, request);
  view.root.removeAttribute("aria-busy");
}

async function stream(c, answer, view, request) {
  const controller = new AbortController();
  setRunning({ controller });
  const t0 = performance.now();
  let tFirst = null, tLast = null, chunks = 0, usageTokens = null, frame = 0;
  const stats = () => {
    const tokens = usageTokens ?? chunks;
    const span = tFirst !== null && tLast !== null ? (tLast - tFirst) / 1000 : 0;
    // the decode rate: the tokens after the first over the time since the first
    return { ttft_ms: tFirst === null ? null : tFirst - t0, tokens, exact: usageTokens !== null,
             tok_s: tokens > 1 && span > 0 ? (tokens - 1) / span : null, finish: null };
  };
  const repaint = () => {
    frame = 0;
    answer.stats = stats();
    paint(view, answer);
    scrollToEnd(false);
  };
  const on = (piece) => {
    if (piece.content || piece.reasoning) {
      const now = performance.now();
      if (tFirst === null) tFirst = now;
      tLast = now;
      chunks += 1;
      if (piece.content) answer.content += piece.content;
      if (piece.reasoning) answer.reasoning += piece.reasoning;
    }
    if (piece.usage) usageTokens = piece.usage.completion_tokens;
    if (!frame) frame = requestAnimationFrame(repaint);
  };
  let finish = null;
  try {
    const result = await withKey((key) => streamChat(request, key, controller.signal, on));
    finish = result.finishReason;
    if (result.usage) usageTokens = result.usage.completion_tokens;
  } catch (e) {
    if (e.name === "AbortError") finish = "abort";
    else answer.error = e instanceof ApiError ? e.message : `The request failed: ${e.message}`;
  } finally {
    if (frame) cancelAnimationFrame(frame);
    answer.stats = { ...stats(), finish };
    if (!answer.reasoning) delete answer.reasoning;
    paint(view, answer);
    store.touch(c);
    store.save();
    renderList();
    setRunning(null);
  }
}

function stop() {
  if (running) running.controller.abort();
}

// -- wiring --------------------------------------------------------------------------------------

ui.messages.addEventListener("click", async (e) => {
  const button = e.target.closest("button.copy");
  if (!button) return;
  try {
    await navigator.clipboard.writeText(button.parentElement.querySelector("code").textContent);
    button.textContent = "Copied";
  } catch (_) {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});
ui.composer.addEventListener("submit", (e) => { e.preventDefault(); send(); });
ui.stop.addEventListener("click", stop);
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && running && !ui.keyDialog.open) stop(); });
$("new-chat").addEventListener("click", () => {
  if (running) return;
  const c = store.current;
  if (!c || c.messages.length) store.create();
  renderAll();
  closeDrawers();
  ui.prompt.focus();
});

function toggle(button, panel) {
  const open = !panel.classList.contains("open");
  panel.classList.toggle("open", open);
  button.setAttribute("aria-expanded", String(open));
}
function closeDrawers() {
  for (const [b, p] of [["toggle-sidebar", ui.sidebar], ["toggle-settings", ui.settings]]) {
    p.classList.remove("open");
    $(b).setAttribute("aria-expanded", "false");
  }
}
$("toggle-sidebar").addEventListener("click", (e) => toggle(e.currentTarget, ui.sidebar));
$("toggle-settings").addEventListener("click", (e) => toggle(e.currentTarget, ui.settings));

store.onSaveFailed = () => { $("storage-note").hidden = false; };
ui.forgetKey.hidden = !store.apiKey;
showSettings(store.settings);
renderAll();
ui.prompt.focus();
loadModel();

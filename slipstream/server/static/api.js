// Talking to the server: the OpenAI-shaped API of the same origin, the API key as a Bearer token,
// and server-sent events read from a fetch() body (a ReadableStream), so a stream can be aborted.

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch (_) { /* not JSON: keep the status line */ }
  return new ApiError(response.status, message, code);
}

function headers(apiKey, json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (apiKey) h["Authorization"] = `Bearer ${apiKey}`;
  return h;
}

// GET /v1/models -> the first model's id (throws ApiError; 401 when a key is needed or wrong).
export async function fetchModel(apiKey) {
  const r = await fetch("/v1/models", { headers: headers(apiKey, false), cache: "no-store" });
  if (!r.ok) throw await errorOf(r);
  const body = await r.json();
  return body.data && body.data.length ? body.data[0] : null;
}

// The data lines of one SSE event (comments and other fields ignored), joined as the spec says.
function eventData(block) {
  const data = [];
  for (const line of block.split(/\r\n|\r|\n/)) {
    if (line.startsWith("data:")) data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
  }
  return data.length ? data.join("\n") : null;
}

// Yields each parsed JSON chunk of a streamed chat completion until `data: [DONE]`. An error event
// from the server (`{"error": {...}}`) is thrown as an ApiError.
async function* sseChunks(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.search(/\r\n\r\n|\n\n|\r\r/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + (buffer.startsWith("\r\n\r\n", cut) ? 4 : 2));
        const data = eventData(block);
        if (data === null) continue;
        if (data.trim() === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(200, chunk.error.message || "the stream failed", chunk.error.code);
        yield chunk;
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// POST /v1/chat/completions with stream: true. `on` gets {content, reasoning, finish, usage} pieces
// as they arrive. Resolves with {finishReason, usage} when the stream ends; rejects with an
// ApiError (HTTP error or error event) or the AbortError of `signal`.
export async function streamChat(request, apiKey, signal, on) {
  const body = JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } });
  const r = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(apiKey, true), body, signal, cache: "no-store",
  });
  if (!r.ok) throw await errorOf(r);
  let finishReason = null;
  let usage = null;
  for await (const chunk of sseChunks(r.body)) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) on({ reasoning: delta.reasoning_content });
      if (delta.content) on({ content: delta.content });
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    if (usage) on({ usage });
  }
  return { finishReason, usage };
}

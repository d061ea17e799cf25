// What the page keeps in the browser (localStorage, this origin only): the conversations, the
// settings and the API key. Nothing is sent anywhere but to this server's API.

const KEYS = {
  conversations: "slipstream.chat.conversations.v1",
  current: "slipstream.chat.current.v1",
  settings: "slipstream.chat.settings.v1",
  apiKey: "slipstream.chat.apiKey",
};

export const DEFAULT_SETTINGS = Object.freeze({
  system: "", temperature: 0.7, top_p: 1, max_tokens: 512, seed: "",
});

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch (_) {
    return fallback;
  }
}

// false when the browser refused (storage full or disabled); the page keeps working from memory
function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch (_) {
    return false;
  }
}

export function newId() {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

export class Store {
  constructor() {
    const list = read(KEYS.conversations, []);
    this.conversations = Array.isArray(list) ? list.filter((c) => c && c.id && Array.isArray(c.messages)) : [];
    this.currentId = read(KEYS.current, null);
    this.settings = { ...DEFAULT_SETTINGS, ...read(KEYS.settings, {}) };
    this.onSaveFailed = () => {};
    this.memoryKey = "";
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) || null;
  }

  // the newest first
  sorted() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  create() {
    const now = Date.now();
    const c = { id: newId(), title: "New chat", created: now, updated: now, messages: [] };
    this.conversations.push(c);
    this.select(c.id);
    this.save();
    return c;
  }

  select(id) {
    this.currentId = id;
    write(KEYS.current, id);
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) this.select(this.sorted()[0]?.id ?? null);
    this.save();
  }

  touch(conversation) {
    conversation.updated = Date.now();
    if (conversation.title === "New chat") {
      const first = conversation.messages.find((m) => m.role === "user");
      if (first) conversation.title = first.content.replace(/\s+/g, " ").trim().slice(0, 60) || "New chat";
    }
  }

  save() {
    if (!write(KEYS.conversations, this.conversations)) this.onSaveFailed();
  }

  saveSettings(settings) {
    this.settings = { ...DEFAULT_SETTINGS, ...settings };
    write(KEYS.settings, this.settings);
  }

  get apiKey() {
    try { return localStorage.getItem(KEYS.apiKey) || this.memoryKey; } catch (_) { return this.memoryKey; }
  }

  set apiKey(key) {
    this.memoryKey = key || "";      // used when the browser will not store it
    try {
      if (key) localStorage.setItem(KEYS.apiKey, key);
      else localStorage.removeItem(KEYS.apiKey);
    } catch (_) { /* kept for this page only */ }
  }
}

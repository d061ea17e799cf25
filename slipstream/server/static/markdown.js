// A small, safe markdown renderer for the chat page: the text is HTML-escaped first, and only the
// tags this file writes ever reach the page. Handles code fences (an unclosed fence, as in a
// stream, runs to the end), inline code, bold and italic, headings, flat lists, quotes, rules, and
// links whose scheme is http, https or mailto. Anything else stays plain text.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]+$/i;
const HOLE = "\u0000";   // placeholders for pieces already rendered (never in the input: stripped)

// Inline markup of one escaped line.
function inline(escaped) {
  const held = [];
  const hold = (html) => `${HOLE}${held.push(html) - 1}${HOLE}`;
  let s = escaped.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) => hold(`<code>${code.trim()}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    const raw = url.replace(/&amp;/g, "&");
    if (!SAFE_URL.test(raw)) return whole;
    return hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`);
  });
  // bare URLs: "&" only as "&amp;" (an escaped quote or bracket ends the URL), trailing punctuation left out
  s = s.replace(/(^|[\s(])(https?:\/\/(?:[^\s&\u0000]|&amp;)+)/g, (_, lead, url) => {
    const tail = /[.,;:!?)\]]*$/.exec(url)[0];
    const link = url.slice(0, url.length - tail.length);
    return lead + hold(`<a href="${link}" target="_blank" rel="noopener noreferrer">${link}</a>`) + tail;
  });
  s = s.replace(/(\*\*\*|___)(?=\S)([\s\S]*?\S)\1/g, "<strong><em>$2</em></strong>");
  s = s.replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>");
  s = s.replace(/(^|[^\w*])\*(?=[^\s*])([^*]*?[^\s*])\*(?![\w*])/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w_])_(?=[^\s_])([^_]*?[^\s_])_(?![\w_])/g, "$1<em>$2</em>");
  s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  return s.replace(new RegExp(`${HOLE}(\\d+)${HOLE}`, "g"), (_, i) => held[Number(i)]);
}

const FENCE = /^\s{0,3}(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const BULLET = /^\s{0,3}[-*+]\s+(.*)$/;
const NUMBERED = /^\s{0,3}(\d{1,9})[.)]\s+(.*)$/;
const QUOTE = /^\s{0,3}&gt;\s?(.*)$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;

// Markdown -> HTML (a string safe to assign to innerHTML).
export function renderMarkdown(text) {
  const lines = escapeHtml(String(text).replace(/\u0000/g, "")).split(/\r?\n/);
  const out = [];
  let para = [];
  let list = null;            // {tag, items}
  let quote = [];

  const flushPara = () => {
    if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
    para = [];
  };
  const flushList = () => {
    if (list) {
      const start = list.tag === "ol" && list.start !== 1 ? ` start="${list.start}"` : "";
      out.push(`<${list.tag}${start}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
    }
    list = null;
  };
  const flushQuote = () => {
    if (quote.length) out.push(`<blockquote>${renderMarkdownEscaped(quote)}</blockquote>`);
    quote = [];
  };
  const flushAll = () => { flushPara(); flushList(); flushQuote(); };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      flushAll();
      const marker = fence[1];
      const code = [];
      let j = i + 1;
      for (; j < lines.length; j++) {
        const close = lines[j].trim();
        if (close.startsWith(marker[0].repeat(marker.length)) && /^(`+|~+)$/.test(close)) break;
        code.push(lines[j]);
      }
      const lang = fence[2] ? ` class="language-${fence[2]}" data-lang="${fence[2]}"` : "";
      out.push(`<pre><code${lang}>${code.join("\n")}</code></pre>`);
      i = j;   // the closing fence (or the end)
      continue;
    }
    const q = QUOTE.exec(line);
    if (q) { flushPara(); flushList(); quote.push(q[1]); continue; }
    flushQuote();
    if (!line.trim()) { flushPara(); flushList(); continue; }
    const h = HEADING.exec(line);
    if (h) { flushAll(); out.push(`<h${h[1].length}>${inline(h[2])}</h${h[1].length}>`); continue; }
    if (RULE.test(line)) { flushAll(); out.push("<hr>"); continue; }
    const b = BULLET.exec(line);
    const n = b ? null : NUMBERED.exec(line);
    if (b || n) {
      flushPara();
      const tag = b ? "ul" : "ol";
      if (!list || list.tag !== tag) { flushList(); list = { tag, items: [], start: n ? Number(n[1]) : 1 }; }
      list.items.push(b ? b[1] : n[2]);
      continue;
    }
    if (list && /^\s{2,}\S/.test(line)) {   // a continuation line of the last item
      list.items[list.items.length - 1] += " " + line.trim();
      continue;
    }
    flushList();
    para.push(line);
  }
  flushAll();
  return out.join("\n");
}

// The quote's inner lines are already escaped: render them without escaping twice.
function renderMarkdownEscaped(lines) {
  const unescaped = lines.join("\n").replace(/&(amp|lt|gt|quot|#39);/g,
    (m) => ({ "&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&#39;": "'" })[m]);
  return renderMarkdown(unescaped);
}

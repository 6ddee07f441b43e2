// blendkv /ui: ask, see the sources and how every prompt token was computed; the store; health.
// Plain JavaScript against the server's public API (docs/guide/serving.md). Safe by
// construction: every text from the server or a document goes into the DOM as text
// (textContent, text nodes, attribute values), never as HTML; the page's CSP allows no inline
// script or style. The API key lives in this tab's sessionStorage only.
"use strict";

const KEY_STORAGE = "blendkv-api-key";
const KIND_LABELS = {
  p: "prefix cache",
  s: "reused as stored",
  c: "reused, corrected",
  r: "recomputed",
  n: "computed",
};
const KIND_HELP = {
  p: "K/V from the engine's prefix cache: no fused prefill computed it",
  s: "a chunk token whose stored K/V was used as stored",
  c: "a chunk token whose stored K/V was used, moved by the K/V correction",
  r: "a chunk token selected and recomputed through every layer",
  n: "no stored K/V (template, question): computed",
};
const TIER_LABELS = {
  device: "K/V from device memory",
  memory: "K/V from host memory",
  lmdb: "K/V from the LMDB store",
  redis: "K/V from the Redis store",
  computed: "K/V computed now (it was not stored)",
};

function tierLabel(tier) {
  return TIER_LABELS[tier] || `K/V from ${tier}`;
}

const state = {
  key: sessionStorage.getItem(KEY_STORAGE) || "",
  info: null,
  abort: null,
  map: null, // the last token map (with tokens, sources)
  store: { offset: 0, limit: 50, q: "", total: 0, selected: null },
  healthTimer: null,
};

// ------------------------------------------------------------------ DOM helpers
function $(id) {
  return document.getElementById(id);
}

// el("p", {class: "x", dataset: {i: 1}}, "text", child): strings become text nodes.
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "text") node.textContent = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

function show(node, visible) {
  node.hidden = !visible;
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  return s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtPct(x) {
  if (x === null || x === undefined) return "–";
  if (x > 0 && x < 0.001) return `${(100 * x).toPrecision(2)} %`;
  return `${(100 * x).toFixed(x < 0.1 ? 1 : 0)} %`;
}

// A source's file name (the last part of its path), the path itself, or its doc id.
function baseName(source) {
  if (!source) return "";
  const parts = source.split(/[\\/]/);
  return parts[parts.length - 1] || source;
}

function fmtDate(t) {
  return t ? new Date(t * 1000).toLocaleString() : "–";
}

// What a source is called: a pasted document's title, a stored one's file name, its doc id.
function sourceName(s, i) {
  return s.name || baseName(s.source) || s.doc_id || `chunk ${i + 1}`;
}

// ------------------------------------------------------------------ API
class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function headers(json) {
  const h = {};
  if (json) h["content-type"] = "application/json";
  if (state.key) h.authorization = `Bearer ${state.key}`;
  return h;
}

async function errorOf(resp) {
  let message = `${resp.status} ${resp.statusText}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (e) {
    // not JSON: keep the status line
  }
  if (resp.status === 401) askForKey(message);
  return new ApiError(resp.status, message);
}

async function api(path, options) {
  const opts = options || {};
  const resp = await fetch(path, {
    method: opts.method || "GET",
    headers: headers(opts.body !== undefined),
    body: opts.body !== undefined ? JSON.stringify(opts.body) : undefined,
    signal: opts.signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  return resp.json();
}

// POST a streamed request; onEvent(parsed JSON) per server-sent event until [DONE].
async function streamEvents(path, body, signal, onEvent) {
  const resp = await fetch(path, {
    method: "POST",
    headers: headers(true),
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorOf(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(0, parsed.error.message);
        onEvent(parsed);
      }
    }
  }
}

// ------------------------------------------------------------------ key and server info
function askForKey(message) {
  show($("key-panel"), true);
  $("key-message").textContent = state.key
    ? `The server refused the key: ${message}`
    : "This server needs its API key (the one blendkv serve was started with, --api-key). " +
      "It stays in this tab only.";
  $("key-input").focus();
}

function setServerLine(parts, bad) {
  const line = $("server");
  clear(line);
  line.dataset.state = bad ? "error" : "ok"; // (tests wait for it)
  line.append(el("span", { class: bad ? "bad" : null }, parts.join(" · ")));
}

async function loadInfo() {
  try {
    const info = await api("v1/blendkv/info");
    state.info = info;
    show($("key-panel"), false);
    show($("key-button"), info.api_key);
    const parts = [info.model];
    parts.push(info.store ? `store ${info.store.name}` : "no store");
    if (info.api_key) parts.push("key set");
    const hasStore = Boolean(info.store);
    $("mode-store").disabled = !hasStore;
    if (!hasStore) {
      $("mode-documents").checked = true;
      onModeChange();
    }
    setServerLine(parts, false); // last: the page is ready
    return true;
  } catch (err) {
    if (err.status === 503) {
      setServerLine([`server: ${err.message}`], true);
      setTimeout(loadInfo, 2000);
    } else {
      setServerLine([err.status === 401 ? "locked: API key needed" : err.message], true);
    }
    return false;
  }
}

// ------------------------------------------------------------------ tabs
function selectTab(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.setAttribute("aria-selected", String(tab.dataset.tab === name));
  }
  for (const view of ["ask", "store", "health"]) show($(`tab-${view}`), view === name);
  clearInterval(state.healthTimer);
  state.healthTimer = null;
  if (!state.info) return;
  if (name === "store") loadStore();
  if (name === "health") {
    loadHealth();
    state.healthTimer = setInterval(loadHealth, 5000);
  }
}

// ------------------------------------------------------------------ ask
function onModeChange() {
  const docs = $("mode-documents").checked;
  show($("doc-input"), docs);
  if (docs && !$("doc-list").children.length) addDocument("", "");
}

function addDocument(title, text) {
  const remove = el("button", { type: "button", class: "link" }, "remove");
  const node = el(
    "div",
    { class: "doc" },
    el("input", { type: "text", class: "doc-title", placeholder: "title (optional)" }),
    remove,
    el("textarea", { class: "doc-text", placeholder: "document text" }),
  );
  node.querySelector(".doc-title").value = title;
  node.querySelector(".doc-text").value = text;
  remove.addEventListener("click", () => node.remove());
  $("doc-list").append(node);
}

function pastedDocuments() {
  const docs = [];
  for (const node of $("doc-list").children) {
    const text = node.querySelector(".doc-text").value;
    const title = node.querySelector(".doc-title").value.trim();
    if (text.trim()) docs.push(title ? { title, text } : { text });
  }
  return docs;
}

function readDroppedFiles(files) {
  for (const file of files) {
    const reader = new FileReader();
    reader.onload = () => {
      // an empty first document (the one the form starts with) is replaced
      const first = $("doc-list").firstElementChild;
      if (first && !first.querySelector(".doc-text").value.trim()) first.remove();
      addDocument(file.name, String(reader.result));
    };
    reader.readAsText(file);
  }
}

function chatBody() {
  const question = $("question").value.trim();
  const body = {
    messages: [{ role: "user", content: question }],
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || 64,
    temperature: Number($("temperature").value) || 0,
    token_map: true,
  };
  const ratio = $("ratio").value.trim();
  if (ratio) body.blend = { recompute_ratio: ratio === "auto" ? "auto" : Number(ratio) };
  if ($("mode-store").checked) {
    body.rag = { top_k: Number($("top-k").value) || 4 };
  } else {
    body.documents = pastedDocuments();
    if (!body.documents.length) throw new Error("paste or drop at least one document");
  }
  return body;
}

function resetAnswer(id, visible) {
  const box = $(id);
  show(box, visible);
  box.querySelector(".text").textContent = "";
  box.querySelector(".ttft").textContent = "";
  box.classList.toggle("streaming", visible);
  return box;
}

function setError(message) {
  const node = $("ask-error");
  node.textContent = message || "";
  show(node, Boolean(message));
}

// Streams one request into answer box ``id``; returns {info, usage, ttft (client, seconds)}.
async function runStream(id, path, body, signal, textOf) {
  const box = $(id);
  const text = box.querySelector(".text");
  const t0 = performance.now();
  let ttft = null;
  let info = null;
  let usage = null;
  await streamEvents(path, body, signal, (chunk) => {
    for (const choice of chunk.choices || []) {
      const piece = textOf(choice);
      if (piece) {
        if (ttft === null) {
          ttft = (performance.now() - t0) / 1000;
          box.querySelector(".ttft").textContent = `first token after ${fmtSeconds(ttft)}`;
        }
        text.append(document.createTextNode(piece));
      }
    }
    if (chunk.blendkv) info = chunk.blendkv;
    if (chunk.usage) usage = chunk.usage;
  });
  box.classList.remove("streaming");
  return { info, usage, ttft };
}

async function ask(event) {
  event.preventDefault();
  setError("");
  let body;
  try {
    body = chatBody();
  } catch (err) {
    setError(err.message);
    return;
  }
  const compare = $("compare-full").checked;
  state.abort = new AbortController();
  const signal = state.abort.signal;
  $("ask-button").disabled = true;
  show($("stop-button"), true);
  show($("answers"), true);
  resetAnswer("answer-blend", true);
  resetAnswer("answer-full", false);
  for (const id of ["summary", "sources", "token-map"]) show($(id), false);
  try {
    const blend = await runStream("answer-blend", "v1/chat/completions", body, signal,
      (c) => c.delta && c.delta.content);
    renderBlend(blend, body);
    if (compare && blend.info && blend.info.token_map) {
      resetAnswer("answer-full", true);
      const full = await runStream("answer-full", "v1/completions", {
        prompt: blend.info.token_map.token_ids,
        max_tokens: body.max_tokens,
        temperature: body.temperature,
        stream: true,
        stream_options: { include_usage: true },
      }, signal, (c) => c.text);
      const cached = full.usage && full.usage.prompt_tokens_details;
      const note = cached && cached.cached_tokens ? `, ${cached.cached_tokens} from the prefix cache` : "";
      $("answer-full").querySelector(".ttft").textContent =
        `first token after ${fmtSeconds(full.ttft)}${note} (one run; blendkv ask ` +
        "--compare-full times warm runs)";
    }
  } catch (err) {
    if (err.name !== "AbortError") setError(err.message);
  } finally {
    for (const id of ["answer-blend", "answer-full"]) $(id).classList.remove("streaming");
    $("ask-button").disabled = false;
    show($("stop-button"), false);
    state.abort = null;
  }
}

function renderBlend(result, body) {
  const info = result.info;
  const summary = $("summary");
  if (!info) {
    summary.textContent = "No blend stats came back (the prompt had no documents).";
    show(summary, true);
    return;
  }
  const server = info.ttft !== null && info.ttft !== undefined ? fmtSeconds(info.ttft) : "–";
  $("answer-blend").querySelector(".ttft").textContent =
    `first token after ${fmtSeconds(result.ttft)} (server: ${server})`;
  const parts = [`${info.num_prompt_tokens} prompt tokens`];
  if (info.prefix_cached_tokens) {
    parts.push(`${info.prefix_cached_tokens} of them from the prefix cache (this prompt, or its ` +
      "start, ran before: nothing of that part was blended)");
  }
  parts.push(
    `${info.chunks_hit} of ${info.num_chunks} chunks from the store` +
      (info.chunks_missed ? `, ${info.chunks_missed} computed now` : ""),
    `${info.tokens_reused} tokens reused, ${info.reused_tokens_recomputed} of them recomputed ` +
      `(${fmtPct(info.recompute_fraction)})`,
    `load ${fmtSeconds(info.load_seconds)}`,
  );
  if (info.fidelity_target !== null && info.fidelity_target !== undefined) {
    parts.push(`fidelity target ${info.fidelity_target} nats: recompute ratio ` +
      `${info.chosen_recompute_ratio} (${info.calibrated ? "the store's calibration" :
        "no calibration: the conservative ratio"})`);
  }
  if (info.fallback) parts.push(`ran as full prefill: ${info.fallback}`);
  else if (info.cost_choice) parts.push(`cost check: ${info.cost_choice.replace("_", " ")}`);
  summary.textContent = parts.join(" · ");
  show(summary, true);
  const sources = info.sources || (body.documents || []).map((d, i) => ({
    name: d.title || `document ${i + 1}`,
    text: d.text,
  }));
  renderSources(sources, info.token_map);
  if (info.token_map) renderTokenMap(info.token_map, sources, info);
}

function renderSources(sources, map) {
  const list = $("source-list");
  clear(list);
  const ranked = sources.map((s) => s.score).filter((x) => x !== undefined).sort((a, b) => b - a);
  sources.forEach((s, i) => {
    const name = sourceName(s, i);
    const meta = [];
    if (s.score !== undefined) {
      meta.push(`relevance ${ranked.indexOf(s.score) + 1} of ${ranked.length} ` +
        `(score ${s.score.toFixed(3)})`);
    }
    if (s.position !== undefined) meta.push(`chunk ${s.position} of its document`);
    if (s.chunk_id !== undefined) meta.push(`stored chunk ${s.chunk_id}`);
    if (map && map.chunk_tiers && map.chunk_tiers[i]) {
      meta.push(tierLabel(map.chunk_tiers[i]));
    }
    if (map && map.chunk_spans && map.chunk_spans[i]) {
      const [a, b] = map.chunk_spans[i];
      meta.push(`tokens ${a}–${b - 1}`);
    }
    const more = el("button", { type: "button", class: "link" }, "show all");
    const item = el(
      "li",
      {},
      el("span", { class: "name", title: s.source || "" }, name),
      " ",
      el("span", { class: "meta" }, meta.join(" · ")),
      s.source && s.source !== name ? el("span", { class: "path" }, s.source) : null,
      el("span", { class: "excerpt" }, s.text || ""),
      more,
    );
    more.addEventListener("click", () => {
      item.classList.toggle("open");
      more.textContent = item.classList.contains("open") ? "show less" : "show all";
    });
    list.append(item);
  });
  show($("sources"), sources.length > 0);
}

function segmentLabel(map, sources, i) {
  const c = map.chunks[i];
  if (c >= 0) {
    const s = sources[c] || {};
    const name = sourceName(s, c);
    const tier = map.chunk_tiers && map.chunk_tiers[c];
    const exact = map.chunk_exact && map.chunk_exact[c] ? ", stored K/V exact" : "";
    return `chunk ${c + 1}: ${name}${tier ? ` (${tierLabel(tier)}${exact})` : ""}`;
  }
  const firstChunk = map.chunk_spans.length ? map.chunk_spans[0][0] : map.num_tokens;
  return i < firstChunk ? "template" : "question and template";
}

function renderTokenMap(map, sources, info) {
  state.map = { map, sources };
  const legend = $("legend");
  clear(legend);
  for (const code of Object.keys(KIND_LABELS)) {
    const count = map.counts[map.legend[code]];
    legend.append(
      el(
        "span",
        { class: "item", title: KIND_HELP[code], dataset: { kind: map.legend[code], count } },
        el("span", { class: `swatch k-${code}` }),
        KIND_LABELS[code],
        " ",
        el("span", { class: "count" }, String(count)),
      ),
    );
  }
  const total = Object.values(map.counts).reduce((a, b) => a + b, 0);
  $("map-total").textContent =
    `${total} prompt tokens` + (total === info.num_prompt_tokens ? "" : " (≠ blend stats!)");
  const tokens = $("tokens");
  clear(tokens);
  const frag = document.createDocumentFragment();
  let segment = null;
  for (let i = 0; i < map.num_tokens; i += 1) {
    const label = segmentLabel(map, sources, i);
    if (label !== segment) {
      segment = label;
      frag.append(el("span", { class: "seg" }, label));
    }
    const span = el("span", { class: `t k-${map.kinds[i]}`, dataset: { i } });
    span.textContent = map.tokens[i];
    frag.append(span);
  }
  tokens.append(frag);
  $("shade").value = map.query_mass ? $("shade").value : "kind";
  $("shade").querySelector('option[value="mass"]').disabled = !map.query_mass;
  applyShade();
  show($("token-map"), true);
}

function applyShade() {
  if (!state.map) return;
  const { map } = state.map;
  const mode = $("shade").value;
  let values = null;
  if (mode === "mass" && map.query_mass) values = map.query_mass;
  if (mode === "score" && map.scores) values = map.scores;
  let max = 0;
  if (values) for (const v of values) if (v !== null && v > max) max = v;
  for (const span of $("tokens").querySelectorAll(".t")) {
    const i = Number(span.dataset.i);
    if (!values) {
      span.className = `t k-${map.kinds[i]}`;
      span.style.backgroundColor = "";
      continue;
    }
    span.className = "t";
    const v = values[i];
    const a = v === null || max <= 0 ? 0 : Math.sqrt(Math.max(v, 0) / max);
    span.style.backgroundColor = `rgba(224, 121, 79, ${a.toFixed(3)})`;
  }
}

function tooltipLines(i) {
  const { map, sources } = state.map;
  const code = map.kinds[i];
  const lines = [[`#${i}  `, map.tokens[i]]];
  lines.push([`${KIND_LABELS[code]}: ${KIND_HELP[code]}`]);
  const c = map.chunks[i];
  if (c >= 0) {
    const s = sources[c] || {};
    const name = sourceName(s, c);
    lines.push([`chunk ${c + 1} (${name}), offset ${map.offsets[i]}`]);
    const d = map.dropped_at ? map.dropped_at[i] : -1;
    if (code === "r") lines.push([`recomputed at every one of the ${map.num_layers} layers`]);
    else if (d >= 0) lines.push([`left the recompute set at layer ${d} of ${map.num_layers}`]);
    if (map.scores && map.scores[i] !== null) {
      const at = map.selections.filter((s2) => s2.layer <= (d >= 0 ? d : Infinity)).pop();
      lines.push([`selection score (${at ? at.score : "?"}): ${map.scores[i]}`]);
    } else if (map.forced && map.forced[i]) {
      lines.push(["picked without a score (chunk heads / samples)"]);
    }
  }
  if (map.query_mass) {
    lines.push([`share of the question's attention: ${fmtPct(map.query_mass[i])}`]);
  }
  return lines;
}

function onTokenHover(event) {
  const span = event.target.closest(".t");
  const tip = $("tooltip");
  if (!span || !state.map) {
    show(tip, false);
    return;
  }
  clear(tip);
  for (const parts of tooltipLines(Number(span.dataset.i))) {
    const line = el("div", {}, parts[0]);
    if (parts.length > 1) line.append(el("span", { class: "tok" }, JSON.stringify(parts[1])));
    tip.append(line);
  }
  const panel = $("token-map").getBoundingClientRect();
  const rect = span.getBoundingClientRect();
  tip.style.left = `${Math.max(0, Math.min(rect.left - panel.left, panel.width - 370))}px`;
  tip.style.top = `${rect.bottom - panel.top + 6}px`;
  show(tip, true);
}

// ------------------------------------------------------------------ store
async function loadStore() {
  const st = state.store;
  if (!state.info.store) {
    show($("store-none"), true);
    show($("store-body"), false);
    return;
  }
  const params = new URLSearchParams({ offset: st.offset, limit: st.limit });
  if (st.q) params.set("q", st.q);
  const seq = (st.seq = (st.seq || 0) + 1);
  let page;
  try {
    page = await api(`v1/blendkv/documents?${params}`);
  } catch (err) {
    $("store-range").textContent = err.message;
    return;
  }
  if (seq !== st.seq) return; // a newer listing was asked for meanwhile
  st.total = page.total;
  const rows = $("store-rows");
  clear(rows);
  for (const doc of page.data) rows.append(storeRow(doc));
  const last = page.offset + page.data.length;
  $("store-range").textContent = page.total
    ? `${page.offset + 1}–${last} of ${page.total} documents`
    : "no documents";
  $("store-prev").disabled = page.offset === 0;
  $("store-next").disabled = !page.has_more;
  show($("store-delete-note"), !state.info.can_delete);
}

function storeRow(doc) {
  const cells = [
    el("td", { title: doc.source || "" }, doc.source ? baseName(doc.source) : "–"),
    el("td", { class: "id" }, doc.doc_id),
    el("td", { class: "num" }, String(doc.num_chunks)),
    el("td", { class: "num" }, String(doc.num_tokens)),
    el("td", { class: "num" }, fmtBytes(doc.nbytes)),
    el("td", {}, fmtDate(doc.added)),
  ];
  const actions = el("td", {});
  if (state.info.can_delete) {
    const del = el("button", { type: "button", class: "quiet delete" }, "Delete");
    del.addEventListener("click", (e) => {
      e.stopPropagation();
      confirmDelete(doc);
    });
    actions.append(del);
  }
  const row = el("tr", { dataset: { docId: doc.doc_id } }, ...cells, actions);
  row.addEventListener("click", () => showDocument(doc.doc_id, row));
  return row;
}

async function showDocument(docId, row) {
  for (const r of $("store-rows").children) r.classList.toggle("selected", r === row);
  const panel = $("doc-detail");
  clear(panel);
  show(panel, true);
  let docs;
  try {
    docs = (await api(`v1/blendkv/documents/${encodeURIComponent(docId)}`)).data;
  } catch (err) {
    panel.append(el("p", { class: "error" }, err.message));
    return;
  }
  for (const doc of docs) {
    panel.append(el("h2", {}, baseName(doc.source) || doc.doc_id, " ",
      el("small", {}, [doc.source, doc.doc_id].filter(Boolean).join(" · "))));
    for (const c of doc.chunks) {
      const where = c.chunk_id === null ? "not stored" : `stored chunk ${c.chunk_id}`;
      panel.append(
        el(
          "div",
          { class: "chunk" },
          el("div", { class: "meta" },
            `[${c.position}] ${where}, ${c.num_tokens ?? "?"} tokens, ${fmtBytes(c.nbytes)}`),
          el("pre", {}, c.text),
        ),
      );
    }
  }
}

function confirmDelete(doc) {
  const panel = $("doc-detail");
  clear(panel);
  show(panel, true);
  const yes = el("button", { type: "button", class: "danger", id: "confirm-delete" },
    "Delete document");
  const no = el("button", { type: "button", class: "quiet" }, "Cancel");
  const status = el("span", { class: "hint" });
  panel.append(
    el("div", { class: "confirm" },
      el("span", {}, `Delete “${doc.source || doc.doc_id}” (${doc.num_chunks} chunks) from the ` +
        "store, its index and its catalog? Chunks another document shares stay. This cannot " +
        "be undone."),
      yes, no, status),
  );
  no.addEventListener("click", () => show(panel, false));
  yes.addEventListener("click", async () => {
    yes.disabled = true;
    try {
      const r = await api(`v1/blendkv/documents/${encodeURIComponent(doc.doc_id)}`,
        { method: "DELETE" });
      clear(panel);
      panel.append(el("p", {}, `Deleted ${r.deleted.map((d) => d.source || d.doc_id).join(", ")}` +
        ` (${r.chunks_removed} chunks removed).`));
      loadStore();
    } catch (err) {
      status.textContent = err.message;
      yes.disabled = false;
    }
  });
}

// ------------------------------------------------------------------ health
function card(label, value, sub) {
  return el("div", { class: "card" },
    el("div", { class: "label" }, label),
    el("div", { class: "value" }, value),
    sub ? el("div", { class: "sub" }, sub) : null);
}

async function loadHealth() {
  let h;
  try {
    h = await api("v1/blendkv/health");
  } catch (err) {
    const cards = $("health-cards");
    clear(cards);
    cards.append(el("p", { class: "error" }, err.message));
    return;
  }
  const cards = $("health-cards");
  clear(cards);
  const t = h.ttft;
  cards.append(card("TTFT p50 / p90 / p99",
    `${fmtSeconds(t.p50)} / ${fmtSeconds(t.p90)} / ${fmtSeconds(t.p99)}`,
    `over the last ${t.count} requests`));
  const tiers = h.tiers;
  cards.append(card("Chunk hit rate", fmtPct(tiers.hit_rate),
    `${tiers.blended_requests} blended requests; device ${fmtPct(tiers.rates.device)}, ` +
    `memory ${fmtPct(tiers.rates.memory)}, store ${fmtPct(tiers.rates.store)}`));
  const a = h.audit;
  if (a.rate > 0 || a.count > 0) {
    cards.append(card("Audited divergence", a.mean_kl === null ? "–" : `${a.mean_kl.toFixed(4)} nats`,
      `mean first-token KL of ${a.count} audits (warn above ${a.warn_kl}); top-1 agreement ` +
      `${fmtPct(a.top1_agreement)}; audit rate ${a.rate}`));
  } else {
    cards.append(card("Audited divergence", "off",
      "start the server with --blend-audit-rate 0.05 to compare a sample of blends with full " +
      "prefill"));
  }
  for (const f of a.fidelity || []) {
    cards.append(card(`Fidelity target ${f.target} nats`,
      `p90 ${f.p90_max_kl.toFixed(4)} nats`,
      `${f.within ? "within" : "over"} the target over ${f.audits} audits (largest KL over ` +
      `the answer's first tokens); now at recompute ratio ${f.recompute_ratio}`));
  }
  const e = h.engine;
  cards.append(card("Engine now", `${e.running} running, ${e.waiting} waiting`,
    `KV blocks ${e.kv_blocks_used} / ${e.kv_blocks_total}`));
  drawTtft($("chart-ttft"), h);
  drawTiers($("chart-tiers"), tiers);
  drawAudits($("chart-audit"), a);
}

const W = 360;
const H = 170;
const PAD = { l: 44, r: 10, t: 10, b: 24 };

function frame(node, yMax, yFormat, empty) {
  clear(node);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  node.append(svg);
  if (empty) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      empty));
    return null;
  }
  const y = (v) => PAD.t + (H - PAD.t - PAD.b) * (1 - v / yMax);
  for (const f of [0, 0.5, 1]) {
    svg.append(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: y(f * yMax), y2: y(f * yMax),
      class: "grid" }));
    svg.append(svgEl("text", { x: PAD.l - 4, y: y(f * yMax) + 4, "text-anchor": "end" },
      yFormat(f * yMax)));
  }
  svg.append(svgEl("line", { x1: PAD.l, x2: PAD.l, y1: PAD.t, y2: H - PAD.b, class: "axis" }));
  return { svg, y };
}

function drawTtft(node, h) {
  const samples = h.samples.filter((s) => s.ttft !== null);
  const max = Math.max(...samples.map((s) => s.ttft), h.ttft.p90 || 0, 1e-3);
  const f = frame(node, max * 1.1, fmtSeconds, samples.length ? null : "no requests yet");
  if (!f) return;
  const n = samples.length;
  const x = (i) => PAD.l + 6 + ((W - PAD.l - PAD.r - 12) * i) / Math.max(n - 1, 1);
  for (const [p, label] of [[h.ttft.p50, "p50"], [h.ttft.p90, "p90"]]) {
    if (p === null) continue;
    f.svg.append(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: f.y(p), y2: f.y(p), class: "p-line" }));
    f.svg.append(svgEl("text", { x: W - PAD.r, y: f.y(p) - 3, "text-anchor": "end" }, label));
  }
  samples.forEach((s, i) => {
    const kind = s.full_prefill ? "full" : s.blended ? "blend" : "plain";
    const dot = svgEl("circle", { cx: x(i), cy: f.y(s.ttft), r: 3, class: `dot-${kind}` });
    dot.append(svgEl("title", {}, `${fmtSeconds(s.ttft)}, ${s.prompt_tokens} prompt tokens, ${kind}`));
    f.svg.append(dot);
  });
  let lx = PAD.l;
  for (const [kind, label] of [["blend", "blended"], ["plain", "plain"], ["full", "blend as full prefill"]]) {
    f.svg.append(svgEl("circle", { cx: lx + 3, cy: H - 9, r: 3, class: `dot-${kind}` }));
    f.svg.append(svgEl("text", { x: lx + 9, y: H - 5 }, label));
    lx += 14 + 6.2 * label.length;
  }
}

function drawTiers(node, tiers) {
  const order = ["device", "memory", "store", "missed"];
  const total = order.reduce((s, k) => s + tiers.chunks[k], 0);
  clear(node);
  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  node.append(svg);
  if (!total) {
    svg.append(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" },
      "no blended requests yet"));
    return;
  }
  const barW = W - 190;
  order.forEach((k, i) => {
    const v = tiers.chunks[k];
    const y = 14 + i * 36;
    svg.append(svgEl("text", { x: 0, y: y + 15 }, k === "missed" ? "computed (miss)" : k));
    svg.append(svgEl("rect", { x: 100, y, width: barW, height: 22, class: "grid", fill: "#f1f3f5" }));
    svg.append(svgEl("rect", { x: 100, y, width: (barW * v) / total, height: 22, class: `bar-${k}` }));
    svg.append(svgEl("text", { x: 104 + (barW * v) / total, y: y + 15 },
      `${v} (${fmtPct(v / total)})`));
  });
}

function drawAudits(node, audit) {
  const samples = audit.samples;
  const max = Math.max(...samples.map((s) => s.kl), audit.warn_kl || 0, 1e-4);
  const empty = samples.length ? null : audit.rate > 0 ? "no audit yet (audits run when idle)"
    : "audits are off";
  const f = frame(node, max * 1.15, (v) => v.toFixed(v < 0.1 ? 3 : 2), empty);
  if (!f) return;
  const n = samples.length;
  const x = (i) => PAD.l + 6 + ((W - PAD.l - PAD.r - 12) * i) / Math.max(n - 1, 1);
  if (audit.warn_kl) {
    const yw = f.y(audit.warn_kl);
    f.svg.append(svgEl("line", { x1: PAD.l, x2: W - PAD.r, y1: yw, y2: yw, class: "warn" }));
    f.svg.append(svgEl("text", { x: W - PAD.r, y: yw - 3, "text-anchor": "end" }, "warn"));
  }
  samples.forEach((s, i) => {
    const dot = svgEl("circle", { cx: x(i), cy: f.y(s.kl), r: 3,
      class: s.kl > audit.warn_kl ? "kl-bad" : "kl-ok" });
    dot.append(svgEl("title", {}, `KL ${s.kl.toFixed(4)} nats, top-1 ${s.top1_agree ? "agrees" : "differs"}`));
    f.svg.append(dot);
  });
}

// ------------------------------------------------------------------ wiring
function wire() {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => selectTab(tab.dataset.tab));
  }
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    state.key = $("key-input").value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.key);
    $("key-input").value = "";
    if (await loadInfo()) selectTab(document.querySelector('.tab[aria-selected="true"]').dataset.tab);
  });
  $("key-button").addEventListener("click", () => askForKey(""));
  $("ask-form").addEventListener("submit", ask);
  $("stop-button").addEventListener("click", () => state.abort && state.abort.abort());
  for (const radio of document.querySelectorAll('input[name="mode"]')) {
    radio.addEventListener("change", onModeChange);
  }
  $("add-doc").addEventListener("click", () => addDocument("", ""));
  $("doc-files").addEventListener("change", (e) => {
    readDroppedFiles(e.target.files);
    e.target.value = "";
  });
  const zone = $("drop-zone");
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    readDroppedFiles(e.dataTransfer.files);
  });
  $("shade").addEventListener("change", applyShade);
  $("tokens").addEventListener("mouseover", onTokenHover);
  $("tokens").addEventListener("mouseleave", () => show($("tooltip"), false));
  let filterTimer = null;
  $("store-filter").addEventListener("input", () => {
    clearTimeout(filterTimer);
    filterTimer = setTimeout(() => {
      state.store.q = $("store-filter").value.trim();
      state.store.offset = 0;
      loadStore();
    }, 250);
  });
  $("store-prev").addEventListener("click", () => {
    state.store.offset = Math.max(0, state.store.offset - state.store.limit);
    loadStore();
  });
  $("store-next").addEventListener("click", () => {
    state.store.offset += state.store.limit;
    loadStore();
  });
  loadInfo();
}

document.addEventListener("DOMContentLoaded", wire);

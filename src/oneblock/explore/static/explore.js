// oneblock explore: draws what the server (or the data embedded by --html) computed. No framework, no network
// beyond this page's own server. Every string that comes from the model is set with textContent, never as HTML.
"use strict";

const state = { card: null, analysis: null, ids: null, targetIds: null, weights: {}, logits: null };
const $ = (id) => document.getElementById(id);

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

// {"shape", "b64"}: little-endian float32, as oneblock.explore.analysis.pack writes it.
function unpack(packed) {
  const bin = atob(packed.b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return { shape: packed.shape, data: new Float32Array(bytes.buffer) };
}

function shown(piece) {
  return piece.replace(/ /g, "\u00b7").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5");
}

function shape(dims) {
  return "(" + dims.join(", ") + ")";
}

function fmt(n) {
  return n.toLocaleString("en-US");
}

function setStatus(s, text) {
  const node = $("status");
  node.dataset.state = s;
  node.textContent = text || s;
}

function showError(message) {
  const node = $("error");
  node.hidden = !message;
  node.textContent = message || "";
}

// ---- the model card: header, parameters, checks ----

function renderCard(card) {
  state.card = card;
  const p = card.parameters;
  $("model-line").textContent = `${card.name} (${card.source}): ${card.arch}, ${fmt(p.actual)} parameters, ` +
    `${card.dtype}, tokenizer ${card.tokenizer}; up to ${card.limits.max_tokens} tokens`;
  $("target-row").hidden = card.arch !== "encoder-decoder" || isStatic();
  const r = p.rule;
  $("rule").textContent = `Exact: ${fmt(p.total)} parameters (the loaded model holds ${fmt(p.actual)}). ` +
    `One block: ${fmt(r.exact_per_block)} exact against the rule 12 C\u00b2 = 12 \u00d7 ${r.d_model}\u00b2 = ` +
    `${fmt(r.per_block)} (ratio ${r.ratio.toFixed(3)}); ${r.blocks} blocks \u00d7 12 C\u00b2 = ${fmt(r.stack)} ` +
    `against ${fmt(r.non_embedding)} non-embedding parameters.`;
  barList($("params"), p.bars.map((b) => ({ label: b.name, value: b.share, text: `${fmt(b.count)} (${(100 * b.share).toFixed(1)}%)` })));
  renderDifferences(p.differences);
  const list = clear($("checks"));
  for (const c of card.checks) {
    const item = el("li", c.passed ? "check pass" : "check fail");
    item.dataset.passed = String(c.passed);
    item.appendChild(el("span", "mark", c.passed ? "\u2713" : "\u2717"));
    item.appendChild(el("strong", null, c.name));
    item.appendChild(el("span", "detail", " " + c.detail));
    list.appendChild(item);
  }
  $("generate-controls").hidden = !card.generation || isStatic();
}

// One row per option in which the block departs from the lesson's, with the parameters it adds or removes.
function renderDifferences(rows) {
  const body = clear($("differences").tBodies[0]);
  if (!rows.length) {
    const only = el("tr", "same");
    only.appendChild(el("td", null, "The block is the lesson's: no option differs."));
    body.appendChild(only);
    return;
  }
  for (const r of rows) {
    const row = el("tr", "difference");
    row.dataset.key = r.key;
    row.appendChild(el("td", null, r.label));
    const figure = r.parameters === null ? "n/a" : (r.parameters > 0 ? "+" : "") + fmt(r.parameters);
    row.appendChild(el("td", "count", figure));
    row.appendChild(el("td", "hint", r.note));
    body.appendChild(row);
  }
}

function barList(container, rows) {
  clear(container);
  const top = Math.max(...rows.map((r) => r.value), 1e-12);
  for (const r of rows) {
    const row = el("div", "bar");
    row.appendChild(el("span", "bar-label", r.label));
    const track = el("span", "bar-track");
    const fill = el("span", "bar-fill");
    fill.style.width = (100 * r.value / top).toFixed(2) + "%";
    track.appendChild(fill);
    row.appendChild(track);
    row.appendChild(el("span", "bar-value", r.text));
    if (r.data) Object.assign(row.dataset, r.data);
    container.appendChild(row);
  }
}

// ---- one analysis: tokens, block, attention, next token, lens ----

function renderTokens(container, tokens) {
  clear(container);
  tokens.forEach((t, i) => {
    const chip = el("span", "token");
    chip.dataset.id = t.id;
    chip.title = `position ${i}, id ${t.id}`;
    chip.appendChild(el("span", "piece", shown(t.piece)));
    chip.appendChild(el("sub", "tid", String(t.id)));
    container.appendChild(chip);
  });
}

function renderBlock(block) {
  const root = clear($("block"));
  $("block-note").textContent = `${block.norm_caption}, ${block.ffn} feed-forward, ` +
    `${block.position} positions; B = 1 for this input.`;
  for (const stack of block.stacks) {
    const col = el("div", "stack");
    col.appendChild(el("h3", null, `${stack.name}: ${stack.layers} \u00d7 this block, ${stack.tokens} tokens`));
    col.appendChild(el("div", "box io", `embeddings ${shape([1, stack.tokens, state.card.config.d_model])}`));
    const frame = el("div", "frame");
    for (const sub of stack.sublayers) {
      const group = el("div", "sublayer " + sub.name);
      for (const step of sub.steps) {
        const box = el("div", "box " + step.op, step.label);
        if (step.shape) box.appendChild(el("span", "shape", " " + shape(step.shape)));
        if (step.shapes) {
          const dl = el("div", "shapes");
          for (const [name, dims] of Object.entries(step.shapes)) dl.appendChild(el("div", null, `${name} ${shape(dims)}`));
          box.appendChild(dl);
        }
        group.appendChild(box);
      }
      frame.appendChild(group);
    }
    col.appendChild(frame);
    if (block.final_norm) col.appendChild(el("div", "box norm", `final ${block.norm}`));
    if (stack.name !== "encoder" && block.head) col.appendChild(el("div", "box io", `LM head \u2192 logits ${shape(block.head)}`));
    root.appendChild(col);
  }
}

function labelsFor(which) {
  const a = state.analysis;
  if (which === "target") return a.target_tokens;
  return a.tokens;
}

function fillSelect(select, n, prefix) {
  const keep = Number(select.value) || 0;
  clear(select);
  for (let i = 0; i < n; i++) select.appendChild(el("option", null, `${prefix}${i}`)).value = String(i);
  select.value = String(Math.min(keep, n - 1));
}

function renderAttentionControls() {
  const groups = state.analysis.attention;
  const sel = $("attn-group");
  const keep = sel.value;
  clear(sel);
  for (const g of groups) sel.appendChild(el("option", null, g.label)).value = g.name;
  sel.value = groups.some((g) => g.name === keep) ? keep : groups[0].name;
  state.weights = {};
  for (const g of groups) state.weights[g.name] = unpack(g.weights);
  selectGroup();
}

function selectGroup() {
  const w = state.weights[$("attn-group").value];
  fillSelect($("attn-layer"), w.shape[0], "");
  fillSelect($("attn-head"), w.shape[1], "");
  renderHeatmap();
}

function color(v) {
  const light = 100 - 62 * Math.sqrt(Math.min(Math.max(v, 0), 1));
  return `hsl(222, 80%, ${light.toFixed(1)}%)`;
}

function renderHeatmap() {
  const name = $("attn-group").value;
  const group = state.analysis.attention.find((g) => g.name === name);
  const w = state.weights[name];
  const [, H, T, S] = w.shape;
  const layer = Number($("attn-layer").value), head = Number($("attn-head").value);
  const rows = labelsFor(group.rows), cols = labelsFor(group.cols);
  const causal = name === "decoder" || (name === "self" && state.card.arch === "decoder");
  const size = Math.max(6, Math.min(30, Math.floor(620 / S)));
  const map = clear($("heatmap"));
  map.style.gridTemplateColumns = `max-content repeat(${S}, ${size}px)`;
  map.style.gridAutoRows = `${size}px`;
  map.dataset.rows = T;
  map.dataset.cols = S;
  map.dataset.layer = layer;
  map.dataset.head = head;
  map.appendChild(el("div", "corner", "query \u2193 key \u2192"));
  for (let s = 0; s < S; s++) map.appendChild(el("div", "col-label", shown(cols[s].piece))).title = `key ${s}`;
  const base = (layer * H + head) * T * S;
  for (let t = 0; t < T; t++) {
    map.appendChild(el("div", "row-label", shown(rows[t].piece)));
    for (let s = 0; s < S; s++) {
      const v = w.data[base + t * S + s];
      const cell = el("div", causal && s > t ? "cell masked" : "cell");
      cell.dataset.row = t;
      cell.dataset.col = s;
      cell.dataset.value = String(v);
      if (!(causal && s > t)) cell.style.background = color(v);
      map.appendChild(cell);
    }
  }
  map.onmouseover = (event) => {
    const c = event.target.closest(".cell");
    if (!c) return;
    const t = Number(c.dataset.row), s = Number(c.dataset.col);
    $("cell-info").textContent = `query ${t} '${shown(rows[t].piece)}' \u2192 key ${s} '${shown(cols[s].piece)}': ` +
      Number(c.dataset.value).toFixed(4) + (causal && s > t ? " (the future: masked)" : "");
  };
}

// softmax(logits / T) over the whole vocabulary, for the top ids (their order does not depend on T).
function tempered(logits, temperature, ids) {
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) if (logits[i] > max) max = logits[i];
  let sum = 0;
  for (let i = 0; i < logits.length; i++) sum += Math.exp((logits[i] - max) / temperature);
  return ids.map((id) => Math.exp((logits[id] - max) / temperature) / sum);
}

function renderNext() {
  const next = state.analysis.next_token;
  const section = $("next-section");
  section.classList.toggle("absent", !next);
  if (!next) {
    $("next-note").textContent = "An encoder has no LM head: there is no next token to predict.";
    clear($("bars"));
    $("next-controls").hidden = true;
    return;
  }
  $("next-controls").hidden = false;
  $("next-note").textContent = `The ${next.top.length} most likely next tokens after the last position, ` +
    "softmax(logits / T) over the whole vocabulary, recomputed here as the slider moves.";
  state.logits = unpack(next.logits).data;
  renderBars();
}

function renderBars() {
  const next = state.analysis.next_token;
  if (!next) return;
  const temperature = Number($("temperature").value);
  $("temperature-value").textContent = temperature.toFixed(2);
  const ids = next.top.map((t) => t.id);
  const probs = tempered(state.logits, temperature, ids);
  barList($("bars"), next.top.map((t, i) => ({
    label: `'${shown(t.piece)}' ${t.id}`,
    value: probs[i],
    text: probs[i].toFixed(4),
    data: { id: String(t.id), prob: String(probs[i]) },
  })));
  $("bars").dataset.temperature = String(temperature);
}

function renderLens() {
  const lens = state.analysis.lens;
  const tokens = state.analysis.target_tokens || state.analysis.tokens;
  const table = clear($("lens"));
  $("lens-note").textContent = lens.predictions
    ? "Each row: the final norm and the LM head applied to the residual stream after that layer; each cell the " +
      "token that position would predict next if the stack stopped there (shade = its probability)."
    : "An encoder has no LM head, so no lens; the residual norms below still show the stream.";
  if (lens.predictions) {
    const head = table.appendChild(el("tr"));
    head.appendChild(el("th", null, "layer \\ position"));
    tokens.forEach((t) => head.appendChild(el("th", "lens-token", shown(t.piece))));
    lens.predictions.forEach((row, l) => {
      const tr = table.appendChild(el("tr"));
      tr.appendChild(el("th", null, lens.layers[l]));
      for (const p of row) {
        const td = el("td", "lens-cell", shown(p.piece));
        td.title = `id ${p.id}, p = ${p.prob.toFixed(3)}`;
        td.dataset.id = p.id;
        td.dataset.prob = String(p.prob);
        td.style.background = `hsla(150, 60%, 45%, ${(0.08 + 0.8 * p.prob).toFixed(3)})`;
        tr.appendChild(td);
      }
    });
  }
  barList($("norms"), lens.layers.map((name, l) => {
    const row = lens.residual_norm[l];
    const mean = row.reduce((a, b) => a + b, 0) / row.length;
    return { label: name, value: mean, text: mean.toFixed(2), data: { norm: String(mean) } };
  }));
}

function renderAnalysis(a) {
  state.analysis = a;
  state.ids = a.tokens.map((t) => t.id);
  state.targetIds = a.target_tokens ? a.target_tokens.map((t) => t.id) : null;
  renderTokens($("tokens"), a.tokens);
  $("tokens-note").textContent = `${a.tokens.length} tokens` + (a.target_tokens ? ` in the source, ${a.target_tokens.length} in the decoder` : "");
  $("target-tokens-wrap").hidden = !a.target_tokens;
  if (a.target_tokens) renderTokens($("target-tokens"), a.target_tokens);
  renderBlock(a.block);
  renderAttentionControls();
  renderNext();
  renderLens();
}

// ---- talking to the server ----

function isStatic() {
  return document.getElementById("explore-data") !== null;
}

async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

function requestBody(fromState) {
  const body = { temperature: Number($("temperature").value) };
  if (fromState) {
    body.ids = state.ids;
    if (state.targetIds) body.target_ids = state.targetIds;
    return body;
  }
  body.text = $("text").value;
  if (state.card.arch === "encoder-decoder" && $("target").value.trim()) body.target = $("target").value;
  return body;
}

async function run(work) {
  setStatus("busy", "running the model\u2026");
  showError(null);
  try {
    await work();
    setStatus("ready", "ready");
  } catch (error) {
    showError(error.message);
    setStatus("error", "error");
  }
}

function analyzeText() {
  return run(async () => renderAnalysis(await post("api/analyze", requestBody(false))));
}

function generateOne() {
  return run(async () => {
    const body = requestBody(true);
    body.greedy = $("greedy").checked;
    body.seed = Number($("seed").value) || 0;
    const result = await post("api/generate", body);
    renderAnalysis(result.analysis);
    const a = result.analysis;
    if (a.target_text !== undefined) $("target").value = a.target_text;
    else $("text").value = a.text;
    $("generate-note").textContent = `appended '${shown(result.appended.piece)}' (id ${result.appended.id}, ` +
      (result.appended.greedy ? "greedy)" : `sampled, seed ${result.appended.seed})`);
  });
}

function wire() {
  $("input-form").addEventListener("submit", (event) => { event.preventDefault(); analyzeText(); });
  $("text").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); analyzeText(); }
  });
  $("attn-group").addEventListener("change", selectGroup);
  $("attn-layer").addEventListener("change", renderHeatmap);
  $("attn-head").addEventListener("change", renderHeatmap);
  $("temperature").addEventListener("input", renderBars);
  $("generate").addEventListener("click", generateOne);
}

async function start() {
  wire();
  if (isStatic()) {
    const data = JSON.parse($("explore-data").textContent);
    renderCard(data.card);
    $("text").value = data.text || data.analysis.text;
    $("text").readOnly = true;
    $("run").hidden = true;
    renderAnalysis(data.analysis);
    setStatus("ready", "static page: the text below was analysed when the file was written");
    return;
  }
  await run(async () => {
    const response = await fetch("api/card");
    renderCard(await response.json());
    renderAnalysis(await post("api/analyze", requestBody(false)));
  });
}

start();

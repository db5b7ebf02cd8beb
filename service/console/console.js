// padim inspection console: plain JavaScript against the service's own API (no build step, no CDN).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "padim-api-key";
const ADMIN_KEY_STORE = "padim-admin-key"; // session storage only; never in a URL
const REVIEW_KEY_STORE = "padim-review-key";
const REVIEW_BATCH = 50;
const MODEL_THRESHOLD = 0.5; // the model's threshold is 0.5 on the score scale, always
const HISTORY_LIMIT = 50;

const state = {
  models: [],
  record: false,        // the server keeps the inspection record (its review queue is shown)
  lines: false,         // the server runs lines (PADIM_LINES): its Lines panel is shown
  model: null,          // name
  threshold: MODEL_THRESHOLD,
  current: null,        // a history entry: {id, name, file, url, result, roundTripMs}
  history: [],
  busy: 0,
  review: { on: false, queue: [], index: 0, urls: [] },  // the review queue of the record, when it is on
};
let nextId = 1;
let rescoreTimer = null;

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }
function adminKey() { return sessionStorage.getItem(ADMIN_KEY_STORE) || ""; }
function reviewKey() { return sessionStorage.getItem(REVIEW_KEY_STORE) || ""; }

// which key a call carries: admin routes the admin key; reviews the review key (or the admin key); reading the
// record any key given; everything else the API key
function keyFor(options) {
  if (options.admin) return adminKey();
  if (options.review) return reviewKey() || adminKey();
  if (options.record) return reviewKey() || apiKey() || adminKey();
  return apiKey();
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = keyFor(options);
  if (key) headers.set("X-API-Key", key);
  const response = await fetch(path, { ...options, headers });
  let body = null;
  try { body = await response.json(); } catch (_) { /* not JSON */ }
  if (!response.ok) {
    const error = new Error(body && body.error ? body.error.message : `HTTP ${response.status}`);
    error.status = response.status;
    error.code = body && body.error ? body.error.code : "http_error";
    throw error;
  }
  return body;
}

function showError(message) {
  const box = $("error");
  box.textContent = message || "";
  box.hidden = !message;
}

function explain(error) {
  if (error.status === 401) {
    $("key-section").classList.add("needed");
    $("api-key").focus();
    return "This server needs an API key: enter it on the left (it is kept for this tab only).";
  }
  if (error.status === 503 && error.code === "loading") return "The models are still loading; try again in a moment.";
  return error.message;
}

// ------------------------------------------------------------------------------------ models
async function loadModels() {
  try {
    const ready = await fetch("/health/ready");
    const readiness = await ready.clone().json().catch(() => ({}));
    state.lines = "lines" in readiness; // only with PADIM_LINES
    const on = readiness.replica ? ` on replica ${readiness.replica}` : ""; // behind a balancer: which one answered
    loadLines();
    if (!ready.ok) {
      $("server").textContent = "models loading…";
      setTimeout(loadModels, 1000);
      return;
    }
    const listing = await api("/models");
    state.models = listing.models;
    state.record = Boolean(listing.record);
    $("review").hidden = !state.record;
    const select = $("model");
    select.replaceChildren(...listing.models.map((m) => {
      const option = document.createElement("option");
      option.value = m.name;
      option.textContent = `${m.name} v${m.version} — ${m.backbone}, ${describeInput(m)}`;
      return option;
    }));
    select.disabled = false;
    const wanted = sessionStorage.getItem("padim-model");
    select.value = listing.models.some((m) => m.name === wanted) ? wanted : listing.default;
    chooseModel(select.value);
    $("server").textContent = `${listing.models.length} model${listing.models.length === 1 ? "" : "s"} ready${on}`;
    showError("");
  } catch (error) {
    $("server").textContent = "not connected";
    showError(explain(error));
  }
}

// "224 px", or "2x2 tiles of 224 px (448x448)" for a tiled model
function describeInput(m) {
  const tiles = m.tiles || [1, 1];
  if (tiles[0] * tiles[1] === 1) return `${m.image_size} px`;
  const shape = m.input_shape || [];
  return `${tiles[0]}x${tiles[1]} tiles of ${m.image_size} px (${shape[1]}x${shape[0]}, ${m.tile_statistics} statistics)`;
}

// What the promise covers: the changes declared (train --expect), or those the training pictures showed (auto)
function describeCover(c) {
  const m = c.measured;
  const bounds = (c.expect || "").replaceAll(",", ", ");  // a line that wraps in the panel
  if (m) {
    const placement = m.shift === null ? "placement as rough's (a texture)" :
      `placement ${m.shift.toFixed(1)} px, ${m.rotate.toFixed(1)}°`;
    return ` Covers ${bounds || "no change"}: 1.5x what ${m.pictures} training pictures showed (light ` +
      `${pct(m.brightness)}, contrast ${pct(m.contrast)}, ${placement}, blur ${m.blur.toFixed(2)} px` +
      `${m.jpeg === null ? "" : `, JPEG ${m.jpeg}`}).`;
  }
  return bounds ? ` Covers the declared changes ${bounds}.` : " Covers pictures like the training pictures only.";
}

// A model fitted at bf16/fp16 (train --precision) or an export's int8/fp16/bf16, with the gate's reading, what
// this machine runs it at where that differs, and the batch sizes replayed from CUDA graphs.
function describePrecision(m) {
  const graphs = (m.cuda_graphs || []).length ? `, CUDA graphs for batches of ${m.cuda_graphs.join(", ")}` : "";
  return describeArithmetic(m) + (m.runs_at ? ` (runs at ${m.runs_at} here: this CPU has no bfloat16)` : "") + graphs;
}

function describeArithmetic(m) {
  if (!m.precision || m.precision === "float32") return "";
  const own = m.int8_scorer;  // a float32 model's int8 scorer, which --runtime auto chose for this CPU
  const check = m.precision_check || (own && own.check);
  if (!check) return ` at ${m.precision}`;
  const within = (100 * check.max_score_error).toFixed(2);
  return ` at ${m.precision}${own ? ": the model's int8 scorer, chosen for this CPU, with its own threshold" : ""}` +
    ` (scores within ${within}% of fp32's on ${check.images} training pictures` +
    `${check.forced ? ", past its tolerance: written with --force" : ""})`;
}

function chooseModel(name) {
  state.model = name;
  sessionStorage.setItem("padim-model", name);
  const model = state.models.find((m) => m.name === name);
  if (!model) return;
  loadMonitor();
  loadQueue();
  showVersions(model);
  const c = model.calibration;
  $("model-info").textContent =
    `Version ${model.version}. ${model.weights}. Fitted on ${model.fit_image_count} images; threshold promises ` +
    `${(100 * c.promised_false_alarm_rate).toFixed(2)}% false alarms ` +
    `(at most ${(100 * c.false_alarm_bound).toFixed(2)}% with ${(100 * c.confidence).toFixed(0)}% confidence). ` +
    `Runtime ${model.runtime}${describePrecision(model)}.` + describeCover(c) +
    (model.roi ? ` Scores the region x=${model.roi[0]}, y=${model.roi[1]}, ${model.roi[2]}x${model.roi[3]} px only.` : "") +
    ((model.tiles || [1, 1])[0] * (model.tiles || [1, 1])[1] > 1 ? ` Input: ${describeInput(model)}.` : "");
  const demo = /random/i.test(model.weights);
  $("demo-warning").hidden = !demo;
  $("demo-warning").textContent = demo ? "RANDOM WEIGHTS — demo only: these verdicts say nothing about real parts." : "";
}

// ---------------------------------------------------------------------------------- versions
function showVersions(model) {
  const list = $("version-list");
  list.replaceChildren(...(model.versions || []).map((v) => {
    const item = document.createElement("li");
    item.dataset.version = v.version;
    item.textContent = `v${v.version}${v.active ? " (active)" : ""} — ${v.created.replace("T", " ").replace("Z", " UTC")}, ` +
      `${v.source}, sha256 ${v.sha256.slice(0, 12)}…` +
      (v.calibration ? `, threshold promises ${(100 * v.calibration.promised_false_alarm_rate).toFixed(2)}%` : "") +
      describeLine(v.update);
    if (v.active) item.className = "active";
    return item;
  }));
  $("line-threshold").hidden = !state.record;
}

// A version whose threshold the line set: from how many pictures, what it replaced, what it buys on reviewed defects
function describeLine(update) {
  if (!update || update.kind !== "line_threshold") return "";
  const g = update.gate;
  const recall = g.defects ? `; recall on ${g.defects} reviewed defects ${pct(g.recall_old)} → ${pct(g.recall_new)}` : "";
  const cover = update.replaces.expect ? ` (covering ${update.replaces.expect})` : "";
  return ` — threshold set by ${update.line.pictures} line pictures: raw ${update.threshold.old.toFixed(2)}${cover} → ` +
    `${update.threshold.new.toFixed(2)}${recall}`;
}

function pct(value) {
  return value === null || value === undefined ? "–" : `${(100 * value).toFixed(0)}%`;
}

async function sizeByLine() {
  if (!state.model) return;
  if (!adminKey()) { $("version-message").textContent = "Enter the admin key first."; $("admin-key").focus(); return; }
  try {
    const proposal = await api(`/models/${encodeURIComponent(state.model)}/threshold`, { method: "POST", admin: true });
    $("version-message").textContent = `Version ${proposal.version} proposed (not active): ` +
      describeLine(proposal).replace(/^ — /, "") + `. Activate it with POST /models/${proposal.model}/versions/` +
      `${proposal.version}/activate or padim repository activate.`;
    await loadModels();
  } catch (error) {
    $("version-message").textContent = error.status === 401 || error.status === 403 ? "That is not the admin key." : error.message;
  }
}

async function rollBack() {
  if (!state.model) return;
  if (!adminKey()) { $("version-message").textContent = "Enter the admin key first."; $("admin-key").focus(); return; }
  if (!window.confirm(`Roll ${state.model} back to the version active before the current one?`)) return;
  try {
    const change = await api(`/models/${encodeURIComponent(state.model)}/rollback`, { method: "POST", admin: true });
    $("version-message").textContent = `${change.model} is back on version ${change.version}.`;
    await loadModels();
  } catch (error) {
    $("version-message").textContent = error.status === 404 && error.code === "not_found"
      ? "This server has no admin routes (it runs without PADIM_ADMIN_KEY)."
      : error.status === 401 || error.status === 403 ? "That is not the admin key." : error.message;
  }
}

// ------------------------------------------------------------------------------ review queue
async function loadQueue() {
  if (!state.model || !state.record) return null;
  try {
    const page = await api(`/records/queue?model=${encodeURIComponent(state.model)}&limit=${REVIEW_BATCH}`, { record: true });
    $("review").hidden = false;
    $("review-count").textContent = `${page.records.length}${page.next ? "+" : ""} waiting`;
    return page.records;
  } catch (error) {
    if (error.status === 404) { $("review").hidden = true; return null; } // the record is off on this server
    $("review").hidden = false;
    $("review-count").textContent = "";
    $("review-message").textContent = error.status === 401 ? "Enter the review key (or the API key) to read the record." : explain(error);
    return null;
  }
}

async function blobUrl(path) {
  const headers = new Headers();
  const key = keyFor({ record: true });
  if (key) headers.set("X-API-Key", key);
  const response = await fetch(path, { headers });
  if (!response.ok) throw new Error(response.status === 410 ? "gone (evicted, or its version was deleted)" : `HTTP ${response.status}`);
  return URL.createObjectURL(await response.blob());
}

async function startReview() {
  const queue = await loadQueue();
  if (!queue) return;
  state.review = { on: true, queue, index: 0, urls: [] };
  $("empty").hidden = true;
  $("summary").hidden = true;
  $("views").hidden = true;
  $("review-view").hidden = false;
  $("review-message").textContent = queue.length ? "" : "Nothing waits for review.";
  await showReviewItem();
}

function stopReview() {
  state.review.urls.forEach((url) => URL.revokeObjectURL(url));
  state.review = { on: false, queue: [], index: 0, urls: [] };
  $("review-view").hidden = true;
  if (state.current) show(state.current); else $("empty").hidden = false;
  loadQueue();
}

async function showReviewItem() {
  const review = state.review;
  const row = review.queue[review.index];
  review.urls.forEach((url) => URL.revokeObjectURL(url));
  review.urls = [];
  if (!row) {
    $("review-verdict").textContent = "";
    $("review-verdict").className = "verdict";
    $("review-score").textContent = "";
    $("review-about").textContent = "";
    $("review-position").textContent = "";
    $("review-picture").removeAttribute("src");
    $("review-heatmap").removeAttribute("src");
    $("review-view").dataset.record = "";
    if (review.queue.length) $("review-message").textContent = "Queue done. Press v for more, Esc to stop.";
    return;
  }
  $("review-view").dataset.record = row.id;
  $("review-verdict").textContent = row.is_anomaly ? "FLAGGED" : "PASSED";
  $("review-verdict").className = `verdict ${row.is_anomaly ? "bad" : "ok"}`;
  $("review-score").textContent = row.score.toFixed(4);
  const fields = Object.entries(row.fields).map(([k, v]) => `${k} ${v}`).join(", ");
  $("review-about").textContent = `${row.model} v${row.version}, ${row.time.replace("T", " ").replace("Z", " UTC")}` +
    (fields ? `, ${fields}` : "") + (row.sampled ? " (a passed picture drawn for review)" : "");
  $("review-position").textContent = `${review.index + 1} of ${review.queue.length}`;
  try {
    const [picture, heatmap] = await Promise.all([blobUrl(`/records/${row.id}/image`), blobUrl(`/records/${row.id}/heatmap`)]);
    if (state.review.queue[state.review.index] !== row) { URL.revokeObjectURL(picture); URL.revokeObjectURL(heatmap); return; }
    review.urls = [picture, heatmap];
    $("review-picture").src = picture;
    $("review-heatmap").src = heatmap;
  } catch (error) {
    $("review-message").textContent = `This picture cannot be shown: ${error.message}. Its row can still be reviewed.`;
  }
}

async function labelCurrent(label) {
  const review = state.review;
  const row = review.queue[review.index];
  if (!row) return;
  try {
    await api(`/records/${row.id}/review`, {
      method: "POST", review: true, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ label, reviewer: "console" }),
    });
    $("review-message").textContent = `Record ${row.id.slice(0, 12)}… reviewed: ${label}.`;
    review.index += 1;
    await showReviewItem();
  } catch (error) {
    $("review-message").textContent = error.status === 401 || error.status === 403
      ? "Reviewing needs the review key (PADIM_REVIEW_KEY) or the admin key: enter it on the left." : explain(error);
  }
}

function skipCurrent() {
  if (state.review.index < state.review.queue.length) { state.review.index += 1; showReviewItem(); }
}

// ----------------------------------------------------------------------------------- scoring
async function score(entry) {
  const params = new URLSearchParams({ heatmap: "true", mask: "true" });
  if (entry.result) params.set("monitor", "false"); // a second look at the same image: counted once
  if (Math.abs(state.threshold - MODEL_THRESHOLD) > 1e-9) params.set("threshold", state.threshold.toFixed(2));
  const started = performance.now();
  state.busy += 1;
  document.body.setAttribute("aria-busy", "true");
  try {
    const result = await api(`/models/${encodeURIComponent(entry.model)}/score?${params}`, {
      method: "POST",
      headers: { "Content-Type": entry.file.type && entry.file.type.startsWith("image/") ? entry.file.type : "application/octet-stream" },
      body: entry.file,
    });
    entry.result = result;
    entry.roundTripMs = performance.now() - started;
    entry.error = null;
  } catch (error) {
    entry.error = explain(error);
  } finally {
    state.busy -= 1;
    if (!state.busy) document.body.removeAttribute("aria-busy");
  }
  return entry;
}

async function addFiles(files) {
  const images = [...files].filter((f) => !f.type || f.type.startsWith("image/") || /\.(png|jpe?g|bmp|tiff?)$/i.test(f.name));
  if (!images.length) { showError("No image among what was given (png, jpg, bmp, tif)."); return; }
  if (!state.model) { showError("No model is loaded yet."); return; }
  showError("");
  for (const [i, file] of images.entries()) {
    $("server").textContent = images.length > 1 ? `scoring ${i + 1} of ${images.length}…` : "scoring…";
    const entry = { id: nextId++, name: file.name || "pasted image", file, url: URL.createObjectURL(file), model: state.model };
    await score(entry);
    state.history.unshift(entry);
    for (const old of state.history.splice(HISTORY_LIMIT)) URL.revokeObjectURL(old.url);
    show(entry);
  }
  $("server").textContent = "ready";
  loadMonitor();
}

function rescoreSoon() {
  clearTimeout(rescoreTimer);
  rescoreTimer = setTimeout(async () => {
    const entry = state.current;
    if (!entry) return;
    await score(entry);
    if (state.current === entry) show(entry);
  }, 150);
}

// ----------------------------------------------------------------------------------- display
function percent(x) { return `${(100 * x).toFixed(x < 0.001 && x > 0 ? 3 : 1)}%`; }

function show(entry) {
  if (state.review.on) stopReview();
  state.current = entry;
  renderHistory();
  $("empty").hidden = true;
  if (entry.error) {
    showError(`${entry.name}: ${entry.error}`);
    $("summary").hidden = true;
    $("views").hidden = true;
    return;
  }
  showError("");
  const r = entry.result;
  $("summary").hidden = false;
  $("views").hidden = false;
  const verdict = $("verdict");
  verdict.textContent = r.is_anomaly ? "ANOMALOUS" : "NORMAL";
  verdict.className = `verdict ${r.is_anomaly ? "bad" : "ok"}`;
  $("score").textContent = r.score.toFixed(4);
  $("score").dataset.value = String(r.score);
  $("area").textContent = percent(r.anomalous_area);
  $("area").dataset.value = String(r.anomalous_area);
  $("used-threshold").textContent = r.threshold.toFixed(2);
  $("legend-tick").style.left = `${(100 * r.threshold).toFixed(1)}%`;
  $("latency").textContent = `${r.latency_ms.toFixed(0)} ms on the server, ${entry.roundTripMs.toFixed(0)} ms round trip`;
  $("name").textContent = `${entry.name} · ${r.model.name}`;
  $("original").src = entry.url;
  $("under").src = entry.url;
  $("overlay").src = `data:image/png;base64,${r.heatmap}`;
  $("mask").src = `data:image/png;base64,${r.mask}`;
  applyView();
}

function applyView() {
  const masked = $("show-mask").checked;
  $("mask").hidden = !masked;
  $("overlay").hidden = masked;
  $("right-title").textContent = masked ? "mask (white: at or above the threshold)" : "heat map";
  $("overlay").style.opacity = $("opacity").value;
  $("mask").style.opacity = $("opacity").value;
}

function renderHistory() {
  const list = $("history");
  list.replaceChildren(...state.history.map((entry) => {
    const item = document.createElement("li");
    const button = document.createElement("button");
    button.type = "button";
    button.setAttribute("aria-current", String(entry === state.current));
    const thumb = document.createElement("img");
    thumb.src = entry.url;
    thumb.alt = "";
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = `${entry.id}. ${entry.name}`;
    title.title = entry.name;
    const tag = document.createElement("span");
    if (entry.error) {
      tag.className = "tag bad";
      tag.textContent = "error";
    } else {
      tag.className = `tag ${entry.result.is_anomaly ? "bad" : "ok"}`;
      tag.textContent = entry.result.score.toFixed(3);
    }
    button.append(thumb, title, tag);
    button.addEventListener("click", () => show(entry));
    item.append(button);
    return item;
  }));
}

function setThreshold(value) {
  state.threshold = Math.min(0.99, Math.max(0.01, Math.round(value * 100) / 100));
  $("threshold").value = String(state.threshold);
  $("threshold-value").textContent = state.threshold.toFixed(2);
  rescoreSoon();
}

// ------------------------------------------------------------------------------------ monitor
const MONITOR_REFRESH_MS = 5000;

async function loadMonitor() {
  if (!state.model) return;
  try {
    showMonitor(await api(`/models/${encodeURIComponent(state.model)}/monitor`));
  } catch (error) {
    $("monitor-verdict").textContent = `monitor unavailable: ${explain(error)}`;
  }
}

function showMonitor(m) {
  const status = $("monitor-status");
  status.textContent = m.status === "alarm" ? "ALARM" : m.status === "normal" ? "normal" : "collecting";
  status.className = `tag ${m.status === "alarm" ? "bad" : m.status === "normal" ? "ok" : "collecting"}`;
  status.dataset.status = m.status;
  $("monitor-verdict").textContent = m.verdict[0].toUpperCase() + m.verdict.slice(1);
  $("monitor-window").textContent = `Version ${m.version}: ${m.images.toLocaleString("en")} of the last ` +
    `${m.window.toLocaleString("en")} images kept since ${m.since.replace("T", " ").replace("Z", " UTC")} ` +
    "(a new version starts a new window); this server process only.";
  drawMonitor(m.histogram);
}

// the recent scores and the calibration's normal scores as shares per bin, the threshold a red line
function drawMonitor(h) {
  const canvas = $("monitor-plot");
  const g = canvas.getContext("2d");
  const w = canvas.width, ht = canvas.height, bottom = ht - 14;
  g.clearRect(0, 0, w, ht);
  const share = (counts) => { const n = counts.reduce((a, b) => a + b, 0); return counts.map((c) => (n ? c / n : 0)); };
  const recent = share(h.recent), normal = share(h.calibration);
  const top = Math.max(0.05, ...recent, ...normal);
  const bins = recent.length, bw = w / bins;
  for (let i = 0; i < bins; i++) {
    g.fillStyle = "rgba(140, 149, 159, .55)";
    const hn = (bottom - 4) * normal[i] / top;
    g.fillRect(i * bw + 1, bottom - hn, bw - 2, hn);
    g.fillStyle = "rgba(9, 105, 218, .75)";
    const hr = (bottom - 4) * recent[i] / top;
    g.fillRect(i * bw + bw * 0.3, bottom - hr, bw * 0.4, hr);
  }
  const x = w * 0.5; // the model's threshold is 0.5 on the score scale
  g.fillStyle = "#cf222e";
  g.fillRect(x - 1, 0, 2, bottom);
  g.fillStyle = "#59636e";
  g.font = "11px system-ui, sans-serif";
  g.fillText("0", 2, ht - 2);
  g.fillText("score", w / 2 - 40, ht - 2);
  g.fillText("0.5", x + 3, ht - 2);
  g.fillText("1", w - 8, ht - 2);
}

// ------------------------------------------------------------------------------------ lines
const LINES_REFRESH_MS = 2000;
const lineShown = {}; // line name -> the id of the verdict whose picture is shown

async function loadLines() {
  if (!state.lines) return; // no PADIM_LINES: no /lines route to ask
  let answer;
  try {
    answer = await api("/lines");
  } catch (error) {
    $("lines").hidden = true; // no PADIM_LINES (404), or a key is missing: the panel is not shown
    return;
  }
  $("lines").hidden = answer.lines.length === 0;
  const list = $("line-list");
  for (const line of answer.lines) {
    let item = list.querySelector(`[data-line="${CSS.escape(line.name)}"]`);
    if (!item) {
      item = $("line-template").content.firstElementChild.cloneNode(true);
      item.dataset.line = line.name;
      list.append(item);
    }
    showLine(item, line);
  }
}

function showLine(item, line) {
  const up = ["watching", "connected"].includes(line.source.state) && !line.paused;
  item.querySelector(".line-name").textContent = line.name;
  const tag = item.querySelector(".line-state");
  tag.textContent = line.paused ? "paused" : line.source.state;
  tag.className = `tag line-state ${up ? "ok" : line.source.state === "ended" ? "collecting" : "bad"}`;
  item.querySelector(".line-rate").textContent = `${line.rate.toFixed(2)}/s`;
  const c = line.counts;
  item.querySelector(".line-counts").textContent = `${c.scored} scored, ${c.flagged} flagged, ${c.late} late, ` +
    `${c.rejected} rejected` + (c.deferred ? `, ${c.deferred} deferred` : "") + (line.source.reconnects ? `, ${line.source.reconnects} reconnects` : "");
  const last = line.last;
  item.querySelector(".line-last").textContent = last
    ? `last: ${last.verdict} (score ${last.score.toFixed(3)})${last.part ? `, part ${last.part}` : ""}, ` +
      `${last.latency_ms.toFixed(0)} ms`
    : (line.paused || "no picture yet");
  const sinks = item.querySelector(".line-sinks");
  sinks.replaceChildren(...line.sinks.map((sink) => {
    const li = document.createElement("li");
    const waiting = sink.outbox ? `, ${sink.outbox} waiting (oldest ${Math.round(sink.oldest_s)} s)` : "";
    li.textContent = `${sink.name}: ${sink.connected ? "connected" : "down"}${waiting}${sink.full ? ", FULL" : ""}`;
    if (!sink.connected || sink.full) li.className = "sink-down";
    return li;
  }));
  if (last && lineShown[line.name] !== last.id) {
    lineShown[line.name] = last.id;
    showLinePicture(item, line.name);
  }
}

async function showLinePicture(item, name) {
  try {
    const drawn = await api(`/lines/${encodeURIComponent(name)}/last`);
    const image = item.querySelector(".line-picture");
    image.src = `data:image/png;base64,${drawn.heatmap}`;
    image.hidden = false;
  } catch (error) { /* the next refresh tries again */ lineShown[name] = null; }
}

// ------------------------------------------------------------------------------------ wiring
function wire() {
  $("api-key").value = apiKey();
  $("api-key").addEventListener("change", (event) => {
    sessionStorage.setItem(KEY_STORE, event.target.value.trim());
    loadModels();
    loadLines();
  });
  $("admin-key").value = adminKey();
  $("admin-key").addEventListener("change", (event) => sessionStorage.setItem(ADMIN_KEY_STORE, event.target.value.trim()));
  $("rollback").addEventListener("click", rollBack);
  $("line-threshold").addEventListener("click", sizeByLine);
  $("review-key").value = reviewKey();
  $("review-key").addEventListener("change", (event) => {
    sessionStorage.setItem(REVIEW_KEY_STORE, event.target.value.trim());
    loadQueue();
  });
  $("review-start").addEventListener("click", startReview);
  $("model").addEventListener("change", (event) => {
    chooseModel(event.target.value);
    if (state.current) { state.current.model = state.model; rescoreSoon(); }
  });
  $("drop").addEventListener("click", () => $("file-input").click());
  $("file-input").addEventListener("change", (event) => { addFiles(event.target.files); event.target.value = ""; });
  const drop = $("drop");
  for (const type of ["dragenter", "dragover"]) {
    document.addEventListener(type, (event) => { event.preventDefault(); drop.classList.add("over"); });
  }
  for (const type of ["dragleave", "drop"]) {
    document.addEventListener(type, () => drop.classList.remove("over"));
  }
  document.addEventListener("drop", (event) => { event.preventDefault(); addFiles(event.dataTransfer.files); });
  document.addEventListener("paste", (event) => {
    if (event.clipboardData && event.clipboardData.files.length) addFiles(event.clipboardData.files);
  });
  $("threshold").addEventListener("input", (event) => setThreshold(Number(event.target.value)));
  $("threshold-reset").addEventListener("click", () => setThreshold(MODEL_THRESHOLD));
  $("opacity").addEventListener("input", applyView);
  $("show-mask").addEventListener("change", applyView);
  $("monitor-reset").addEventListener("click", async () => {
    if (!state.model || !window.confirm(`Forget the last images of ${state.model}? (The Prometheus counters keep counting.)`)) return;
    try { showMonitor(await api(`/models/${encodeURIComponent(state.model)}/monitor/reset`, { method: "POST" })); }
    catch (error) { showError(explain(error)); }
  });
  setInterval(() => { if (!document.hidden) loadMonitor(); }, MONITOR_REFRESH_MS);
  setInterval(() => { if (!document.hidden) loadLines(); }, LINES_REFRESH_MS);
  document.addEventListener("keydown", (event) => {
    const typing = ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement.tagName)
      && document.activeElement.type !== "range" && document.activeElement.type !== "checkbox";
    if (typing || event.ctrlKey || event.metaKey || event.altKey) return;
    if (state.review.on) {
      if (event.key === "n") labelCurrent("normal");
      else if (event.key === "d") labelCurrent("defect");
      else if (event.key === "s") skipCurrent();
      else if (event.key === "v") startReview();
      else if (event.key === "Escape") stopReview();
      else return;
      event.preventDefault();
      return;
    }
    if (event.key === "v" && !$("review").hidden) { startReview(); event.preventDefault(); }
    else if (event.key === "o") { $("file-input").click(); event.preventDefault(); }
    else if (event.key === "[") setThreshold(state.threshold - 0.01);
    else if (event.key === "]") setThreshold(state.threshold + 0.01);
    else if (event.key === "r") setThreshold(MODEL_THRESHOLD);
    else if (event.key === "m") { $("show-mask").checked = !$("show-mask").checked; applyView(); }
  });
  loadModels();
}

document.addEventListener("DOMContentLoaded", wire);

// Layer Offload web extension (plain ES module, no build step).
//
// The "Layer Offload" sidebar tab: the VRAM budget as a bar split by model, and one row per offloaded model with
// its kind, preset, priority, resident / streamed / disk blocks and bytes, a per-block chart of the last run
// (copy, compute and stall ms side by side, the tier as colour) and the overlap ratio and effective GB/s.
// Controls: each model's priority and the budget total (GB), sent to the POST routes of nodes/routes.py; a refused
// value shows its message in the panel (never a silent clamp). Toasts: pinning refused, resident set shrunk after
// an out-of-memory error, disk tier in use, a budget change refused; each notice once per model.
// Fed by GET /layer_offload/report when the tab opens and by the "layer_offload.report" server event.
// The Offload Report node shows its readable summary in a text widget after it runs.
//
// Stable DOM hooks (a contract: tests/comfyui/test_panel_browser.py relies on them):
//   [data-lo-panel]                     the panel's root
//   [data-lo-error]                     the panel's error message (empty and hidden when there is none)
//   [data-lo-budget]                    the budget bar (data-lo-used / data-lo-total: bytes); one
//                                       [data-lo-budget-model="<name>"] segment per model
//   input[data-lo-control="budget"]     the budget total in GB (Enter or leaving the field applies it)
//   [data-lo-legend]                    the legend; [data-lo-legend-tier="vram|pinned|pageable|disk"] swatches
//   [data-lo-devices]                   several devices only: one [data-lo-device-bar="<device>"] per device (its
//                                       budget: data-lo-used / data-lo-total bytes); [data-lo-legend-device] swatches
//   [data-lo-model="<name>"]            one row per offloaded model, holding:
//     input[data-lo-control="priority"] its priority (-100..100)
//     svg[data-lo-chart="blocks"]       the chart: one <g data-lo-block="<index>" data-lo-tier="<tier>"> per block
//                                       (data-lo-device="<device>" when the report names it)
//     [data-lo-model-device="<device>"]  several devices only: that device's resident blocks and bytes
//     [data-lo-figure="overlap|gbps|stall"]  the figures as plain numbers (units outside the element)
//     [data-lo-figure="step|predicted_step"]  ms per forward measured in the last runs, and the plan's prediction
//                                       for it (offload.predict's ring simulation); "-" while not known
//     [data-lo-count="resident|streamed|disk"]  block counts
//   [data-lo-plan]                      the workflow plan of the canvas (POST /layer_offload/plan), holding:
//     select[data-lo-control="plan-card"]  the card to plan on ("" = the card ComfyUI runs on)
//     button[data-lo-control="plan"]    plan now; input[data-lo-control="plan-auto"] re-plan when the graph changes
//     [data-lo-plan-state]              "idle|planning|done|error"; [data-lo-plan-error] the refusal's message
//     [data-lo-plan-run="fits|total|peak_vram|ram|ram_free|disk"]  the run's figures (data-lo-value: raw number)
//     [data-lo-plan-model="<key>"]      one row per model, [data-lo-plan-cell="fits|preset|vram|ram|disk|time"]
//     [data-lo-download-plan]           models the workflow links but this machine lacks (web/download_plan.js)
//   [data-lo-convert]                   "Offload this workflow": its hooks are listed in web/offload_convert.js
//   [data-lo-workflow]                  after an Offload Report node ran: the plan beside the run,
//     [data-lo-workflow-figure="time|peak_vram|host|disk"] (data-lo-planned / data-lo-measured: raw numbers),
//     [data-lo-workflow-model="<name>"] per offloaded model, [data-lo-workflow-note="times"] why the plan's times
//                                       are not this run's to compare (the simulated device, --cpu)
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { el } from "./dom.js";
import { downloadSection, planRequestExtras } from "./download_plan.js";
import { convertSection } from "./offload_convert.js";

const EVENT = "layer_offload.report";
const ROUTE = "/layer_offload/report";
const PRIORITY_ROUTE = "/layer_offload/priority";
const BUDGET_ROUTE = "/layer_offload/budget";
const PLAN_ROUTE = "/layer_offload/plan";
const PLAN_POLL_MS = 2000; // how often the canvas is compared with the last planned graph (auto re-plan)
const TAB_ID = "layer-offload";
const GIB = 1 << 30;
const MIB = 1 << 20;
const SVG_NS = "http://www.w3.org/2000/svg";

const TIERS = [
  { id: "vram", label: "VRAM (resident)", color: "#3fb950" },
  { id: "pinned", label: "pinned RAM", color: "#388bfd" },
  { id: "pageable", label: "pageable RAM", color: "#d29922" },
  { id: "disk", label: "disk", color: "#a371f7" },
];
const TIER_COLOR = Object.fromEntries(TIERS.map((t) => [t.id, t.color]));
const TIER_GRADIENT = `linear-gradient(90deg,${TIERS.map((t) => t.color).join(",")})`;
const STALL_COLOR = "#ff3b30";
const COMPUTE_OPACITY = 0.25; // compute bars: the tier colour, light fill with an outline
const DEVICE_COLORS = ["#e6edf3", "#f0883e", "#db61a2", "#2ea043", "#58a6ff", "#bc8cff"];
const MODEL_COLORS = ["#39c5cf", "#f778ba", "#e3b341", "#56d364", "#79c0ff", "#ffa657", "#d2a8ff", "#ff7b72"];
const NOTICES = {
  pinned_fallback: { severity: "warn", summary: "Pinned memory refused: pageable memory used" },
  oom_shrink: { severity: "warn", summary: "Resident set shrunk after an out-of-memory error" },
  disk_tier: { severity: "info", summary: "Disk tier in use" },
  lookahead_shrunk: { severity: "info", summary: "Lookahead shrunk" },
};

const state = {
  report: null, // the last report (GET, event or a POST answer)
  error: "", // the panel's error message
  reportError: false, // the error is a failed GET (cleared by the next one that works)
  invalid: null, // the key of the control whose value was refused
  drafts: new Map(), // control key -> text typed but not accepted yet
  open: new Set(), // models whose per-block table is open
  toasted: new Set(), // "<model>\0<notice kind>" already toasted
  views: new Set(), // panel roots to render into
};

const plan = {
  data: null, // the last answer of the plan route: {plan, card, card_note, ram_bytes, cards}
  error: "",
  busy: false,
  card: "", // the card chosen in the panel ("" = the card ComfyUI runs on)
  cards: [],
  auto: true,
  lastKey: null, // the graph and card last planned
  seq: 0,
  timer: null,
};

// helpers -----------------------------------------------------------------------------------------------------------
function svg(tag, attrs) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function num(v) {
  const n = Number(v);
  return Number.isFinite(n) ? n : 0;
}

function bytes(n) {
  n = num(n);
  return n >= GIB ? `${(n / GIB).toFixed(2)} GB` : `${(n / MIB).toFixed(1)} MB`;
}

function ms(v) {
  const n = num(v);
  return n >= 100 ? n.toFixed(0) : n >= 10 ? n.toFixed(1) : n.toFixed(2);
}

function swatch(color, extra) {
  return el("span", { class: "lo-swatch", style: `background:${color};${extra || ""}` });
}

// toasts ------------------------------------------------------------------------------------------------------------
function toast(severity, summary, detail, life = 8000) {
  const t = app.extensionManager?.toast;
  if (t && typeof t.add === "function") {
    try {
      t.add({ severity, summary, detail, life });
      return;
    } catch (e) {
      console.warn("Layer Offload: toast failed", e);
    }
  }
  let box = document.getElementById("lo-toasts");
  if (!box) {
    box = el("div", { id: "lo-toasts", class: "lo-toasts" });
    document.body.append(box);
  }
  const item = el("div", { class: `lo-toast lo-toast-${severity}`, role: "status", "data-lo-toast": severity },
    el("b", {}, summary), el("div", {}, detail || ""));
  item.addEventListener("click", () => item.remove());
  box.append(item);
  setTimeout(() => item.remove(), life);
}

function toastNotices(data) {
  for (const m of data?.models || []) {
    const notices = [...(m.notices || [])];
    if (num(m.tiers?.disk) > 0 && !notices.some((n) => n.kind === "disk_tier")) {
      notices.push({ kind: "disk_tier", message: `${m.tiers.disk} block(s) stream from the model's file.` });
    }
    for (const n of notices) {
      const key = `${m.name}\u0000${n.kind}`;
      if (state.toasted.has(key)) continue;
      state.toasted.add(key);
      const kind = NOTICES[n.kind] || { severity: "info", summary: n.kind };
      toast(kind.severity, `Layer Offload: ${kind.summary}`, `${m.name}: ${n.message}`);
    }
  }
}

// data flow ---------------------------------------------------------------------------------------------------------
function publish(data) {
  if (!data || typeof data !== "object" || !data.budget) return;
  state.report = data;
  renderAll();
  toastNotices(data);
}

function setError(message, key) {
  // a refused value stays in its control (marked) until corrected; clearing the error shows the real value again
  if (state.invalid && state.invalid !== key) state.drafts.delete(state.invalid);
  state.error = message || "";
  state.invalid = message ? key || null : null;
  renderAll();
}

async function refresh() {
  try {
    const r = await api.fetchApi(ROUTE, { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const data = await r.json();
    if (state.reportError) {
      state.reportError = false;
      if (!state.invalid) state.error = "";
    }
    publish(data);
  } catch (e) {
    console.warn("Layer Offload: report unavailable", e);
    setError(`The report is unavailable (${e.message || e}).`);
    state.reportError = true;
  }
}

async function post(route, body) {
  let r;
  try {
    r = await api.fetchApi(route, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
  } catch (e) {
    return { ok: false, error: `the server did not answer (${e.message || e})` };
  }
  try {
    const data = await r.json();
    if (r.ok && data.ok) return data;
    return { ok: false, error: data.error || `HTTP ${r.status}` };
  } catch (e) {
    return { ok: false, error: `HTTP ${r.status}` };
  }
}

async function submit(key, input) {
  const raw = input.value.trim();
  const isBudget = key === "budget";
  const what = isBudget ? "Budget" : `Priority of ${input.dataset.loFor}`;
  state.drafts.set(key, input.value);
  if (raw === "" || input.validity?.badInput || !Number.isFinite(Number(raw))) {
    setError(isBudget ? "Budget: enter the total in GB, a number (e.g. 6 or 7.5)."
      : `${what}: enter a whole number from -100 to 100.`, key);
    if (isBudget) toast("error", "Layer Offload: budget change refused", "not a number", 6000);
    return;
  }
  const data = isBudget
    ? await post(BUDGET_ROUTE, { total_gb: Number(raw) })
    : await post(PRIORITY_ROUTE, { model: input.dataset.loFor, priority: Number(raw) });
  if (!data.ok) {
    setError(`${what}: ${data.error}`, key);
    if (isBudget) toast("error", "Layer Offload: budget change refused", data.error, 8000);
    return;
  }
  state.drafts.delete(key);
  if (state.invalid) state.drafts.delete(state.invalid);
  state.error = "";
  state.invalid = null;
  publish(data.report);
}

function control(key, attrs, value) {
  const draft = state.drafts.get(key);
  const input = el("input", {
    ...attrs,
    type: "number",
    class: "lo-input" + (state.invalid === key ? " lo-invalid" : ""),
    "aria-invalid": state.invalid === key ? "true" : null,
    "data-lo-key": key,
  });
  input.value = draft !== undefined ? draft : value;
  input.addEventListener("input", () => state.drafts.set(key, input.value));
  input.addEventListener("keydown", (ev) => {
    ev.stopPropagation(); // typing here is not a canvas shortcut
    if (ev.key === "Enter") {
      ev.preventDefault();
      input.dataset.loSent = input.value;
      submit(key, input);
    } else if (ev.key === "Escape") {
      state.drafts.delete(key);
      input.blur();
      renderAll();
    }
  });
  input.addEventListener("change", () => {
    if (!input.isConnected || input.dataset.loSent === input.value) return; // Enter already sent it
    input.dataset.loSent = input.value;
    submit(key, input);
  });
  return input;
}

// rendering ---------------------------------------------------------------------------------------------------------
function renderAll() {
  for (const v of [...state.views]) {
    if (v.dataset.loMounted && !v.isConnected) state.views.delete(v);
    else render(v);
  }
}

function render(root) {
  const active = document.activeElement;
  const focusKey = active && root.contains(active) ? active.dataset?.loKey : null;
  root.replaceChildren(...panel(state.report));
  if (root.isConnected) root.dataset.loMounted = "1";
  if (focusKey) {
    const again = root.querySelector(`[data-lo-key="${CSS.escape(focusKey)}"]`);
    again?.focus();
  }
}

function panel(data) {
  const time = data?.time ? new Date(data.time * 1000).toLocaleTimeString() : "";
  const out = [el("div", { class: "lo-title" }, "Layer Offload", el("span", { class: "lo-muted" },
    time ? `updated ${time}` : ""))];
  out.push(el("div", { class: "lo-error", role: "alert", "data-lo-error": "", hidden: !state.error },
    el("span", {}, state.error),
    state.error ? el("button", { class: "lo-close", title: "Dismiss", "aria-label": "Dismiss",
      onclick: () => setError("") }, "×") : null));
  out.push(convertSection(() => plan.card)); // "Offload this workflow" (web/offload_convert.js), on the panel's card
  if (!data) {
    out.push(el("div", { class: "lo-muted" }, "Loading the report…"));
    return out;
  }
  const devices = deviceList(data);
  out.push(budgetSection(data.budget || {}));
  out.push(legend(devices));
  const models = data.models || [];
  if (!models.length) {
    out.push(el("div", { class: "lo-muted lo-empty" },
      "No offloaded model yet: run a prompt with an Offload loader or Offload Model node."));
  }
  for (const m of models) out.push(modelRow(m, devices));
  // the plan of the canvas (before a run) and the last run's plan beside its measured figures, after the models
  out.push(planSection());
  const check = workflowCheck(data.workflow);
  if (check) out.push(check);
  return out;
}

// the workflow plan (issue 34) ---------------------------------------------------------------------------------------
function seconds(msValue) {
  if (msValue === null || msValue === undefined || !Number.isFinite(Number(msValue))) return "-";
  const n = Number(msValue);
  if (n >= 60000) return `${(n / 60000).toFixed(1)} min`;
  if (n >= 1000) return `${(n / 1000).toFixed(1)} s`;
  return `${ms(n)} ms`;
}

function maybeBytes(v) {
  return v === null || v === undefined ? "-" : bytes(v);
}

async function canvasGraph() {
  const p = await app.graphToPrompt();
  return (p && p.output) || {};
}

async function requestPlan(force) {
  let graph;
  try {
    graph = await canvasGraph();
  } catch (e) {
    plan.error = `The canvas could not be read (${e.message || e}).`;
    renderPlan();
    return;
  }
  const key = JSON.stringify([graph, plan.card]);
  if (!force && key === plan.lastKey) return;
  plan.lastKey = key;
  const seq = ++plan.seq;
  if (!Object.keys(graph).length) {
    plan.data = null;
    plan.error = "";
    plan.busy = false;
    renderPlan();
    return;
  }
  plan.busy = true;
  renderPlan();
  const body = { prompt: graph, ...planRequestExtras(app) };
  if (plan.card) body.card = plan.card;
  const data = await post(PLAN_ROUTE, body);
  if (seq !== plan.seq) return; // a newer graph is being planned
  plan.busy = false;
  if (data.ok) {
    plan.data = data;
    plan.error = "";
    if (Array.isArray(data.cards) && data.cards.length) plan.cards = data.cards;
  } else {
    plan.error = data.error;
  }
  renderPlan();
}

function renderPlan() {
  // only the plan section: the model rows and their controls stay as they are while a plan comes and goes
  for (const v of [...state.views]) {
    const old = v.querySelector("[data-lo-plan]");
    if (old) old.replaceWith(planSection());
  }
}

function panelVisible() {
  return [...state.views].some((v) => v.isConnected && v.offsetParent !== null);
}

function startPlanWatch() {
  if (plan.timer) return;
  plan.timer = setInterval(() => {
    if (plan.auto && !plan.busy && panelVisible()) requestPlan(false);
  }, PLAN_POLL_MS);
}

function planState() {
  if (plan.busy) return "planning";
  if (plan.error) return "error";
  return plan.data ? "done" : "idle";
}

function planSection() {
  const select = el("select", { class: "lo-input lo-select", "data-lo-control": "plan-card",
    "aria-label": "The card to plan on", title: "Plan on the card ComfyUI runs on, or on another card by name" });
  const here = plan.data && !plan.card ? plan.data.card_note : "the card ComfyUI runs on";
  select.append(el("option", { value: "" }, `this machine: ${here}`));
  for (const name of plan.cards) select.append(el("option", { value: name }, name));
  select.value = plan.card;
  select.addEventListener("change", () => {
    plan.card = select.value;
    requestPlan(true);
  });
  const auto = el("input", { type: "checkbox", "data-lo-control": "plan-auto", checked: plan.auto,
    title: "Plan again when the workflow on the canvas changes" });
  auto.addEventListener("change", () => {
    plan.auto = auto.checked;
    if (plan.auto) requestPlan(false);
  });
  const button = el("button", { class: "lo-button", "data-lo-control": "plan", disabled: plan.busy,
    title: "Plan the workflow on the canvas: every model it loads, on the card, before it is queued (file headers " +
      "only: nothing loads)", onclick: () => requestPlan(true) }, plan.busy ? "Planning…" : "Plan workflow");
  const box = el("div", { class: "lo-section lo-plan", "data-lo-plan": "", "data-lo-plan-state": planState() },
    el("div", { class: "lo-line" }, el("b", {}, "Workflow plan"),
      el("label", { class: "lo-muted" }, auto, " auto")),
    el("div", { class: "lo-line lo-ctl" }, select, button),
    el("div", { class: "lo-error", role: "alert", "data-lo-plan-error": "", hidden: !plan.error }, plan.error));
  const p = plan.data && plan.data.plan;
  if (!p) {
    box.append(el("div", { class: "lo-muted" }, plan.busy ? "Planning the canvas…"
      : "Plans the workflow on the canvas before it runs: fits, preset, VRAM, RAM, disk and time per model."));
    return box;
  }
  const run = p.run || {};
  const ram = p.ram || {};
  const fig = (key, value, text) => el("b", { "data-lo-plan-run": key, "data-lo-value": value ?? "" }, text);
  box.append(el("div", { class: "lo-figures lo-plan-run" },
    el("span", {}, "fits ", fig("fits", run.fits ? 1 : 0, run.fits ? "yes" : "no")),
    el("span", {}, "run ", fig("total", run.total_ms, seconds(run.total_ms)),
      run.complete === false ? el("span", { class: "lo-muted" }, " (part not costed)") : null),
    el("span", {}, "peak VRAM ", fig("peak_vram", run.peak_vram_bytes, maybeBytes(run.peak_vram_bytes))),
    el("span", {}, "RAM ", fig("ram", ram.needed_bytes, maybeBytes(ram.needed_bytes)), " of ",
      fig("ram_free", ram.free_bytes, maybeBytes(ram.free_bytes)), " free"),
    el("span", {}, "disk ", fig("disk", ram.disk_bytes, maybeBytes(ram.disk_bytes)))));
  const rows = (p.models || []).map((m) => {
    const cell = (key, label, text, extra) => el("span", {}, label,
      el("b", { "data-lo-plan-cell": key, ...(extra || {}) }, text));
    const calls = num(m.calls);
    const time = m.ms_per_call === null || m.ms_per_call === undefined ? "-"
      : `${seconds(m.ms_per_call)}${calls > 1 ? ` x ${calls}` : ""}`;
    return el("div", { class: "lo-plan-model", "data-lo-plan-model": m.key,
      title: [m.path || m.name, ...(m.notes || [])].join("\n") },
    el("div", { class: "lo-wrap" }, el("b", {}, m.name || m.key), el("span", { class: "lo-muted" },
      ` ${[m.role, m.label || m.family].filter(Boolean).join(" · ")}`)),
    el("div", { class: "lo-figures" },
      cell("fits", "fits ", m.runs === false ? "not loaded" : !m.found ? "not found"
        : m.fits === true ? "yes" : m.fits === false ? "no" : "-",
        { class: m.runs === false ? "lo-muted" : m.fits === false || !m.found ? "lo-stall" : "" }),
      cell("preset", "", m.preset || "-"),
      cell("vram", "VRAM ", maybeBytes(m.vram_bytes), { title: `of which activations ${maybeBytes(m.activation_bytes)}` }),
      cell("ram", "RAM ", maybeBytes(m.host_bytes)),
      cell("disk", "disk ", maybeBytes(m.disk_bytes)),
      cell("time", "", time)));
  });
  box.append(el("div", { class: "lo-plan-models" }, rows));
  const notes = [...(p.notes || [])];
  if (p.graph && p.graph.read_whole === false) {  // what kept the reader from the whole graph
    notes.push(...(p.graph.unread || []).map((u) => `not read whole: ${u}`));
  }
  if (notes.length) {
    box.append(el("ul", { class: "lo-notices", "data-lo-plan-notes": "" }, notes.map((n) => el("li", {}, n))));
  }
  box.append(downloadSection(plan.data, plan.busy, () => requestPlan(true)) || "");
  const card = p.card || {};
  box.append(el("div", { class: "lo-muted" }, `on ${card.name || plan.data.card}` +
    (plan.card ? "" : ` (${plan.data.card_note})`)));
  return box;
}

function workflowCheck(w) {
  if (!w) return null;
  const pct = (off) => {
    if (off === null || off === undefined) return "";
    if (off >= 2) return ` (${(off + 1).toFixed(off >= 99 ? 0 : 1)}x the plan)`;
    return ` (${off >= 0 ? "+" : ""}${(100 * off).toFixed(0)}%)`;
  };
  // under --cpu the plan prices the simulated device at a table card's speeds while the CPU computes: its times
  // are shown, never flagged as a plan that was wrong (w.times_note says why)
  const line = (key, label, pair, fmt, comparable = true) => {
    pair = pair || {};
    return el("div", { class: "lo-line", "data-lo-workflow-figure": key, "data-lo-planned": pair.planned ?? "",
      "data-lo-measured": pair.measured ?? "" },
    el("span", { class: "lo-wrap" }, `${label}: planned ${fmt(pair.planned)} · measured ${fmt(pair.measured)}`,
      el("span", { class: comparable && Math.abs(num(pair.off_by)) > 0.3 ? "lo-stall" : "lo-muted" },
        comparable ? pct(pair.off_by) : "")));
  };
  const times = !w.times_note;
  const run = w.run || {};
  return el("div", { class: "lo-section lo-workflow", "data-lo-workflow": "" },
    el("div", { class: "lo-line" }, el("b", {}, "Plan beside the last run"),
      el("span", { class: "lo-muted" }, w.card ? `on ${w.card}` : "")),
    line("time", "time", w.time_ms, seconds, times),
    times ? null : el("div", { class: "lo-muted", "data-lo-workflow-note": "times" }, `(${w.times_note})`),
    line("peak_vram", "peak VRAM", w.peak_vram_bytes, maybeBytes),
    line("host", "host RAM", w.host_bytes, maybeBytes),
    line("disk", "disk", w.disk_bytes, maybeBytes),
    (w.models || []).map((r) => el("div", { class: "lo-muted", "data-lo-workflow-model": r.name },
      `${r.name}: ${(r.calls || {}).measured ?? "-"} of ${(r.calls || {}).planned ?? "-"} calls · ` +
      `${seconds((r.ms_per_call || {}).measured)} per call, planned ${seconds((r.ms_per_call || {}).planned)}` +
      (times ? pct((r.ms_per_call || {}).off_by) : ""))),
    el("div", { class: "lo-muted" }, `whole run as planned: ${seconds(run.total_ms)}, peak VRAM ` +
      `${maybeBytes(run.peak_vram_bytes)} (not measured here: ${seconds(run.unmeasured_ms)} of phases run by ` +
      "models ComfyUI keeps)"));
}

// several devices (issue 21): the devices the report names, the compute device first; [] with one device, so the
// single-device panel looks exactly as before
function deviceList(data) {
  const names = Object.keys(data?.budget?.devices || {});
  for (const m of (data?.models || []).filter(multiDevice)) {
    for (const d of Object.keys(m.devices)) if (!names.includes(d)) names.push(d);
  }
  return names.length > 1 ? names : [];
}

function deviceColor(devices, name) {
  const i = devices.indexOf(name);
  return i < 0 ? "#8b949e" : DEVICE_COLORS[i % DEVICE_COLORS.length];
}

function multiDevice(m) {
  return Object.keys(m.devices || {}).length > 1;
}

function deviceBars(b) {
  const devs = Object.entries(b.devices || {});
  if (devs.length < 2) return null;
  return el("div", { class: "lo-devices", "data-lo-devices": "" }, devs.map(([name, d]) => {
    const total = num(d.total_bytes);
    const used = num(d.used_bytes);
    const pct = total > 0 ? Math.min(100, (100 * used) / total) : 0;
    return el("div", { class: "lo-device" },
      el("div", { class: "lo-line" }, el("span", {}, el("b", {}, name), d.compute ? " (computes)" : ""),
        el("span", { class: "lo-muted" }, total > 0 ? `${bytes(used)} of ${bytes(total)}` : "not sized yet")),
      el("div", { class: "lo-bar lo-bar-thin", "data-lo-device-bar": name, "data-lo-used": used,
        "data-lo-total": total, role: "img", "aria-label": `${name}: ${bytes(used)} used of ${bytes(total)}` },
      el("div", { class: "lo-seg", style: `width:${pct.toFixed(2)}%;background:${DEVICE_COLORS[0]}` })));
  }));
}

function budgetSection(b) {
  const total = num(b.total_bytes);
  const used = num(b.used_bytes);
  const models = b.models || [];
  const bar = el("div", { class: "lo-bar", "data-lo-budget": "", "data-lo-used": used, "data-lo-total": total,
    role: "img", "aria-label": `VRAM budget: ${bytes(used)} used of ${bytes(total)}` });
  models.forEach((m, i) => {
    const pct = total > 0 ? (100 * num(m.used_bytes)) / total : 0;
    // a minimum width keeps a model with a tiny share visible; the numbers below are exact
    bar.append(el("div", { class: "lo-seg", "data-lo-budget-model": m.name,
      style: `width:${Math.min(100, pct).toFixed(2)}%;background:${MODEL_COLORS[i % MODEL_COLORS.length]}` }));
  });
  const shares = el("div", { class: "lo-shares" }, models.map((m, i) =>
    el("div", { class: "lo-share" }, swatch(MODEL_COLORS[i % MODEL_COLORS.length]),
      el("span", { class: "lo-wrap" }, el("b", {}, m.name),
        el("span", { class: "lo-muted" }, ` ${bytes(m.used_bytes)} (share ${bytes(m.share_bytes)})`)))));
  const input = control("budget", { "data-lo-control": "budget", min: 0, step: "any", inputmode: "decimal",
    "aria-label": "VRAM budget total in GB", title: "The VRAM budget total in GB; Enter applies it" },
  total > 0 ? String(Number((total / GIB).toFixed(total < GIB ? 3 : 2))) : "");
  return el("div", { class: "lo-section" },
    el("div", { class: "lo-line" }, el("b", {}, "VRAM budget"),
      el("span", {}, total > 0 ? `${bytes(used)} used of ${bytes(total)}` : "not sized yet")),
    bar,
    shares,
    deviceBars(b),
    el("label", { class: "lo-line lo-ctl" }, el("span", {}, "Total"),
      el("span", {}, input, " GB ", el("span", { class: "lo-muted" },
        `(min ${bytes(b.minimum_bytes)}; Enter applies)`))),
    b.origin ? el("div", { class: "lo-muted lo-origin" }, b.origin) : null);
}

function legend(devices) {
  return el("div", { class: "lo-legend", "data-lo-legend": "" },
    devices.length ? el("div", { class: "lo-legend-row" }, "Device:",
      devices.map((d) => el("span", { class: "lo-key", "data-lo-legend-device": d }, swatch(deviceColor(devices, d)),
        d))) : null,
    el("div", { class: "lo-legend-row" }, "Tier:",
      TIERS.map((t) => el("span", { class: "lo-key", "data-lo-legend-tier": t.id }, swatch(t.color), t.label))),
    el("div", { class: "lo-legend-row" }, "Per block:",
      el("span", { class: "lo-key" }, swatch(TIER_GRADIENT), "copy"),
      el("span", { class: "lo-key" }, swatch("transparent", `border:1.5px solid ${TIER_COLOR.pinned};` +
        `background:rgba(56,139,253,${COMPUTE_OPACITY})`), "compute"),
      el("span", { class: "lo-key" }, swatch(STALL_COLOR), "stall"),
      el("span", { class: "lo-muted" }, "(ms; bar colour = tier)")));
}

function tierCounts(m) {
  const counts = { vram: 0, pinned: 0, pageable: 0, disk: 0 };
  const sizes = { vram: 0, pinned: 0, pageable: 0, disk: 0 };
  for (const blk of m.blocks || []) {
    counts[blk.tier] = (counts[blk.tier] || 0) + 1;
    sizes[blk.tier] = (sizes[blk.tier] || 0) + num(blk.bytes);
  }
  return { counts: { ...counts, ...(m.tiers || {}) }, sizes: { ...sizes, ...(m.tier_bytes || {}) } };
}

function deviceText(m) {
  const dev = m.device || "?";
  const name = m.device_name || "";
  if (!name || name === dev) return dev;
  return name.startsWith(dev) ? name : `${dev} (${name})`; // "sim (8.00 GiB)", "cuda:0 (NVIDIA ...)"
}

function modelDevices(m, devices) {
  if (!multiDevice(m)) return null;
  return el("div", { class: "lo-counts" }, Object.entries(m.devices).map(([name, d]) =>
    el("span", { "data-lo-model-device": name }, swatch(deviceColor(devices, name)), el("b", {}, name),
      ` ${num(d.resident_blocks)} resident block(s) · ${bytes(d.device_bytes)} (peak ${bytes(d.peak_device_bytes)})` +
      (num(d.activation_bytes) ? ` · activations moved ${bytes(d.activation_bytes)}` : ""))));
}

// The blocks' host RAM: what their masters hold (encoded where compressed) against their raw bytes (issue 36).
function hostLine(m) {
  const compressed = (m.blocks || []).filter((b) => b.compression && b.compression !== "none").length;
  if (!compressed) return null;
  const raw = num(m.host_raw_bytes);
  const held = num(m.host_bytes);
  return el("div", { class: "lo-muted", "data-lo-host": "compressed" },
    `host RAM ${bytes(held)} for ${bytes(raw)} of blocks · ${compressed} block(s) compressed ` +
    `(${raw ? Math.round((100 * held) / raw) : 100}%, decoded on the device)`);
}

function modelRow(m, devices) {
  const { counts, sizes } = tierCounts(m);
  const streamed = num(counts.pinned) + num(counts.pageable);
  const prioKey = `priority:${m.name}`;
  const prio = control(prioKey, { "data-lo-control": "priority", "data-lo-for": m.name, min: -100, max: 100,
    step: 1, "aria-label": `Priority of ${m.name}`, title: "Higher keeps more blocks resident; Enter applies it" },
  String(m.priority ?? 0));
  const stall = num(m.stall_ms);
  const row = el("div", { class: "lo-model", "data-lo-model": m.name },
    el("div", { class: "lo-name lo-model-name" }, m.name),
    el("div", { class: "lo-muted" }, `${m.kind || "model"} · ${deviceText(m)} · preset ${m.preset ?? "-"}`),
    el("label", { class: "lo-line lo-ctl" }, el("span", {}, "Priority"), prio),
    el("div", { class: "lo-counts" },
      el("span", {}, swatch(TIER_COLOR.vram), el("b", { "data-lo-count": "resident" }, num(counts.vram)),
        ` resident · ${bytes(sizes.vram)}`),
      el("span", {}, swatch(TIER_COLOR.pinned), el("b", { "data-lo-count": "streamed" }, streamed),
        ` streamed · ${bytes(num(sizes.pinned) + num(sizes.pageable))}` +
        (num(counts.pageable) ? ` (${counts.pageable} pageable)` : "")),
      el("span", {}, swatch(TIER_COLOR.disk), el("b", { "data-lo-count": "disk" }, num(counts.disk)),
        ` disk · ${bytes(sizes.disk)}`)),
    el("div", { class: "lo-muted" }, `device ${bytes(m.device_bytes)} (peak ${bytes(m.peak_device_bytes)}) · ` +
      `resident total ${bytes(m.resident_bytes)} · ${num(m.forwards)} forward(s)`),
    hostLine(m),
    modelDevices(m, devices || []),
    chart(m, devices || []),
    el("div", { class: "lo-figures" },
      el("span", {}, "overlap ", el("b", { "data-lo-figure": "overlap" }, num(m.overlap_ratio).toFixed(2))),
      el("span", {}, el("b", { "data-lo-figure": "gbps" }, num(m.effective_gbps).toFixed(2)), " GB/s"),
      el("span", { class: stall > 0 ? "lo-stall" : "" }, "stall ",
        el("b", { "data-lo-figure": "stall" }, ms(stall)), " ms"),
      el("span", { class: "lo-muted" }, `copy ${ms(m.h2d_ms)} ms · compute ${ms(m.compute_ms)} ms`),
      stepFigures(m)),
    notices(m),
    blockTable(m, devices || []));
  return row;
}

function stepFigures(m) {
  // measured and predicted step time side by side (nodes/status.py step_times)
  const step = m.step || {};
  const measured = step.measured_ms ?? m.step_ms;
  const predicted = step.predicted_ms ?? m.predicted_step_ms;
  const show = (v) => (v === null || v === undefined ? "-" : ms(v));
  return el("span", { title: "Blocks' compute plus stalls per forward in the last runs, beside what the plan " +
      "predicted for them (the slot ring simulated over the measured costs; known once every block has run)" },
    "step ", el("b", { "data-lo-figure": "step" }, show(measured)), " ms · predicted ",
    el("b", { "data-lo-figure": "predicted_step" }, show(predicted)), " ms");
}

function notices(m) {
  const list = m.notices || [];
  if (!list.length) return null;
  return el("ul", { class: "lo-notices" }, list.map((n) =>
    el("li", { "data-lo-notice": n.kind }, el("b", {}, (NOTICES[n.kind]?.summary || n.kind) + ": "), n.message)));
}

const PER_ROW = 16; // blocks per chart row: a 40-block model gets three rows, each bar stays wide enough to see

function chart(m, devices) {
  const blocks = m.blocks || [];
  const multi = multiDevice(m); // a device strip under the tier band, block numbers one strip lower
  const n = Math.max(1, blocks.length);
  const perRow = Math.min(n, PER_ROW);
  const rows = Math.ceil(n / perRow);
  const W = 280;
  const rowH = (n > PER_ROW ? 62 : 84) + (multi ? 5 : 0); // one row: bars, the tier band and the block numbers
  const top = 8; // room for a stall's marker
  const plotH = rowH - top - 18 - (multi ? 5 : 0);
  const H = rows * rowH;
  const colW = W / perRow;
  const gap = Math.min(4, colW * 0.2);
  const barW = (colW - gap) / 3;
  let max = 0;
  for (const b of blocks) max = Math.max(max, num(b.h2d_ms), num(b.compute_ms), num(b.stall_ms));
  const height = (v) => {
    v = num(v);
    if (v <= 0 || max <= 0) return 0;
    return Math.max(1.5, (plotH * v) / max); // a non-zero value never vanishes
  };
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "lo-chart", "data-lo-chart": "blocks",
    role: "img", "aria-label": `${m.name}: copy, compute and stall ms per block` });
  for (let r = 0; r < rows; r++) {
    const y = r * rowH + top + plotH + 0.5;
    root.append(svg("line", { x1: 0, x2: W, y1: y, y2: y, stroke: "#8b949e", "stroke-width": 0.5 }));
  }
  const labelEvery = colW < 10 ? 2 : 1;
  blocks.forEach((b, i) => {
    const color = TIER_COLOR[b.tier] || "#8b949e";
    const x = (i % perRow) * colW + gap / 2;
    const rowTop = Math.floor(i / perRow) * rowH;
    const base = rowTop + top + plotH;
    const stall = num(b.stall_ms);
    const g = svg("g", { "data-lo-block": i, "data-lo-tier": b.tier, "data-lo-stall": stall > 0 ? 1 : 0 });
    if (b.device) g.setAttribute("data-lo-device", b.device);
    const tip = svg("title", {});
    tip.textContent = `${i} ${b.name} [${b.tier}${multi && b.device ? ` on ${b.device}` : ""}] ${bytes(b.bytes)}: ` +
      `copy ${ms(b.h2d_ms)} ms, compute ` +
      `${ms(b.compute_ms)} ms, stall ${ms(b.stall_ms)} ms`;
    g.append(tip);
    if (stall > 0) { // stalls stand out: the whole column is tinted red and marked on top
      g.append(svg("rect", { x: x - gap / 2, y: rowTop + 1, width: colW, height: plotH + top - 1, fill: STALL_COLOR,
        "fill-opacity": 0.22, "data-lo-bar": "stall-column" }));
      const cx = x + (colW - gap) / 2;
      g.append(svg("path", { d: `M${cx - 3} ${rowTop + 1} L${cx + 3} ${rowTop + 1} L${cx} ${rowTop + 6} Z`,
        fill: STALL_COLOR }));
    }
    const bars = [
      [num(b.h2d_ms), color, 1, "copy"],
      [num(b.compute_ms), color, COMPUTE_OPACITY, "compute"],
      [stall, STALL_COLOR, 1, "stall"],
    ];
    bars.forEach(([v, fill, opacity, kind], j) => {
      const h = height(v);
      const attrs = { x: x + j * barW + 0.3, y: base - h, width: Math.max(0.5, barW - 0.6), height: h, fill,
        "fill-opacity": opacity, "data-lo-bar": kind };
      if (kind === "compute" && h > 0) Object.assign(attrs, { stroke: fill, "stroke-width": 0.8 });
      g.append(svg("rect", attrs));
    });
    g.append(svg("rect", { x, y: base + 2, width: Math.max(0.5, colW - gap), height: 4, fill: color,
      "data-lo-bar": "tier" }));
    if (multi) {
      g.append(svg("rect", { x, y: base + 7, width: Math.max(0.5, colW - gap), height: 3,
        fill: deviceColor(devices, b.device), "data-lo-bar": "device" }));
    }
    if (i % labelEvery === 0) {
      const t = svg("text", { x: x + (colW - gap) / 2, y: base + 15 + (multi ? 5 : 0), "text-anchor": "middle",
        "font-size": 9,
        fill: "currentColor", "fill-opacity": 0.75 });
      t.textContent = String(i);
      g.append(t);
    }
    root.append(g);
  });
  const stalls = blocks.filter((b) => num(b.stall_ms) > 0).length;
  const caption = el("div", { class: "lo-muted lo-caption" },
    max > 0 ? `last run, per block (0 to ${ms(max)} ms)` : "last run, per block: no run yet",
    stalls ? el("span", { class: "lo-stall" }, ` · ${stalls} block(s) stalled`) : null);
  return el("div", { class: "lo-chart-box" }, caption, root);
}

function blockTable(m, devices) {
  const multi = multiDevice(m);
  const details = el("details", { class: "lo-details", open: state.open.has(m.name) });
  details.addEventListener("toggle", () => {
    if (details.open) state.open.add(m.name);
    else state.open.delete(m.name);
  });
  details.append(el("summary", {}, "Per-block figures"));
  details.append(el("div", { class: "lo-table-box" }, el("table", { class: "lo-table" },
    el("thead", {}, el("tr", {}, ["#", "tier", multi ? "device" : null, "MB", "copy", "compute", "stall"]
      .filter((h) => h !== null).map((h) => el("th", {}, h)))),
    el("tbody", {}, (m.blocks || []).map((b, i) => el("tr", {},
      el("td", {}, i), el("td", {}, swatch(TIER_COLOR[b.tier] || "#8b949e"), b.tier),
      multi ? el("td", {}, swatch(deviceColor(devices, b.device)), b.device || "") : null,
      el("td", {}, (num(b.bytes) / MIB).toFixed(num(b.bytes) >= 100 * MIB ? 0 : 1)), el("td", {}, ms(b.h2d_ms)), el("td", {}, ms(b.compute_ms)),
      el("td", { class: num(b.stall_ms) > 0 ? "lo-stall" : "" }, ms(b.stall_ms))))))));
  return details;
}

const CSS_TEXT = `
.lo-panel{padding:8px 10px;font-size:12px;line-height:1.45;color:var(--fg-color,#ddd);box-sizing:border-box;
  height:100%;overflow-y:auto;overflow-x:hidden}
.lo-panel *{box-sizing:border-box}
.lo-title{display:flex;justify-content:space-between;align-items:baseline;gap:6px;font-weight:600;font-size:14px;
  margin-bottom:6px}
.lo-muted{color:var(--descrip-text,#999);font-weight:normal;font-size:11px}
.lo-error{display:flex;gap:6px;align-items:flex-start;border:1px solid #f85149;background:rgba(248,81,73,.14);
  border-radius:6px;padding:5px 7px;margin-bottom:8px;word-break:break-word}
.lo-error[hidden]{display:none}
.lo-close{margin-left:auto;background:none;border:none;color:inherit;cursor:pointer;font-size:14px;line-height:1}
.lo-section{margin-bottom:8px}
.lo-line{display:flex;justify-content:space-between;align-items:center;gap:6px;flex-wrap:wrap}
.lo-ctl{margin:4px 0}
.lo-bar{display:flex;height:12px;background:var(--comfy-input-bg,#30363d);border:1px solid var(--border-color,#444);
  border-radius:4px;overflow:hidden;margin:4px 0}
.lo-seg{height:100%;min-width:4px;flex:0 0 auto;border-right:1px solid rgba(0,0,0,.35)}
.lo-shares{display:flex;flex-direction:column;gap:1px}
.lo-devices{margin-top:4px}
.lo-bar-thin{height:8px;margin:2px 0 4px}
.lo-share{display:flex;align-items:baseline;gap:2px}
.lo-wrap{min-width:0;overflow-wrap:anywhere}
.lo-name{font-weight:600;overflow-wrap:anywhere}
.lo-origin{margin-top:2px}
.lo-input{width:6em;background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);
  border:1px solid var(--border-color,#555);border-radius:4px;padding:2px 4px;font-size:12px}
.lo-invalid{border-color:#f85149;outline:1px solid #f85149}
.lo-swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:3px;vertical-align:-1px;
  flex:0 0 auto}
.lo-legend{border-top:1px solid var(--border-color,#444);border-bottom:1px solid var(--border-color,#444);
  padding:4px 0;margin-bottom:8px;font-size:11px}
.lo-legend-row{display:flex;flex-wrap:wrap;gap:2px 8px;align-items:center}
.lo-key{white-space:nowrap}
.lo-model{border:1px solid var(--border-color,#444);border-radius:6px;padding:6px;margin-bottom:8px}
.lo-counts{display:flex;flex-direction:column;margin:3px 0}
.lo-chart-box{margin:4px 0}
.lo-chart{display:block;width:100%;height:auto}
.lo-figures{display:flex;flex-wrap:wrap;gap:2px 12px}
.lo-stall{color:${STALL_COLOR};font-weight:600}
.lo-notices{margin:4px 0;padding-left:16px;font-size:11px}
.lo-details summary{cursor:pointer;font-size:11px;margin-top:3px}
.lo-table-box{overflow-x:auto}
.lo-table{border-collapse:collapse;width:100%;font-size:11px;font-variant-numeric:tabular-nums;white-space:nowrap}
.lo-table th,.lo-table td{text-align:right;padding:0 3px}
.lo-table th:nth-child(2),.lo-table td:nth-child(2){text-align:left}
.lo-select{width:auto;max-width:70%}
.lo-button{background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);border:1px solid var(--border-color,#555);
  border-radius:4px;padding:2px 8px;font-size:12px;cursor:pointer}
.lo-button[disabled]{opacity:.6;cursor:default}
.lo-plan{border-top:1px solid var(--border-color,#444);padding-top:6px}
.lo-plan-model{border-top:1px dashed var(--border-color,#444);padding:3px 0}
.lo-workflow{border-top:1px solid var(--border-color,#444);padding-top:6px}
.lo-toasts{position:fixed;right:12px;bottom:12px;z-index:10000;display:flex;flex-direction:column;gap:6px;
  max-width:340px}
.lo-toast{background:var(--comfy-menu-bg,#222);color:var(--fg-color,#ddd);border:1px solid #555;
  border-left:4px solid #388bfd;border-radius:6px;padding:6px 8px;font-size:12px;cursor:pointer}
.lo-toast-warn{border-left-color:#d29922}
.lo-toast-error{border-left-color:#f85149}
`;

function ensureStyle() {
  if (document.getElementById("layer-offload-style")) return;
  document.head.append(el("style", { id: "layer-offload-style" }, CSS_TEXT));
}

function makeView() {
  ensureStyle();
  const root = el("div", { class: "lo-panel", "data-lo-panel": "" });
  state.views.add(root);
  render(root);
  return root;
}

function floatingPanel() {
  // Frontends without registerSidebarTab: a toggle button and a floating panel.
  const box = el("div", { style: "position:fixed;right:12px;bottom:48px;width:340px;max-height:70vh;overflow:auto;" +
    "background:var(--comfy-menu-bg,#222);border:1px solid #444;border-radius:8px;z-index:1000;display:none" });
  box.append(makeView());
  const button = el("button", { style: "position:fixed;right:12px;bottom:12px;z-index:1000;padding:4px 8px",
    title: "Layer Offload: budget and blocks" }, "Offload");
  button.addEventListener("click", () => {
    box.style.display = box.style.display === "none" ? "block" : "none";
    if (box.style.display === "block") refresh();
  });
  document.body.append(box, button);
}

app.registerExtension({
  name: "LayerOffload.Panel",
  async setup() {
    api.addEventListener(EVENT, (ev) => publish(ev.detail));
    const mgr = app.extensionManager;
    if (mgr && typeof mgr.registerSidebarTab === "function") {
      mgr.registerSidebarTab({
        id: TAB_ID,
        icon: "pi pi-server",
        title: "Layer Offload",
        label: "Offload",
        tooltip: "Layer Offload: VRAM budget, blocks per tier, last-run chart, priority and budget controls",
        type: "custom",
        render: (container) => {
          container.replaceChildren(makeView());
          refresh();
          requestPlan(false);
        },
      });
    } else {
      floatingPanel();
    }
    refresh();
    startPlanWatch();
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "OffloadReport") return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message && message.text ? message.text : []).join("\n");
      let w = this.widgets?.find((x) => x.name === "offload_report");
      if (!w) {
        const area = document.createElement("textarea");
        area.readOnly = true;
        area.style.cssText = "width:100%;font-family:monospace;font-size:11px;opacity:.9";
        if (typeof this.addDOMWidget === "function") {
          w = this.addDOMWidget("offload_report", "text", area, { getValue: () => area.value, setValue: () => {} });
          w.element = area;
        } else {
          w = this.addWidget("text", "offload_report", "", () => {}, { multiline: true });
        }
      }
      if (w.element) w.element.value = text;
      else w.value = text;
      this.setSize?.([Math.max(this.size[0], 420), Math.max(this.size[1], 180)]);
      app.graph?.setDirtyCanvas(true, true);
    };
  },
});

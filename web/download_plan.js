// Layer Offload: "Plan the download" (issue 43), a part of the panel's Workflow plan section (mounted by
// layer_offload.js; plain ES module, no side effects on import: ComfyUI also loads every .js of the web folder).
//
// A workflow opened from a template often names models that are not on this machine yet, with the download links the
// template carries (`properties.models` on its nodes, or its top-level `models`). The plan then lists them as not
// found, each with its link. The button asks the server (POST /layer_offload/plan with "fetch_headers": true and the
// UI workflow beside the API graph) to read only those files' headers from their links (HTTP range requests: a few
// kB each, never the weights; nodes/plan_headers.py) and to plan them as if they were on disk; the plan then shows
// them with their figures, and this section what the download would be (bytes from each header). Later re-plans of
// the canvas use the headers read (the server's header cache) without asking the network again.
//
// DOM hooks (tests/comfyui/test_panel_browser.py):
//   [data-lo-download-plan]                     the section; data-lo-download-state="offer|planned"
//   button[data-lo-control="plan-download"]     read the missing models' headers and plan them
//   [data-lo-download="<file name>"]            one row per linked missing file: data-lo-bytes (the download's bytes,
//                                               "" when the header was not read), data-lo-download-source
//                                               ("network" | "cache" | ""), its error's text when not read
//   [data-lo-download-total]                    data-lo-bytes: the files whose headers were read, together

import { el } from "./dom.js";

const GB = 1e9;
const state = {
  mode: "links", // "links": only learn the links; "fetch": read headers in the next plan; "cache": headers read before
};

function gb(n) {
  // download sizes as download sites give them: decimal GB, MB below 1 GB
  const v = Number(n);
  return v >= GB ? `${(v / GB).toFixed(2)} GB` : `${(v / 1e6).toFixed(1)} MB`;
}

function uiWorkflow(app) {
  // the canvas in UI form (subgraph definitions included): the links live there, not in the API graph
  try {
    return app.graph.serialize();
  } catch (e) {
    console.warn("Layer Offload: the workflow could not be serialized for its download links", e);
    return null;
  }
}

// What a plan request carries besides the API graph: the UI workflow (its links), and the header flags.
export function planRequestExtras(app) {
  const workflow = uiWorkflow(app);
  if (!workflow) return {};
  const extras = { workflow };
  if (state.mode === "fetch") {
    extras.fetch_headers = true;
    state.mode = "cache"; // asked once per click; later plans read what it brought from the cache
  } else if (state.mode === "cache") {
    extras.cached_headers = true;
  }
  return extras;
}

// The section under the plan: the offer (missing models with links) or what the download would be.
export function downloadSection(data, busy, replan) {
  const p = data && data.plan;
  if (!p) return null;
  const linked = (p.models || []).filter((m) => m.runs !== false && !m.found && m.url); // a muted loader: not asked
  const downloads = p.downloads || [];
  const read = downloads.filter((d) => d.bytes !== null && d.bytes !== undefined);
  if (!linked.length && !read.length) return null;
  const names = new Set();
  const rows = [];
  for (const d of downloads) {
    if (names.has(d.name)) continue;
    names.add(d.name);
    const ok = d.bytes !== null && d.bytes !== undefined;
    rows.push(el("li", { "data-lo-download": d.name, "data-lo-bytes": ok ? d.bytes : "",
      "data-lo-download-source": d.source || "", title: d.url },
    el("b", {}, d.name), " ", ok ? gb(d.bytes) : el("span", { class: "lo-stall" },
      d.error ? `header not read: ${d.error}` : "header not read yet")));
  }
  for (const m of linked) {
    if (names.has(m.name)) continue;
    names.add(m.name);
    rows.push(el("li", { "data-lo-download": m.name, "data-lo-bytes": "", "data-lo-download-source": "",
      title: m.url }, el("b", {}, m.name), " ", el("span", { class: "lo-muted" }, "not on this machine")));
  }
  const total = read.reduce((s, d) => s + Number(d.bytes), 0);
  const button = el("button", { class: "lo-button", "data-lo-control": "plan-download", disabled: busy,
    title: "Read only the headers of the missing models from the download links the workflow names (a few kB " +
      "each, never the weights) and plan them as if they were on disk",
    onclick: () => {
      state.mode = "fetch";
      replan();
    } }, "Plan the download");
  return el("div", { class: "lo-section lo-download", "data-lo-download-plan": "",
    "data-lo-download-state": read.length ? "planned" : "offer" },
  el("div", { class: "lo-line" }, el("b", {}, "Not downloaded yet"),
    read.length ? el("span", { "data-lo-download-total": "", "data-lo-bytes": total },
      `${read.length} file(s), ${gb(total)} to download`) : null),
  el("div", { class: "lo-muted" }, linked.length
    ? `${linked.length} model file(s) the workflow links are not on this machine: plan them from their headers ` +
      "before downloading."
    : "Planned from the files' headers (read by range requests; nothing else was downloaded)."),
  el("ul", { class: "lo-notices" }, rows),
  linked.length ? el("div", { class: "lo-line lo-ctl" }, button) : null);
}

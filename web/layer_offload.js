// Layer Offload web extension (ES module, no build step).
// - A sidebar tab (or, on older frontends, a floating panel) with the VRAM budget, each offloaded model's
//   resident / streamed / disk blocks and the last run's stall, overlap and bandwidth.
// - The Offload Report node shows its readable summary in a text widget after it runs.
// Fed by GET /layer_offload/report and the "layer_offload.report" server event (nodes/routes.py).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const EVENT = "layer_offload.report";
const ROUTE = "/layer_offload/report";
const TIER_COLORS = { vram: "#3fb950", pinned: "#388bfd", pageable: "#d29922", disk: "#8b949e" };
let latest = null;
const views = new Set();

function mb(n) {
  return `${((n || 0) / 1048576).toFixed(1)} MB`;
}

function el(tag, style, text) {
  const e = document.createElement(tag);
  if (style) e.style.cssText = style;
  if (text !== undefined) e.textContent = text;
  return e;
}

function renderInto(root, data) {
  root.replaceChildren();
  root.appendChild(el("div", "font-weight:bold;font-size:14px;margin-bottom:6px", "Layer Offload"));
  if (!data) {
    root.appendChild(el("div", "opacity:.7", "No report yet: run a prompt with an Offload node."));
    return;
  }
  const b = data.budget || {};
  const frac = b.total_bytes ? Math.min(1, (b.used_bytes || 0) / b.total_bytes) : 0;
  root.appendChild(el("div", "", `VRAM budget: ${mb(b.used_bytes)} used of ${mb(b.total_bytes)}`));
  const bar = el("div", "height:8px;background:#30363d;border-radius:4px;margin:4px 0 10px 0;overflow:hidden");
  bar.appendChild(el("div", `height:100%;width:${(frac * 100).toFixed(1)}%;background:#3fb950`));
  root.appendChild(bar);
  const models = data.models || [];
  if (!models.length) root.appendChild(el("div", "opacity:.7", "No offloaded model yet."));
  for (const m of models) {
    const box = el("div", "border:1px solid #30363d;border-radius:6px;padding:6px;margin-bottom:8px");
    box.appendChild(el("div", "font-weight:bold;word-break:break-all", m.name));
    box.appendChild(el("div", "opacity:.8",
      `${m.kind || "model"} on ${m.device} · preset ${m.preset} · priority ${m.priority}`));
    const blocks = m.blocks || [];
    const tiers = { vram: 0, pinned: 0, pageable: 0, disk: 0 };
    for (const blk of blocks) tiers[blk.tier] = (tiers[blk.tier] || 0) + 1;
    box.appendChild(el("div", "",
      `${tiers.vram} resident · ${tiers.pinned + tiers.pageable} streamed · ${tiers.disk} disk blocks`));
    box.appendChild(el("div", "", `resident ${mb(m.resident_bytes)} · streamed ${mb(m.streamed_bytes)}`));
    const strip = el("div", "display:flex;flex-wrap:wrap;gap:2px;margin:4px 0");
    for (const blk of blocks) {
      const cell = el("div", `width:10px;height:10px;border-radius:2px;background:${TIER_COLORS[blk.tier] || "#666"}`);
      cell.title = `${blk.name} [${blk.tier}] ${mb(blk.bytes)}\nh2d ${Number(blk.h2d_ms || 0).toFixed(2)} ms · ` +
        `compute ${Number(blk.compute_ms || 0).toFixed(2)} ms · stall ${Number(blk.stall_ms || 0).toFixed(2)} ms`;
      strip.appendChild(cell);
    }
    box.appendChild(strip);
    box.appendChild(el("div", "",
      `last run: stall ${Number(m.stall_ms || 0).toFixed(1)} ms · overlap ${Number(m.overlap_ratio || 0).toFixed(2)}` +
      ` · ${Number(m.effective_gbps || 0).toFixed(2)} GB/s · ${m.forwards || 0} forward(s)`));
    root.appendChild(box);
  }
  const legend = el("div", "opacity:.7;font-size:11px");
  legend.textContent = "■ green resident (VRAM) · blue pinned RAM · orange pageable RAM · grey disk";
  root.appendChild(legend);
}

function publish(data) {
  latest = data;
  for (const v of views) renderInto(v, data);
}

async function refresh() {
  try {
    const r = await api.fetchApi(ROUTE);
    if (r.ok) publish(await r.json());
  } catch (e) {
    console.warn("Layer Offload: report unavailable", e);
  }
}

function makeView() {
  const root = el("div", "padding:8px;font-size:12px;line-height:1.4;color:var(--fg-color,#ddd)");
  views.add(root);
  renderInto(root, latest);
  return root;
}

function floatingPanel() {
  // Older frontends without registerSidebarTab: a small toggle button and a floating panel.
  const panel = el("div", "position:fixed;right:12px;bottom:48px;width:320px;max-height:60vh;overflow:auto;" +
    "background:var(--comfy-menu-bg,#222);border:1px solid #444;border-radius:8px;z-index:1000;display:none");
  panel.appendChild(makeView());
  const button = el("button", "position:fixed;right:12px;bottom:12px;z-index:1000;padding:4px 8px", "Offload");
  button.title = "Layer Offload: budget and blocks";
  button.onclick = () => {
    panel.style.display = panel.style.display === "none" ? "block" : "none";
    if (panel.style.display === "block") refresh();
  };
  document.body.append(panel, button);
}

app.registerExtension({
  name: "LayerOffload.Panel",
  async setup() {
    api.addEventListener(EVENT, (ev) => publish(ev.detail));
    const mgr = app.extensionManager;
    if (mgr && typeof mgr.registerSidebarTab === "function") {
      mgr.registerSidebarTab({
        id: "layer-offload",
        icon: "pi pi-server",
        title: "Layer Offload",
        tooltip: "Layer Offload: VRAM budget, resident/streamed blocks, last-run stall and overlap",
        type: "custom",
        render: (container) => {
          container.replaceChildren(makeView());
          refresh();
        },
      });
    } else {
      floatingPanel();
    }
    refresh();
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

// "Offload this workflow" in the Layer Offload panel (plain ES module, no build step).
//
// The open workflow (the root graph and its subgraphs, as the frontend serializes it) goes to
// POST /layer_offload/convert; the server answers with the edits offload/convert decides (which loader becomes the
// Offload Loader, which gets Offload Model / Offload CLIP after it, the VRAM Budget and its links through subgraph
// inputs, each preset planned for the card). This module applies them with the frontend's own graph API
// (LiteGraph.createNode, graph.add / remove, node.connect, Subgraph.addInput, SubgraphInput / SubgraphOutput
// .connect) inside one change-tracker transaction, so ComfyUI's undo (Ctrl+Z) takes the whole conversion back.
// The command line (`python -m offload convert`) writes the same edits into the JSON; the browser test holds the
// two to the same graph.
//
// Stable DOM hooks (tests/comfyui/test_convert_browser.py relies on them):
//   [data-lo-convert]                       the section; data-lo-convert-state="idle|converting|done|error"
//   button[data-lo-control="convert"]       the button
//   [data-lo-convert-result]                what the last click did (data-lo-edits: the number of edits applied)
//   [data-lo-convert-error]                 the refusal's message
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { el } from "./dom.js";

export const CONVERT_ROUTE = "/layer_offload/convert";
const DROPPED_PROPERTIES = ["cnr_id", "ver", "aux_id"]; // which pack a node comes from: not ComfyUI's any more
const SUBGRAPH_INPUT_ID = -10;
const SUBGRAPH_OUTPUT_ID = -20;

// node ids as the frontend holds them at run time: numbers in older frontends, strings ("-10", "76") in newer ones
function sameId(a, b) {
  return a !== null && a !== undefined && String(a) === String(b);
}

const state = { busy: false, error: "", result: null, views: new Set() };

function rootGraph() {
  return app.rootGraph ?? app.graph?.rootGraph ?? app.graph;
}

function graphOf(root, gid) {
  if (gid === "root") return root;
  const sub = root.subgraphs?.get?.(gid);
  if (!sub) throw new Error(`subgraph ${gid} is not in the open workflow`);
  return sub;
}

function linkOf(graph, id) {
  if (id === null || id === undefined) return undefined;
  return graph.getLink?.(id) ?? graph.links?.get?.(id) ?? graph.links?.[id];
}

function nodeOf(graph, ref, handles) {
  const node = typeof ref === "string" && ref.startsWith("new:") ? handles.get(ref) : graph.getNodeById(ref);
  if (!node) throw new Error(`node ${ref} is not in the graph`);
  return node;
}

function inputIndex(node, name) {
  const index = node.inputs?.findIndex((i) => i.name === name) ?? -1;
  if (index < 0) throw new Error(`${node.type} #${node.id} has no input ${name}`);
  return index;
}

function setWidgets(node, values) {
  for (const [name, value] of Object.entries(values || {})) {
    const widget = node.widgets?.find((w) => w.name === name);
    if (!widget) continue;
    widget.value = value;
    widget.callback?.(value, app.canvas, node);
  }
}

function createNode(type) {
  const node = globalThis.LiteGraph.createNode(type);
  if (!node) throw new Error(`the node type ${type} is not registered (is the pack loaded?)`);
  return node;
}

// an existing link's ends, to connect again after the node at one end changes
function outgoing(graph, node, slot) {
  return (node.outputs?.[slot]?.links ?? []).map((id) => linkOf(graph, id)).filter(Boolean)
    .map((l) => ({ target: l.target_id, slot: l.target_slot, parent: l.parentId }));
}

function connectTo(graph, node, slot, end) {
  if (sameId(end.target, SUBGRAPH_OUTPUT_ID)) {
    graph.outputs[end.slot].connect(node.outputs[slot], node, end.parent);
  } else {
    node.connect(slot, graph.getNodeById(end.target), end.slot, end.parent);
  }
}

function connectFrom(graph, origin, originSlot, node, index, parent) {
  if (sameId(origin, SUBGRAPH_INPUT_ID)) {
    graph.inputs[originSlot].connect(node.inputs[index], node, parent);
  } else {
    const from = graph.getNodeById(origin);
    if (!from) throw new Error(`node ${origin} linked into ${node.type} is not in the graph`);
    from.connect(originSlot, node, index, parent);
  }
}

const OPS = {
  replace(graph, edit) {
    const old = graph.getNodeById(edit.node);
    if (!old) throw new Error(`node ${edit.node} to replace is not in the graph`);
    const outs = (old.outputs ?? []).map((_, i) => outgoing(graph, old, i));
    const ins = (old.inputs ?? []).filter((i) => i.link != null).map((i) => {
      const l = linkOf(graph, i.link);
      return l && { name: i.name, origin: l.origin_id, slot: l.origin_slot, parent: l.parentId };
    }).filter(Boolean);
    const keep = { pos: [old.pos[0], old.pos[1]], mode: old.mode, color: old.color, bgcolor: old.bgcolor,
      flags: { ...(old.flags ?? {}) }, properties: { ...(old.properties ?? {}) } };
    const node = createNode(edit.type);
    graph.remove(old);
    node.id = edit.node;
    graph.add(node);
    node.pos = keep.pos;
    node.size = [Math.max(node.size[0], edit.size[0]), Math.max(node.size[1], edit.size[1])];
    if (edit.title) node.title = edit.title;
    node.mode = keep.mode;
    if (keep.color) node.color = keep.color;
    if (keep.bgcolor) node.bgcolor = keep.bgcolor;
    Object.assign(node.flags, keep.flags);
    for (const [k, v] of Object.entries(keep.properties)) {
      if (!DROPPED_PROPERTIES.includes(k) && k !== "Node name for S&R") node.properties[k] = v;
    }
    setWidgets(node, edit.widgets);
    outs.forEach((ends, slot) => ends.forEach((end) => connectTo(graph, node, slot, end)));
    for (const i of ins) {
      const index = node.inputs.findIndex((x) => x.name === i.name);
      if (index >= 0) connectFrom(graph, i.origin, i.slot, node, index, i.parent);
    }
  },
  add(graph, edit, handles) {
    const node = createNode(edit.type);
    node.pos = [edit.pos[0], edit.pos[1]];
    graph.add(node);
    node.size = [Math.max(node.size[0], edit.size[0]), Math.max(node.size[1], edit.size[1])];
    setWidgets(node, edit.widgets);
    handles.set(edit.handle, node);
  },
  insert(graph, edit, handles) {
    const node = nodeOf(graph, edit.node, handles);
    const [sourceId, slot] = edit.source;
    const source = graph.getNodeById(sourceId);
    for (const end of outgoing(graph, source, slot)) connectTo(graph, node, 0, end);
    source.connect(slot, node, inputIndex(node, edit.input));
  },
  subgraph_input(graph, edit) {
    graph.addInput(edit.name, edit.type);
  },
  link(graph, edit, handles) {
    const target = nodeOf(graph, edit.to.node, handles);
    const index = inputIndex(target, edit.to.input);
    if ("subgraph_input" in edit.from) {
      const input = graph.inputs.find((i) => i.name === edit.from.subgraph_input);
      if (!input) throw new Error(`the subgraph has no input ${edit.from.subgraph_input}`);
      input.connect(target.inputs[index], target);
    } else {
      nodeOf(graph, edit.from.node, handles).connect(edit.from.slot ?? 0, target, index);
    }
  },
};

function changeTracker() {
  return app.extensionManager?.workflow?.activeWorkflow?.changeTracker ?? app.workflowManager?.activeWorkflow?.changeTracker;
}

function capture(tracker) {
  if (typeof tracker?.captureCanvasState === "function") tracker.captureCanvasState();
  else tracker?.checkState?.();
}

function linkIds(graph) {
  const links = graph.links;
  if (links instanceof Map) return [...links.keys()];
  return Object.keys(links ?? {});
}

// node and link ids are unique across the workflow: every subgraph's id counters at least the highest in use anywhere
// (newer frontends share one state; older ones (1.27) keep one per graph, each counting on its own and behind the ids
// the root's Convert to Subgraph gave out, so a node added inside would take an id in use: the route's fresh ids are
// the rule)
function syncCounters(root) {
  const graphs = [root, ...(root.subgraphs?.values?.() ?? [])];
  const states = graphs.map((g) => g.state).filter((st) => st && typeof st === "object");
  const inUse = {
    lastNodeId: graphs.flatMap((g) => (g.nodes ?? g._nodes ?? []).map((n) => Number(n.id))),
    lastLinkId: graphs.flatMap((g) => linkIds(g).map(Number)),
  };
  for (const key of ["lastNodeId", "lastLinkId"]) {
    const top = Math.max(0, ...states.map((st) => Number(st[key]) || 0),
      ...inUse[key].filter((id) => Number.isSafeInteger(id) && id > 0));
    for (const st of states) if ((Number(st[key]) || 0) < top) st[key] = top;
  }
}

// a subgraph's input / output slots list only links that are there (older frontends leave the id of a link that a
// new connection to a subgraph output replaced)
function pruneSlotLinks(root) {
  for (const sub of root.subgraphs?.values?.() ?? []) {
    for (const slot of [...(sub.inputs ?? []), ...(sub.outputs ?? [])]) {
      if (Array.isArray(slot.linkIds)) {
        const kept = slot.linkIds.filter((id) => linkOf(sub, id));
        if (kept.length !== slot.linkIds.length) slot.linkIds.splice(0, slot.linkIds.length, ...kept);
      }
    }
  }
}

// every edit in one undo step: ComfyUI's change tracker records one state before and one after
export async function applyEdits(edits) {
  const root = rootGraph();
  const tracker = changeTracker();
  capture(tracker);
  if (tracker) tracker.beforeChange();
  else root.beforeChange?.();
  const handles = new Map();
  const before = JSON.parse(JSON.stringify(root.serialize())); // a copy the edits cannot reach, as the tracker keeps one
  try {
    for (const edit of edits) {
      const op = OPS[edit.op];
      if (!op) throw new Error(`unknown edit ${edit.op}`);
      syncCounters(root); // each edit changes one graph; with a state per graph (1.27) the next counts from the top
      op(graphOf(root, edit.graph), edit, handles);
    }
    syncCounters(root);
    pruneSlotLinks(root);
  } catch (e) {
    // nothing half converted: the graph as it was, loaded as the change tracker's own undo loads a state (then it
    // sees no change, so no undo step)
    try {
      if (tracker?.workflow) {
        await app.loadGraphData(before, false, false, tracker.workflow,
          { showMissingNodesDialog: false, showMissingModelsDialog: false });
      } else {
        root.configure(before);
      }
    } catch (restoreError) {
      e.message = `${e.message}; the graph could not be restored (${restoreError.message || restoreError}): ` +
        "press Ctrl+Z";
    }
    throw e;
  } finally {
    if (tracker) tracker.afterChange();
    else root.afterChange?.();
    app.canvas?.setDirty?.(true, true);
    app.graph?.setDirtyCanvas?.(true, true);
  }
  return handles.size;
}

// the open workflow converted: asks the server for the edits, applies them; {edits, changes, notes, card}
export async function offloadThisWorkflow(card) {
  const workflow = rootGraph().serialize();
  const body = { workflow };
  if (card) body.card = card;
  const res = await api.fetchApi(CONVERT_ROUTE, { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body) });
  let data;
  try {
    data = await res.json();
  } catch {
    data = { ok: false, error: `the server answered ${res.status}` };
  }
  if (!res.ok || !data.ok) throw new Error(data.error || `the server answered ${res.status}`);
  await applyEdits(data.edits);
  return data;
}

function summary(data) {
  const changes = data.changes || [];
  if (!changes.length) return "Nothing to change: every loader is offloaded already.";
  const lines = changes.map((c) => `${c.type}${c.node ? ` #${c.node}` : ""}` +
    `${c.graph && c.graph !== "the workflow" ? ` (${c.graph})` : ""}: ${c.action}${c.preset ? `, ${c.preset}` : ""}`);
  return `${lines.join("; ")}. Ctrl+Z undoes it.`;
}

function stateName() {
  if (state.busy) return "converting";
  if (state.error) return "error";
  return state.result ? "done" : "idle";
}

function rerender() {
  for (const v of [...state.views]) {
    state.views.delete(v);
    if (v.isConnected) v.replaceWith(convertSection(v.__loCard));
  }
}

async function onClick(getCard) {
  if (state.busy) return;
  state.busy = true;
  state.error = "";
  rerender();
  try {
    state.result = await offloadThisWorkflow(getCard());
    const n = (state.result.edits || []).length;
    app.extensionManager?.toast?.add?.({ severity: n ? "success" : "info", summary: "Layer Offload",
      detail: summary(state.result), life: 8000 });
  } catch (e) {
    state.error = `The workflow was not converted: ${e.message || e}`;
    state.result = null;
  } finally {
    state.busy = false;
    rerender();
  }
}

// the panel's section: a button, what the last click did, or why it did not
export function convertSection(getCard = () => "") {
  const button = el("button", { class: "lo-button", "data-lo-control": "convert", disabled: state.busy,
    title: "Put the pack's nodes into the open workflow (inside subgraphs too): each diffusion model loader becomes " +
      "the Offload Loader, text encoders and other loaders get Offload CLIP / Offload Model after them, one VRAM " +
      "Budget; presets planned for the card. Ctrl+Z undoes it.", onclick: () => onClick(getCard) },
  state.busy ? "Converting…" : "Offload this workflow");
  const data = state.result;
  const box = el("div", { class: "lo-section lo-convert", "data-lo-convert": "", "data-lo-convert-state": stateName() },
    el("div", { class: "lo-line lo-ctl" }, button),
    el("div", { class: "lo-error", role: "alert", "data-lo-convert-error": "", hidden: !state.error }, state.error),
    data ? el("div", { class: "lo-muted lo-wrap", "data-lo-convert-result": "",
      "data-lo-edits": (data.edits || []).length }, summary(data)) : null);
  box.__loCard = getCard;
  state.views.add(box);
  return box;
}

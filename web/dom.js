// A DOM element from a tag, attributes and children: the one helper the pack's panel modules build their markup
// with (layer_offload.js, download_plan.js, offload_convert.js). A plain ES module, no side effects on import
// (ComfyUI also loads every .js of the web folder). Attributes: "class", "style" (css text), "on<event>" handlers,
// true as an empty attribute; undefined, null and false attributes and children are left out; strings become text.
export function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

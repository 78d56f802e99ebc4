"""What a flattened workflow computes before any model runs: the values of the small nodes that feed widgets
(PrimitiveInt / Float / String / Boolean, the If/Else switch, Math Expression, And / Or / Not, number conversion), which
branch each switch takes, and so which nodes ComfyUI runs at all.

ComfyUI runs a prompt from its output nodes backwards and evaluates a lazy input (the switch's branches) only when
the node asks for it: a LoRA behind a switch that is off is never loaded. `Values.reached()` follows the same rule;
where a switch's value cannot be known before running, both branches count.

Math Expression is evaluated as ComfyUI 0.33 evaluates it (simpleeval with ComfyUI's function table) where simpleeval
is installed; otherwise its value is unknown and said so.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

from .comfy_nodes import NodeDefs
from .workflow_flat import FlatGraph, FlatNode, is_link

UNKNOWN = object()  # a value the graph does not fix before it runs
PRIMITIVES = ("PrimitiveInt", "PrimitiveFloat", "PrimitiveString", "PrimitiveStringMultiline", "PrimitiveBoolean",
              "PrimitiveNode")
SWITCHES = ("ComfySwitchNode", "ComfySoftSwitchNode")
MAX_EXPRESSION = 1000  # characters of a math expression evaluated
MAX_EXPONENT = 4000  # ComfyUI's own cap on pow()
MAX_DEPTH = 200  # value nodes feeding value nodes
MAX_TEXT = 100_000  # characters of text a text node computes here
STRING_NODES = ("CustomCombo", "StringConcatenate", "StringReplace", "JsonExtractString")


def _sum(*args: Any) -> Any:
    return sum(args[0]) if len(args) == 1 and hasattr(args[0], "__iter__") else sum(args)


def _pow(base: Any, exp: Any) -> Any:
    if abs(exp) > MAX_EXPONENT:
        raise ValueError(f"exponent {exp} over {MAX_EXPONENT}")
    return pow(base, exp)


MATH_FUNCTIONS: dict[str, Callable[..., Any]] = {  # comfy_extras/nodes_math.py's table
    "sum": _sum, "min": min, "max": max, "abs": abs, "round": round, "pow": _pow, "sqrt": math.sqrt,
    "ceil": math.ceil, "floor": math.floor, "log": math.log, "log2": math.log2, "log10": math.log10, "sin": math.sin,
    "cos": math.cos, "tan": math.tan, "int": int, "float": float}


class Values:
    """Values of a flattened graph's value nodes, the branches its switches take, the nodes that run."""

    def __init__(self, flat: FlatGraph, defs: NodeDefs | None = None) -> None:
        self.flat, self.defs = flat, defs or NodeDefs()
        self._memo: dict[tuple[str, int], Any] = {}
        self.notes: list[str] = []

    # --- values
    def value(self, v: Any, depth: int = 0) -> Any:
        """A widget input's value: a literal as is; a link to a value node evaluated; UNKNOWN otherwise."""
        if not is_link(v):
            return v.get("__value__", v) if isinstance(v, dict) and "__value__" in v else v
        key = (v[0], v[1])
        if key not in self._memo:
            if depth > MAX_DEPTH:
                return UNKNOWN
            self._memo[key] = UNKNOWN  # a cycle (refused earlier) or a re-entry reads as unknown
            node = self.flat.nodes.get(v[0])
            self._memo[key] = self._output(node, v[1], depth + 1) if node is not None else UNKNOWN
        return self._memo[key]

    def number(self, v: Any, default: float | None = None) -> float | None:
        x = self.value(v)
        if isinstance(x, bool) or x is UNKNOWN:
            return default if x is UNKNOWN else float(x)
        try:
            return float(x)
        except (TypeError, ValueError):
            return default

    def _output(self, node: FlatNode, slot: int, depth: int) -> Any:
        ctype, ins = node.class_type, node.inputs
        if ctype in PRIMITIVES:
            return self.value(ins.get("value", UNKNOWN), depth)
        if ctype in SWITCHES:
            branch = self.branch(node, depth)
            return UNKNOWN if branch is None else self.value(ins.get(branch, UNKNOWN), depth)
        if ctype == "ComfyMathExpression":
            result = self._math(node, depth)
            if result is UNKNOWN:
                return UNKNOWN
            return (float(result), int(result), bool(result))[slot] if 0 <= slot < 3 else UNKNOWN
        if ctype == "ComfyNotNode":
            x = self.value(ins.get("value", UNKNOWN), depth)
            return UNKNOWN if x is UNKNOWN else (not x)
        if ctype in ("ComfyAndNode", "ComfyOrNode"):
            xs = [self.value(v, depth) for k, v in ins.items() if k.startswith("values.")]
            if not xs or any(x is UNKNOWN for x in xs):
                return UNKNOWN
            return all(xs) if ctype == "ComfyAndNode" else any(xs)
        if ctype in STRING_NODES:
            return self._string(node, slot, depth)
        if ctype == "ResolutionSelector":  # comfy_extras/nodes_resolution.py
            ratio = self.value(ins.get("aspect_ratio", UNKNOWN), depth)
            mp, multiple = self.value(ins.get("megapixels", UNKNOWN), depth), self.value(ins.get("multiple", 1), depth)
            try:
                w, h = (int(x) for x in str(ratio).split(" ")[0].split(":"))
                scale = math.sqrt(float(mp) * 1024 * 1024 / (w * h))
                return (round(w * scale / int(multiple)) * int(multiple),
                        round(h * scale / int(multiple)) * int(multiple))[slot]
            except (TypeError, ValueError, ZeroDivisionError, IndexError, OverflowError):
                return UNKNOWN
        if ctype == "ComfyNumberConvert":
            x = self.value(ins.get("value", UNKNOWN), depth)
            try:
                return UNKNOWN if x is UNKNOWN else (float(x), int(float(x)))[slot]
            except (TypeError, ValueError, IndexError, OverflowError):
                return UNKNOWN
        return UNKNOWN

    def _string(self, node: FlatNode, slot: int, depth: int) -> Any:
        """The text nodes a template computes a setting with (ComfyUI's comfy_extras/nodes_string.py, CustomCombo)."""
        ctype = node.class_type
        ins = {k: self.value(v, depth) for k, v in node.inputs.items()}
        if any(v is UNKNOWN for v in ins.values()):
            return UNKNOWN
        try:
            if ctype == "CustomCombo":
                return (ins.get("choice", UNKNOWN), ins.get("index", 0))[slot]
            if ctype == "StringConcatenate":
                return f"{ins['string_a']}{ins.get('delimiter', '')}{ins['string_b']}"[:MAX_TEXT]
            if ctype == "StringReplace":
                return str(ins["string"]).replace(str(ins["find"]), str(ins["replace"]))[:MAX_TEXT]
            text = str(ins["json_string"])  # JsonExtractString
            if len(text) > MAX_TEXT:
                return UNKNOWN
            data = json.loads(text)
            value = data.get(ins["key"]) if isinstance(data, dict) else None
            return "" if value is None else str(value)
        except (KeyError, IndexError, TypeError, ValueError, RecursionError):
            return UNKNOWN

    def _math(self, node: FlatNode, depth: int) -> Any:
        expression = node.inputs.get("expression")
        if not isinstance(expression, str) or not expression.strip() or len(expression) > MAX_EXPRESSION:
            return UNKNOWN
        names = {k.split(".", 1)[1]: self.value(v, depth) for k, v in node.inputs.items() if k.startswith("values.")}
        if any(x is UNKNOWN for x in names.values()):
            return UNKNOWN
        try:
            from simpleeval import simple_eval
        except ImportError:
            self.notes.append(f"math expression {self.flat.where(node.id)} not evaluated: simpleeval (ComfyUI's "
                              f"evaluator) is not installed")
            return UNKNOWN
        context: dict[str, Any] = dict(names)
        context["values"] = list(names.values())
        try:
            result = simple_eval(expression, names=context, functions=MATH_FUNCTIONS)
        except Exception:  # noqa: BLE001 - what ComfyUI would refuse when it runs: unknown here
            return UNKNOWN
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            return UNKNOWN
        try:
            return result if math.isfinite(float(result)) else UNKNOWN
        except OverflowError:
            return UNKNOWN

    # --- switches
    def branch(self, node: FlatNode, depth: int = 0) -> str | None:
        """The input a switch passes on ("on_true" / "on_false"), None when it cannot be known before running."""
        ins = node.inputs
        if node.class_type == "ComfySoftSwitchNode":
            if "on_false" not in ins:
                return "on_true"
            if "on_true" not in ins:
                return "on_false"
        switch = self.value(ins.get("switch", UNKNOWN), depth)
        if switch is UNKNOWN:
            return None
        return "on_true" if switch else "on_false"

    def route(self, v: Any) -> Any:
        """A link followed through switches whose branch is known: the node that really feeds an input."""
        seen = set()
        while is_link(v) and v[0] not in seen:
            seen.add(v[0])
            node = self.flat.nodes.get(v[0])
            if node is None or node.class_type not in SWITCHES:
                return v
            branch = self.branch(node)
            if branch is None:
                return v
            v = node.inputs.get(branch)
        return v

    # --- what runs
    def is_output(self, node: FlatNode) -> bool:
        """An output node: ComfyUI's definition says so; else a UI node with no outputs; else (an unknown type in
        API JSON) a node nothing else reads."""
        known = self.defs.is_output(node.class_type)
        if known is not None:
            return known
        if node.outputs is not None:
            return not node.outputs
        return node.id not in self._read_by()

    def _read_by(self) -> set[str]:
        return {v[0] for n in self.flat.nodes.values() for v in n.inputs.values() if is_link(v)}

    def reached(self, every_branch: bool = False) -> set[str]:
        """The nodes ComfyUI runs: the output nodes and what they need, a switch's unchosen branch left out (taken
        too with `every_branch`)."""
        todo = [nid for nid, n in self.flat.nodes.items() if self.is_output(n)]
        if not todo:  # ComfyUI would refuse it ("prompt has no outputs"); read it as if its last nodes were
            read = self._read_by()
            todo = [nid for nid in self.flat.nodes if nid not in read]
            self.notes.append("the workflow has no output node (Save / Preview ...): the nodes nothing reads are "
                              "taken as its outputs")
        done: set[str] = set()
        while todo:
            nid = todo.pop()
            if nid in done or nid not in self.flat.nodes:
                continue
            done.add(nid)
            node = self.flat.nodes[nid]
            skip: set[str] = set()
            if node.class_type in SWITCHES and not every_branch:
                branch = self.branch(node)
                if branch is not None:
                    skip = {"on_true", "on_false"} - {branch}
            todo.extend(v[0] for k, v in node.inputs.items() if is_link(v) and k not in skip)
        return done

"""Before a run, what will happen: `prediction.predict` gives the same plan and the step time without running the
engine, from a `cost_profile.Profile` of the model: a named card (`cards`) prices `meta_costs`' one forward on the
meta device, or `device_timing` measures it on the device; `plan_cli` is `python -m offload plan`.

The whole workflow (`workflow.plan_workflow`, the panel's and `python -m offload plan workflow.json`'s): the graph
read as ComfyUI runs it (`workflow_read.flatten`: subgraphs, reroutes, primitives, muted / bypassed nodes, over
`workflow_flat`'s shapes; `workflow_values`: the value nodes, switches and what runs; `comfy_nodes`: ComfyUI's node
definitions and loaders), what the plan needs found in it (`workflow_graph`), each loader's file read to its header
(`model_files`), told apart (`model_kinds`) and priced from its tensor shapes (`header_costs`), every model planned
with the same `predict_profile`.

    plan_workflow(graph: dict, find_file: Callable[[str, str], str | None], card: Card | str | None = None,
                  ram_bytes: int | None = None, presets: Sequence[str] | None = None,
                  defs: NodeDefs | None = None, remote: RemoteHeaders | None = None) -> WorkflowPlan
    WorkflowPlan.to_dict() -> dict (strict JSON: card, models, run, ram, notes, graph, downloads)
    flatten(graph, defs=None) -> FlatGraph  (workflow_read: the nodes ComfyUI runs, each with its subgraph path)

Missing models a workflow links (`model_links`) are planned from their headers read by range requests
(`remote_headers`, kept by `header_cache`) through `header_source.RemoteHeaders`, plan_workflow's `remote`.

Layer: an application of the engine, above the entry points (device_timing offloads a model to time it); imports
everything below. Nothing in the engine imports it; `offload/__init__` and `__main__` do.
Used from outside: `predict`, `Prediction`, `predict_configs`, `predict_profile`, `profile_model`, `unit_sizes`,
`analyse_on_meta` (re-exported here, as `offload.predict` named them before the move), `cards.Card`,
`cards.get_card`, `plan_cli.main`, `plan_workflow`, `WorkflowPlan`, `ModelPlan`, `WorkflowError`,
`card_from_figures`, `cards.CARDS`, `cards.match_card` (the table's card for a CUDA device name), `NodeDefs`
(ComfyUI's node definitions for reading a workflow; nodes/ builds one from the running server's classes),
`workflow_read.flatten`.
"""
from .prediction import (CONTEXT_BYTES, DEFAULT_DISK_GBPS, BlockPrediction, Prediction, analyse_on_meta,  # noqa: F401
                         predict, predict_configs, predict_profile, profile_model, unit_sizes)
from .workflow import ModelPlan, WorkflowPlan, card_from_figures, plan_workflow  # noqa: E402,F401
from .comfy_nodes import NodeDefs  # noqa: E402,F401
from .workflow_flat import WorkflowError  # noqa: E402,F401

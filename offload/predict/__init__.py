"""Before a run, what will happen: `prediction.predict` gives the same plan and the step time without running the
engine, from a `cost_profile.Profile` of the model: a named card (`cards`) prices `meta_costs`' one forward on the
meta device, or `device_timing` measures it on the device; `plan_cli` is `python -m offload plan`.

Layer: an application of the engine, above the entry points (device_timing offloads a model to time it); imports
everything below. Nothing in the engine imports it; `offload/__init__` and `__main__` do.
Used from outside: `predict`, `Prediction`, `predict_configs`, `predict_profile`, `profile_model`, `unit_sizes`,
`analyse_on_meta` (re-exported here, as `offload.predict` named them before the move), `cards.Card`,
`cards.get_card`, `plan_cli.main`.
"""
from .prediction import (CONTEXT_BYTES, DEFAULT_DISK_GBPS, BlockPrediction, Prediction, analyse_on_meta,  # noqa: F401
                         predict, predict_configs, predict_profile, profile_model, unit_sizes)

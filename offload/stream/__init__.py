"""The hot path: `streamer.ModelStreamer` owns one pass (its lock, the per-unit hooks, the learned order) and
composes the parts that act at its safe points: `placement` (resident set, slot ring, device bytes), `prefetch`
(the prefetch worker: which unit is copied into which slot), `host_tiers` (RAM or disk masters, giving RAM back),
`write_watch` (weights written in place; `data_watch`: writes through `Parameter.data`), `restage` (tensors added
or removed after offloading, LoRA layers, laid out again), `buffer_writes` (buffers a unit writes reach the host master),
`outputs`, `pass_lock`, `backward` (training through streamed units), `compile_support` (torch.compile),
and `devices` (several devices). `hooks.ModelHooks` puts the engine's hooks on the model. The plan the streamer applies
comes from plan/ (`replan.PlanKeeper` hands it over).

Layer: below the entry points (handle, setup); imports budget/, plan/, store/, model/, report/, backends/ and the
config vocabulary; nothing in those imports it.
Used from outside: `streamer.ModelStreamer`, `hooks.ModelHooks`,
`backward.TrainableWeightError`, `devices.SecondaryDevices`, `pass_lock.PassLock`,
`restage.resized_facts` (the handle's plan facts after a unit was laid out again).
"""

"""Where each unit lives, decided in one place: `planner.make_plan(PlanFacts) -> Plan` is a pure function of facts
(sizes, allowances, RAM ceiling, measured costs); `plan_device` (resident set and slot ring, by count or by cost,
across devices) and `plan_host` (pinned / pageable / disk tiers; `plan_compress`: which masters are held
compressed) are its two halves, `facts` what it is made from, `ring_sim` the stall model
it compares plans with, `cost_model.CostTracker` the measured costs it is fed, and `replan.PlanKeeper` decides WHEN to
plan again (the budget's share, measured costs, stalls beyond the prediction, memory freed after an OOM) and hands
the plan to the streamer, which applies it.

Layer: below budget/ and stream/; imports only store/ (the codec's name and what pays) and backends/ (the Backend
type the keeper asks for free memory).
Everything but the keeper is a pure function of its facts.
Used from outside: `planner.make_plan`, `planner.Plan`, `planner.PlanFacts`, `planner.HostFacts`,
`planner.PlanError`, `planner.RamCeilingError`, `planner.default_reserve`, `ring_sim.simulate_pass`,
`cost_model.CostTracker`, `replan.PlanKeeper`, `plan_compress.choose_compressed`.
"""

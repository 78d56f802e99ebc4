"""Where each unit lives, decided in one place: `planner.make_plan(PlanFacts) -> Plan` is a pure function of facts
(sizes, allowances, RAM ceiling, measured costs); `plan_device` (resident set and slot ring, by count or by cost,
across devices) and `plan_host` (pinned / pageable / disk tiers) are its two halves, `ring_sim` the stall model
it compares plans with, `cost_model.CostTracker` the measured costs it is fed. When to plan again is
`stream/replan.PlanKeeper`'s job; applying a plan is the streamer's.

Layer: pure, below budget/ and stream/; imports nothing from offload/ but itself.
Used from outside: `planner.make_plan`, `planner.Plan`, `planner.PlanFacts`, `planner.HostFacts`,
`planner.PlanError`, `planner.RamCeilingError`, `planner.default_reserve`, `ring_sim.simulate_pass`,
`cost_model.CostTracker`.
"""

"""One VRAM budget shared by every model on a device: `vram_budget.VramBudget` (totals, shares by priority then
recency, watermarks, waiting for another model's safe point), `recency.Recency` (the clock of who leads a
priority), `membership.BudgetMembership` (what the budget asks of a handle), `reserve` (the activation reserve
measured after a run).

Layer: below stream/ and the entry points; imports plan/, backends/ and the config vocabulary.
Used from outside: `VramBudget`, `BudgetError`, `default_budget` (re-exported here, as `offload.budget` named them
before the move), `reserve.reserve_from_peak`, `membership.BudgetMembership`.
"""
from .recency import PHASE_PASSES  # noqa: F401
from .vram_budget import HOW_TO_CHANGE, BudgetError, BudgetMember, VramBudget, default_budget  # noqa: F401

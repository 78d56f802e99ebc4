"""The README's presets table is the engine's preset table (offload/config.py PRESETS), not a copy of it."""
from __future__ import annotations

import os

from offload import PRESETS, budget_preset_tooltip, preset_tooltip, presets_markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_presets_table_matches_the_preset_table():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    table = presets_markdown_table()
    assert table in readme, ("README.md's presets table differs from PRESETS; paste this in:\n" + table)


def test_every_preset_appears_in_the_tooltips_and_the_table():
    table = presets_markdown_table()
    for name, policy in PRESETS.items():
        assert f"`{name}`" in table and policy.description in table
        assert f"{name}: {policy.description}" in preset_tooltip()
        assert f"{name} {policy.budget_fraction:.0%}" in budget_preset_tooltip()

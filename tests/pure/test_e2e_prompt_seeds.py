"""The end-to-end tests share engines across a session, and D's prefix cache
remembers every prompt it saw: two tests drawing `token_prompt(..., seed=S)` with
the same literal seed produce prompts where one is a prefix of the other, so
the second test's D reads fewer tokens than it asks for and its external-KV
count comes out short (CI failed this way once). Each literal seed is unique."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "e2e"
LITERAL_SEED = re.compile(r"token_prompt\(\s*[^,()]+,\s*(?:seed=)?([0-9_]+)\s*\)")


def test_literal_prompt_seeds_are_unique_across_e2e_tests() -> None:
    where: dict[int, list[str]] = defaultdict(list)
    for path in sorted(E2E.glob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for match in LITERAL_SEED.finditer(line):
                where[int(match.group(1).replace("_", ""))].append(f"{path.name}:{lineno}")
    assert len(where) > 20, "the pattern no longer finds the tests' prompts"
    shared = {seed: places for seed, places in where.items() if len(places) > 1}
    assert not shared, f"prompt seeds used by more than one test: {shared}"

"""Adaptive draft budget: how many tree nodes to verify this step, learned from measured speed.

SGLang verifies ``num_draft_tokens`` nodes every step, which suits GPUs, where a verify forward
of 8 or 64 rows costs about the same as one of 1 row. On a CPU it does not (demo model, 2
cores, fp32: 2 rows cost 1.16x one row, 8 rows 1.5x, 16 rows 2.3x), so the best tree size
depends on the hardware, the draft quality and the text. ``DraftBudget`` treats the sizes
``1, 2, 4, 8, ... , num_draft_tokens`` as arms of a bandit, per batch size: every decode step
reports its tokens and wall time (drafting included) and the budget keeps, per size, decayed
sums of both; their ratio is the size's tokens/s (a ratio of sums, because single steps are
very noisy: one verify accepts nothing, the next six tokens). It tries every size during a short warm-up, then plays
the best one and, with a small probability, a neighbouring size. Size 1 means "skip drafting
this step" (a plain decode step), so a draft that does not pay for itself is switched off.

Greedy output does not depend on the sizes chosen: any tree verifies to the same tokens.
"""
from __future__ import annotations

import random


def budget_sizes(num_draft_tokens: int) -> list[int]:
    sizes, s = [1], 2
    while s < num_draft_tokens:
        sizes.append(s)
        s *= 2
    sizes.append(num_draft_tokens)
    return sizes


class DraftBudget:
    def __init__(self, num_draft_tokens: int, adaptive: bool = True, warmup: int = 3,
                 explore: float = 0.1, decay: float = 0.97, seed: int = 0):
        self.max_size = num_draft_tokens
        self.adaptive = adaptive
        self.sizes = budget_sizes(num_draft_tokens)
        self.warmup, self.explore, self.decay = warmup, explore, decay
        self.sums: dict[int, dict[int, list[float]]] = {}   # batch size → {tree size: [tokens, seconds]}
        self.drafted: dict[int, dict[int, list[float]]] = {}   # the same over steps that had a draft
        self.trials: dict[int, dict[int, int]] = {}    # batch size → {tree size: steps observed}
        self.chosen: dict[int, int] = {s: 0 for s in self.sizes}   # how often each size was played
        self._rng = random.Random(seed)

    def rates(self, batch: int, drafted_only: bool = False) -> dict[int, float]:
        """Measured tokens/s per tree size for steps of ``batch`` requests (``drafted_only``:
        over the steps where the drafter proposed something)."""
        table = (self.drafted if drafted_only else self.sums).get(batch, {})
        return {s: tok / sec for s, (tok, sec) in table.items() if sec > 0}

    def best(self, batch: int) -> int:
        """Sizes > 1 are ranked on steps that had a draft (steps without one say nothing about
        the tree size); the winner then competes with size 1 on all its steps."""
        ranked = {s: r for s, r in self.rates(batch, drafted_only=True).items() if s > 1}
        if not ranked:
            return self.max_size
        size = max(ranked, key=lambda s: (ranked[s], s))
        overall = self.rates(batch)
        if 1 in overall and size in overall and overall[1] > overall[size]:
            return 1
        return size

    def choose(self, batch: int) -> int:
        """Tree size (nodes incl. the root) per request for a decode step of ``batch`` requests."""
        if not self.adaptive:
            return self.max_size
        trials = self.trials.setdefault(batch, {s: 0 for s in self.sizes})
        under = [s for s in self.sizes if trials[s] < self.warmup]
        if under:
            size = under[-1]   # warm up largest first: the default behaviour comes first
        else:
            size = self.best(batch)
            if self._rng.random() < self.explore:
                i = self.sizes.index(size)
                size = self.sizes[max(0, min(len(self.sizes) - 1, i + self._rng.choice((-1, 1))))]
        self.chosen[size] += 1
        return size

    def observe(self, batch: int, size: int, tokens: int, seconds: float, drafted: bool = True) -> None:
        """One decode step: ``tokens`` emitted in ``seconds``; ``drafted``: any request had a draft."""
        if not self.adaptive or seconds <= 0:
            return
        tables = [self.sums] + ([self.drafted] if drafted or size == 1 else [])
        for table in tables:
            acc = table.setdefault(batch, {}).setdefault(size, [0.0, 0.0])
            acc[0] = acc[0] * self.decay + tokens
            acc[1] = acc[1] * self.decay + seconds
        if drafted or size == 1:
            self.trials.setdefault(batch, {s: 0 for s in self.sizes})[size] += 1

    def summary(self) -> dict[int, int]:
        """How often each tree size was played (sizes never played are left out)."""
        return {s: n for s, n in self.chosen.items() if n}

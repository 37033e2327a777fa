"""Adaptive draft budget: how many tree nodes to verify this step, learned from measurements.

SGLang verifies ``num_draft_tokens`` nodes every step, which suits GPUs, where a verify forward
of 8 or 64 rows costs about the same as one of 1 row. On a CPU it does not (demo model, 2
cores, fp32: 2 rows cost 1.16x one row, 8 rows 1.5x, 16 rows 2.3x), so the best tree size
depends on the hardware, the draft quality and the text. For each batch size, ``DraftBudget``
estimates, for the sizes ``1, 2, 4, 8, ..., num_draft_tokens``:

* the **cost** of a step played at that size (decayed mean wall time, drafting included);
* the **yield**, tokens emitted per step. Yields are compared on the *same* steps: after a
  step verified a tree of size S, the worker also reports what every smaller size would have
  emitted (the accepted path cut to the best ``s - 1`` candidates by score, plus the bonus
  token), so text that is easy for a while does not favour whichever size ran then.

It plays the size with the best yield/cost; with a small probability it plays the next larger
size (which also measures the yields of all smaller ones) or the next smaller one (whose cost
may be stale), and more rarely the largest. Exploring a larger size is scaled down by how much
slower it has measured (``exp(-gap / 0.1)``, gap = 1 - its rate / the best rate; at least a
fifth of the base rate; only once it has been played 8 times, as a yield is 0 or 6 tokens a
step): where drafting measured 25% slower (8 requests in flight on a 2-core CPU) it is explored
a fifth as often as where the sizes are close. A smaller size (a plain step, cheap) is always
refreshed at the base rate, so a stale slow measurement of it cannot lock drafting in.
A batch size seen for the first time, with a warm batch size within a factor of 2 (requests
finishing one by one make batch sizes that last a few steps each), plays plain steps first (cheap)
and then starts from the neighbour's tables: its costs times this batch size's plain step over the
neighbour's (what drafting costs relative to a plain step carries over), its yields times the
ratio of the batch sizes, each weighted as one step, so its own steps soon outweigh them; the
neighbour's plays count towards the 8 after which a slower size is explored less. Without
that, every new batch size warmed up on the largest tree: at 8 requests in flight on a 2-core CPU
such a step cost 3-4x a plain one, and batch sizes met for a few steps per burst never left their
warm-up.
Size 1 means "skip drafting this step" (a plain decode step), so a draft that does not pay for
itself is switched off. Steps on which no request had a draft
(an n-gram miss) say nothing about tree sizes and are not counted.

Greedy output does not depend on the sizes chosen: any tree verifies to the same tokens.
"""

from __future__ import annotations

import math
import random

from .tree import select_candidates
from .types import DraftCandidates


def budget_sizes(num_draft_tokens: int) -> list[int]:
    sizes, s = [1], 2
    while s < num_draft_tokens:
        sizes.append(s)
        s *= 2
    sizes.append(num_draft_tokens)
    return sizes


def accepted_path(cands: DraftCandidates, accepted_tokens: list[int]) -> list[int]:
    """Indices of the candidates the accepted draft tokens (root's child first) went through."""
    child = {}
    for i, (p, t) in enumerate(zip(cands.parents.tolist(), cands.tokens.tolist())):
        child.setdefault((p, t), i)
    path, parent = [], -1
    for tok in accepted_tokens:
        c = child.get((parent, tok))
        if c is None:
            break
        path.append(c)
        parent = c
    return path


def accepted_within(cands: DraftCandidates, accepted_tokens: list[int], keep: set[int]) -> int:
    """How many of the accepted draft tokens (root's child first) a tree holding only the
    candidates ``keep`` would have accepted: the accepted path's prefix inside ``keep``."""
    n = 0
    for c in accepted_path(cands, accepted_tokens):
        if c not in keep:
            break
        n += 1
    return n


def counterfactual_yields(sizes: list[int], played: int, cands: list[DraftCandidates], accepted: list[list[int]]) -> dict[int, int]:
    """Tokens the step would have emitted at each size <= ``played`` (summed over requests)."""
    out = {}
    for s in sizes:
        if s > played:
            break
        total = 0
        for c, acc in zip(cands, accepted):
            keep = set(select_candidates(c, s - 1)) if s > 1 else set()
            total += accepted_within(c, acc, keep) + 1
        out[s] = total
    return out


class _Decayed:
    """Decayed mean."""

    __slots__ = ("total", "weight")

    def __init__(self, total: float = 0.0, weight: float = 0.0):
        self.total, self.weight = total, weight

    def add(self, value: float, decay: float) -> None:
        self.total = self.total * decay + value
        self.weight = self.weight * decay + 1.0

    @property
    def mean(self) -> float:
        return self.total / self.weight


class DraftBudget:
    def __init__(
        self,
        num_draft_tokens: int,
        adaptive: bool = True,
        warmup: int = 2,
        explore: float = 0.1,
        explore_temperature: float = 0.1,
        explore_floor: float = 0.2,
        explore_confident_after: int = 8,
        decay: float = 0.98,
        cost_decay: float = 0.8,
        seed: int = 0,
        sizes: list[int] | None = None,
        seed_new_batch_sizes: bool = True,
    ):
        self.max_size = num_draft_tokens
        self.adaptive = adaptive
        self.sizes = sizes or budget_sizes(num_draft_tokens)
        # yields are noisy (0 or 6 accepted) and need a long memory; step costs are steady
        # (hardware, context length) and a short one forgets outliers such as a cold first step
        self.warmup, self.explore, self.decay, self.cost_decay = warmup, explore, decay, cost_decay
        self.explore_temperature, self.explore_floor = explore_temperature, explore_floor
        self.explore_confident_after = explore_confident_after
        self.seed_new_batch_sizes = seed_new_batch_sizes
        self._seed_from: dict[int, int] = {}  # new batch size → the warm neighbour it starts from once its plain cost is measured
        self.cost: dict[int, dict[int, _Decayed]] = {}  # batch size → {tree size: seconds per step}
        self.yields: dict[int, dict[int, _Decayed]] = {}  # batch size → {tree size: tokens per step}
        self.played: dict[int, dict[int, int]] = {}  # batch size → {tree size: steps measured}
        self.timed: dict[int, dict[int, int]] = {}  # batch size → {tree size: steps whose time was counted}
        self.inherited: dict[int, dict[int, int]] = {}  # batch size → {tree size: plays of the warm neighbour it was seeded from}
        self.chosen: dict[int, int] = {s: 0 for s in self.sizes}  # how often each size was played
        self._rng = random.Random(seed)

    def rates(self, batch: int) -> dict[int, float]:
        """Estimated tokens/s per tree size for steps of ``batch`` requests."""
        cost, yields = self.cost.get(batch, {}), self.yields.get(batch, {})
        return {s: yields[s].mean / cost[s].mean for s in self.sizes if s in cost and s in yields and cost[s].mean > 0}

    def best(self, batch: int, rates: dict[int, float] | None = None) -> int:
        """The size with the best tokens/s (``rates``: ``self.rates(batch)`` when already made)."""
        rates = self.rates(batch) if rates is None else rates
        if not rates:
            return self.max_size
        return max(rates, key=lambda s: (rates[s], s))

    def choose(self, batch: int, explore: bool = True) -> int:
        """Tree size (nodes incl. the root) per request for a decode step of ``batch`` requests;
        ``explore=False``: the best size (warm-up still plays every size)."""
        if not self.adaptive:
            return self.max_size
        if batch not in self.played:
            self.played[batch] = {s: 0 for s in self.sizes}
            near = self._neighbour(batch) if self.seed_new_batch_sizes else None
            if near is not None:
                self._seed_from[batch] = near
        played = self.played[batch]
        if batch in self._seed_from:
            if played[1] < self.warmup:  # plain steps first: their cost scales the neighbour's
                self.chosen[1] += 1
                return 1
            near = self._seed_from.pop(batch)
            if 1 in self.cost.get(batch, {}):
                self._seed(batch, near)
        under = [s for s in self.sizes if played[s] < self.warmup]
        if under:
            size = under[-1]  # largest first: it measures every size's yield
        else:
            size = self.best(batch)
            u = self._rng.random() if explore else 1.0
            i = self.sizes.index(size)
            if u < self.explore / 4:
                size = self._explore_larger(batch, size, self.max_size)
            elif u < self.explore / 2 and i > 0:  # refresh a smaller size's cost (yields come free)
                size = self.sizes[i - 1]
            elif u < self.explore and i + 1 < len(self.sizes):
                size = self._explore_larger(batch, size, self.sizes[i + 1])
        self.chosen[size] += 1
        return size

    def _neighbour(self, batch: int) -> int | None:
        """The nearest batch size (the smaller on a tie) within a factor of 2 of ``batch`` whose
        sizes all left their warm-up, if any."""

        def warm(b: int) -> bool:
            return b not in self._seed_from and all(self.played[b][s] >= self.warmup for s in self.sizes) and 1 in self.cost.get(b, {})

        near = [b for b in self.played if b != batch and max(b, batch) <= 2 * min(b, batch) and warm(b)]
        return min(near, key=lambda b: (abs(b - batch), b)) if near else None

    def _seed(self, batch: int, near: int) -> None:
        """``batch``'s tables from ``near``'s: costs times the ratio of their plain steps, yields
        times ``batch / near``, each weighted as one step; sizes ``near`` has both for count as
        warmed up (its best is then played first; a size seeded too high is corrected by playing
        it, one seeded too low by exploration)."""
        own_plain = self.cost[batch][1].mean
        cost_scale, yield_scale = own_plain / self.cost[near][1].mean, batch / near
        cost, yields = self.cost[batch], self.yields.setdefault(batch, {})
        for s, d in self.cost[near].items():
            if s != 1 and s in self.yields.get(near, {}):
                cost[s] = _Decayed(d.mean * cost_scale, 1.0)
                yields[s] = _Decayed(self.yields[near][s].mean * yield_scale, 1.0)
                self.played[batch][s] = max(self.played[batch][s], self.warmup)
                self.inherited.setdefault(batch, {})[s] = self.played[near][s] + self.inherited.get(near, {}).get(s, 0)

    def explore_weight(self, batch: int, best: int, size: int) -> float:
        """The share of the base exploration rate a larger ``size`` gets: ``exp(-gap / T)`` (gap =
        how much slower it measured than ``best``), floored; 1 until it has been played
        ``explore_confident_after`` times (a yield of 0 or 6 tokens a step needs a few plays),
        counting the plays of the neighbour a new batch size was seeded from (its verdict carried
        over with its tables: at 8 requests in flight the batch sizes of a wave's tail, each met
        for a few steps, explored at the full rate until 8 plays each)."""
        rates = self.rates(batch)
        plays = self.played.get(batch, {}).get(size, 0) + self.inherited.get(batch, {}).get(size, 0)
        if size not in rates or not rates.get(best) or plays < self.explore_confident_after:
            return 1.0
        gap = max(0.0, 1.0 - rates[size] / rates[best])
        return max(self.explore_floor, math.exp(-gap / self.explore_temperature))

    def _explore_larger(self, batch: int, best: int, size: int) -> int:
        return size if size <= best or self._rng.random() < self.explore_weight(batch, best, size) else best

    def observe(self, batch: int, size: int, seconds: float | None, yields: dict[int, int] | None) -> None:
        """One decode step played at ``size`` took ``seconds``; ``yields``: tokens it emitted and
        would have emitted at each smaller size (None: no request had a draft). ``seconds=None``:
        the step's time says nothing about the size (the drafter caught up after plain steps)."""
        if not self.adaptive or (seconds is not None and seconds <= 0):
            return
        if size == 1:
            yields = {1: batch}
        if yields is None:
            return
        if seconds is not None:
            self.cost.setdefault(batch, {}).setdefault(size, _Decayed()).add(seconds, self.cost_decay)
            timed = self.timed.setdefault(batch, {})
            timed[size] = timed.get(size, 0) + 1
        table = self.yields.setdefault(batch, {})
        for s, tokens in yields.items():
            table.setdefault(s, _Decayed()).add(tokens, self.decay)
        self.played.setdefault(batch, {s: 0 for s in self.sizes})[size] += 1

    def times_known(self, batch: int, size: int, steps: int) -> bool:
        """Whether ``size``'s cost at ``batch`` rests on at least ``steps`` timed steps of its own
        (a neighbour's seeded table does not count)."""
        return self.timed.get(batch, {}).get(size, 0) >= steps

    def summary(self) -> dict[int, int]:
        """How often each tree size was played (sizes never played are left out)."""
        return {s: n for s, n in self.chosen.items() if n}

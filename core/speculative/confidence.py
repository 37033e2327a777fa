"""Confidence pruning: per step, verify only the draft nodes that are expected to pay for themselves.

The draft budget (``speculative/budget.py``) picks one tree size per step from measured averages; but
how good a draft is varies from step to step, and the drafter knows it: a node whose draft
probability is 0.9 is accepted most of the time, one at 0.01 almost never. On hardware where
every verified row costs time (CPUs), verifying the unlikely nodes loses more than it wins.

* ``AcceptanceCalibration`` maps a candidate's score (EAGLE-style drafters: the cumulative draft
  log-probability; its ``exp`` is the draft's own probability that the node is on the target's
  path) to the probability that the target accepts it, learned online from verified trees:
  decayed acceptance counts in probability bins, starting from the draft's own probability.
* ``NodeCost`` learns the marginal seconds one more verified node adds to a step (drafting it
  included): a decayed least-squares fit of step time on verified nodes, per batch size.
* A node adds P(accept) tokens to the step and ``NodeCost.slope`` seconds, so it raises the
  step's tokens/s exactly when ``P(accept) >= tokens/s now x seconds per node`` -- the
  **threshold**. ``ConfidencePruning.prune`` keeps each request's candidates in score order
  (the tree builder's ranking, closed under ancestors) up to the first one below the threshold;
  ``score_floor`` gives drafters the score below which expanding a beam is wasted
  (``StepPlan.score_floor``), so low-confidence steps also draft less deeply (except exploring
  steps: they draft the whole depth, so the calibration keeps seeing what the floor would cut).

A small share of steps (``explore``) verifies a random number of the best nodes instead, so the
calibration keeps seeing nodes below the threshold and the cost fit sees every tree size. With
pruning on, the draft budget only decides how much to draft: not at all, one token (depth 1) or the
whole tree (sizes 1, 2 and ``num_draft_tokens``); the whole tree's size is this module's per-step
decision. Greedy output never depends on
any of this: any tree verifies to the same tokens.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass


from .budget import accepted_path
from .types import DraftCandidates

# bin edges on the draft probability exp(score); finer where the pruning decision usually falls
PROB_EDGES = (0.0, 0.01, 0.02, 0.04, 0.07, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class AcceptanceCalibration:
    """P(target accepts a node | its draft probability), learned from verified nodes."""

    def __init__(self, prior_weight: float = 4.0, decay: float = 0.995):
        self.prior_weight, self.decay = prior_weight, decay
        n = len(PROB_EDGES)
        upper = PROB_EDGES[1:] + (1.0,)
        self.prior = [(lo + hi) / 2 for lo, hi in zip(PROB_EDGES, upper)]
        self.accepted = [0.0] * n
        self.seen = [0.0] * n

    @staticmethod
    def bin_of(score: float) -> int:
        p = math.exp(min(score, 0.0))
        return bisect.bisect_right(PROB_EDGES, p) - 1

    def prob_in_bin(self, b: int) -> float:
        return (self.accepted[b] + self.prior_weight * self.prior[b]) / (self.seen[b] + self.prior_weight)

    def prob(self, score: float) -> float:
        return self.prob_in_bin(self.bin_of(score))

    def observe(self, score: float, accepted: bool) -> None:
        b = self.bin_of(score)
        self.accepted[b] = self.accepted[b] * self.decay + float(accepted)
        self.seen[b] = self.seen[b] * self.decay + 1.0

    def score_floor(self, threshold: float) -> float:
        """The lowest score whose bin, and every bin above it, clears ``threshold``
        (-inf when every bin does)."""
        floor = -math.inf
        for b in range(len(PROB_EDGES) - 1, -1, -1):
            if self.prob_in_bin(b) < threshold:
                return floor
            floor = math.log(PROB_EDGES[b]) if PROB_EDGES[b] > 0 else -math.inf
        return floor


class NodeCost:
    """Marginal seconds per verified node: decayed least squares of step seconds on nodes and on
    the tokens the step produced. A step's time also grows with its tokens (committing their KV,
    the drafter catching up on them, sampling and streaming), which every decoder pays per token,
    plain or not; steps that verify more nodes accept more tokens, so a fit on nodes alone would
    charge that per-token work to the nodes (for ngram on HumanEval: 0.34 ms a node, pruning nodes
    that paid). With too little spread in tokens apart from nodes, the fit is on nodes alone."""

    def __init__(self, decay: float = 0.98, min_spread: float = 0.2, min_steps: float = 3.0):
        self.decay, self.min_spread, self.min_steps = decay, min_spread, min_steps  # 0.2: a 1-node chain's 0/1 trees fit
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.sz = self.szz = self.sxz = self.szy = 0.0

    def observe(self, nodes: int, seconds: float, tokens: int | None = None) -> None:
        d, z = self.decay, float(tokens if tokens is not None else 0)
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + nodes
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + nodes * nodes
        self.sxy = self.sxy * d + nodes * seconds
        self.sz = self.sz * d + z
        self.szz = self.szz * d + z * z
        self.sxz = self.sxz * d + nodes * z
        self.szy = self.szy * d + z * seconds

    @property
    def slope(self) -> float | None:
        """Seconds per node, or None while the nodes seen vary too little to fit a slope."""
        if self.w < self.min_steps:
            return None
        w = self.w
        mx, my, mz = self.sx / w, self.sy / w, self.sz / w
        var = self.sxx / w - mx * mx
        if var < self.min_spread:
            return None
        cov = self.sxy / w - mx * my
        vz, cxz, czy = self.szz / w - mz * mz, self.sxz / w - mx * mz, self.szy / w - mz * my
        # tokens' spread left once nodes explain what they can (the Schur complement)
        if vz - cxz * cxz / var >= self.min_spread:
            return max((vz * cov - cxz * czy) / (var * vz - cxz * cxz), 0.0)
        return max(cov / var, 0.0)


@dataclass(frozen=True)
class Cut:
    """How one step cuts each request's candidates: below ``threshold`` (acceptance probability),
    or, when ``keep`` is set (exploring steps), to the ``keep`` best. Drafting stops below the
    threshold's score floor on steady steps only: an exploring step drafts the whole depth, or the
    calibration never sees a node below the floor and a bin the prior rates low stays low (a
    self-draft's chain is accepted ~95% a node at cumulative draft probabilities the prior puts
    at 0.05-0.3: over a fresh engine's first 12 MT-bench answers its steps were cut to 3.1
    tokens instead of 5.5, until the rare exploring step's depth-limited trees taught the bins;
    over 80 answers both reach 5.55; session 47). The default keeps everything."""

    threshold: float = 0.0
    keep: int | None = None

    @property
    def at_random(self) -> bool:
        """A random number of nodes kept (an exploring step, or one before the cost fit): what
        it yields and costs is not what the steady cut's steps do."""
        return self.keep is not None


class ConfidencePruning:
    def __init__(self, enabled: bool = True, explore: float = 0.05, seed: int = 1):
        self.enabled = enabled
        self.explore = explore
        self.calibration = AcceptanceCalibration()
        self.costs: dict[int, NodeCost] = {}
        self._rng = random.Random(seed)
        self.pruned_nodes = 0
        self.kept_nodes = 0
        self.last_threshold: dict[int, float] = {}  # batch size → the threshold of its last pruned step

    def threshold(self, batch: int, tokens_per_s: float | None) -> float:
        """Minimum acceptance probability for a node to raise tokens/s (0: keep everything)."""
        cost = self.costs.get(batch)
        slope = cost.slope if cost else None
        if not self.enabled or slope is None or not tokens_per_s:
            return 0.0
        return tokens_per_s * slope

    def plan(self, batch: int, tokens_per_s: float | None, max_nodes: int) -> "Cut":
        """This step's cut. An exploring step keeps a random number (0..max_nodes) of the best
        drafted nodes instead: the calibration sees nodes below the threshold and the cost fit
        sees every tree size (and it drafts below the score floor: ``score_floor``). Until the
        cost fit for this batch size has data, steps keep 1..max_nodes nodes (a one-node
        chain is never cut). A step cut at random says nothing of what the steady cut yields
        and costs: the draft policy keeps it from the draft budget (``DraftPolicy.observe``)."""
        if not self.enabled:
            return Cut()
        if max_nodes <= 1:  # one node: nothing to prune, and no tree sizes for a fit to tell apart
            return Cut()
        threshold = self.threshold(batch, tokens_per_s)
        cost = self.costs.get(batch)
        if cost is None or cost.slope is None:  # no cost fit yet: trees of every non-empty size
            return Cut(keep=self._rng.randint(1, max_nodes))
        if self._rng.random() < self.explore:
            return Cut(threshold=threshold, keep=self._rng.randint(0, max_nodes))
        self.last_threshold[batch] = threshold
        return Cut(threshold=threshold)

    def score_floor(self, cut: "Cut") -> float:
        if cut.at_random:  # exploring: draft the whole depth, so nodes below the floor get verified
            return -math.inf
        return self.calibration.score_floor(cut.threshold) if cut.threshold > 0 else -math.inf

    def prune(self, cands: DraftCandidates, cut: "Cut") -> DraftCandidates:
        """Candidates in score order up to the first one whose acceptance probability is below
        the cut's threshold (closed under ancestors: a child never outscores its parent), or the
        cut's ``keep`` best ones."""
        if len(cands) == 0 or (cut.threshold <= 0 and cut.keep is None):
            return cands
        keep = cut.keep
        if keep is None:
            keep = 0
            for s in sorted(cands.scores.tolist(), reverse=True):
                if self.calibration.prob(s) < cut.threshold:
                    break
                keep += 1
        keep = min(keep, len(cands))
        self.kept_nodes += keep
        self.pruned_nodes += len(cands) - keep
        return cands.best(keep) if keep else DraftCandidates.empty()

    def observe(self, batch: int, cands: list[DraftCandidates], accepted: list[list[int]], seconds: float | None) -> None:
        """One drafted step: the verified candidates per request, the draft tokens the target
        accepted (root's child first), and the step's wall time (None: not representative)."""
        nodes = tokens = 0
        for c, acc in zip(cands, accepted):
            nodes += len(c)
            tokens += len(acc) + 1  # the accepted draft tokens and the target's own
            if not len(c):
                continue
            on_path = set(accepted_path(c, acc))
            for i, s in enumerate(c.scores.tolist()):
                self.calibration.observe(s, i in on_path)
        if seconds is not None:
            self.costs.setdefault(batch, NodeCost()).observe(nodes, seconds, tokens)

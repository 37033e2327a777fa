"""The draft policy: one object that decides, per decode step, how much to draft and verify,
cuts the candidates to that, and learns from what the step cost and yielded.

It joins the two learners that sit on the measured cost of verification:

* ``DraftBudget`` (``budget.py``): whether drafting pays at all this step and how much, from
  measured tokens/s per size: with confidence pruning one draft token (a depth-1 draft) or the
  pruned tree, without it the tree size;
* ``ConfidencePruning`` (``confidence.py``): which drafted nodes are worth verifying, from the
  draft's calibrated confidence and the measured seconds per node.

Per step: ``plan(batch)`` → a :class:`StepPlan` (size, useful depth, score floor) the drafter
receives; with a draft assist, ``assist_suffices(proposal, batch)`` → whether the assist's
proposal alone is expected to yield what a drafted step yields (then the drafter is not run for
that request): with one request in flight, tokens per second against the drafter's measured
steps (an assist-only step saves the draft's seconds: a self-draft's 5 forwards are half its
step, so an n-gram match of ~2 expected tokens beats its ~5), else expected tokens against the
drafted steps' mean; ``select(candidates, plan)`` → the candidates the tree is built from (the best
``size - 1`` by score, closed under ancestors, then confidence-pruned: the one cut);
``observe(...)`` → both learners see the step's time and what every smaller size would have
yielded (the budget only from steps cut by confidence, not at random: an exploring step, or one
before the node-cost fit, yields and costs what its random cut let through, and the budget
weighs drafting as the steady cut does it against plain steps). Greedy output never depends on
any of this: any tree verifies to the same tokens.

Timing rule: a drafted step right after plain steps also pays for the drafter catching up on
the tokens those steps produced (a switching cost, not what a drafted step costs), so it is not
timed (its yields still count), and the next step replays its size to be timed; otherwise a
budget that left drafting would never see its cost again. Once that size's cost at this batch
size rests on ``RETIME_KNOWN`` timed steps, the replay happens on a ``RETIME_SHARE`` of such
steps only: a step's cost is steady (hardware, context length) while its yield is what
exploring is for, and where plain steps win (8 requests in flight on a 2-core CPU, a drafted
step 2.7x a plain one) every replay was a second slow step per exploration.

Exploring budget: a step that plays another size than the best measured (exploring, or a timed
replay) costs what it took beyond the time the best size needs for the tokens it yielded. Those
excess seconds are kept as a share of all decode seconds (both decayed per step, ~500 steps of
memory), and no step explores or replays while the share is above ``EXPLORE_BUDGET``: the
budget's rates say how often to explore where exploring is cheap; this caps what it may cost
where it is not. With gguf weights and int8 activations on the 2-core Xeon (verify rows
compute-bound: a drafted eagle3 step 2.7x a plain one, the drafter's catch-up after plain steps
more), exploring alone cost eagle3 6-7% of plain decoding's speed.
"""

from __future__ import annotations

import random

from .budget import DraftBudget, counterfactual_yields
from .confidence import ConfidencePruning, Cut
from .config import TreeShape
from .types import DraftCandidates, StepPlan


RETIME_KNOWN = 4  # timed steps of a (batch size, tree size) after which a switching step is replayed only sometimes
RETIME_SHARE = 0.25  # the share of switching steps replayed then, to keep the cost fresh
EXPLORE_BUDGET = 0.02  # the share of decode time exploring may cost beyond the best size's time for the same tokens
EXPLORE_MEMORY = 0.998  # per-step decay of that account


class DraftPolicy:
    def __init__(
        self,
        shape: TreeShape,
        adaptive: bool = True,
        confidence_pruning: bool = True,
        retime_share: float = RETIME_SHARE,
        seed: int = 0,
        explore_budget: float = EXPLORE_BUDGET,
        fixed_batches: frozenset[int] = frozenset(),
    ):
        self.shape = shape
        # batch sizes whose verify of the full tree measured near-flat at startup (adaptive_draft=auto
        # with the policy on for the engine's concurrency): every such step drafts and verifies the
        # configured tree, as with the policy off, and the learners skip it
        self.fixed_batches = frozenset(fixed_batches) if adaptive else frozenset()
        self.pruning = ConfidencePruning(enabled=adaptive and confidence_pruning)
        # with pruning, the tree size is decided per step from the draft's confidence; the budget
        # only decides how much drafting pays (a pruned step's cost varies with the text like its
        # yield does: average both alike): none, one draft token (size 2: a depth-1 draft, the
        # cheapest there is, uncut) or the whole pruned tree. The one-token step is what pays
        # where extra verify rows are dear: 8 requests in flight on a 2-core CPU (bf16, AMX Xeon)
        # decoded MT-bench at 1.07x plain's speed with it and 0.91x without, where the policy
        # mostly played plain (docs/benchmarks.md, session 67)
        sizes = sorted({1, min(2, shape.num_draft_tokens), shape.num_draft_tokens})
        self.budget = DraftBudget(shape.num_draft_tokens, adaptive=adaptive, **(dict(sizes=sizes, cost_decay=0.95) if self.pruning.enabled else {}))
        self._retime = 0  # size the next step must play (to time it), 0 = the budget's choice
        self.retime_share = retime_share
        self._rng = random.Random(seed)
        self._plain_before = False  # the last decode step did not draft
        self.accepted_mean = None  # accepted draft tokens per drafted request-step (moving average)
        self._draft_seconds = None  # the drafter's hook time this step (drafter_ran), until observe()
        self.drafter_steps = None  # (tokens, step seconds, draft seconds) of one-request steps the drafter ran, moving averages
        self.explore_budget = explore_budget
        self._spent = 0.0  # decode seconds, decayed
        self._excess = 0.0  # seconds exploring steps took beyond the best size's time for their tokens, decayed
        self._best_rate = None  # this step explores: the best size's tokens/s to charge it against

    @property
    def adaptive(self) -> bool:
        return self.budget.adaptive

    def may_explore(self) -> bool:
        """Whether exploring has cost no more than its budget's share of decode time lately."""
        return self._excess <= self.explore_budget * self._spent

    def plan(self, batch: int) -> StepPlan:
        if batch in self.fixed_batches:
            self._best_rate = None
            return StepPlan(size=self.shape.num_draft_tokens, depth=self._depth(self.shape.num_draft_tokens))
        explore = self.may_explore()
        size = (self._retime if explore else 0) or self.budget.choose(batch, explore=explore)
        self._retime = 0
        rates = self.budget.rates(batch) if self.budget.adaptive else {}
        best = self.budget.best(batch, rates) if rates else None
        self._best_rate = rates[best] if best is not None and size != best else None
        if size <= 1:
            return StepPlan(size=1, depth=0)
        cut = self.pruning.plan(batch, rates.get(size), size - 1)
        return StepPlan(size=size, depth=self._depth(size), score_floor=self.pruning.score_floor(cut), cut=cut)

    def _depth(self, size: int) -> int:
        """Draft depth that can still fill a tree of ``size`` nodes (root included)."""
        return max(1, min(self.shape.num_steps, size - 1))

    def _replay(self, batch: int, size: int) -> bool:
        """Whether the step after an untimed switching step replays ``size`` to time it."""
        return not self.budget.times_known(batch, size, RETIME_KNOWN) or self._rng.random() < self.retime_share

    def assist_suffices(self, proposal: DraftCandidates, batch: int = 1) -> bool:
        """Whether a draft assist's proposal alone is expected to pay at least what a drafted step
        does, so the drafter's forwards would be spent on the rare step where the assist is wrong.
        Its expected accepted tokens: the sum over its nodes of ``exp(score)``, scores being
        calibrated path log-probabilities. With one request in flight, once drafter steps have
        been timed: its tokens (+ the target's own) in a step without the draft's seconds, against
        the drafter steps' tokens per second. Else (a batch's draft forward is shared: skipping it
        for one request saves little) its expected tokens against the drafted steps' mean. False
        until a few steps have been seen. The rate trusts short matches in prose too: with a
        self-draft it gains on code (HumanEval 1.44x -> 1.81x) and costs on chat (MT-bench 0.90x
        of the self-draft alone; docs/benchmarks.md, session 46)."""
        if not len(proposal) or self.accepted_mean is None:
            return False
        expected = float(proposal.scores.clamp(max=0.0).exp().sum())
        if batch == 1 and self.drafter_steps is not None:
            tokens, step, draft = self.drafter_steps
            return (expected + 1.0) * step >= tokens * max(step - draft, 1e-3 * step)
        return expected >= self.accepted_mean

    def drafter_ran(self, seconds: float) -> None:
        """The drafter's hook took ``seconds`` this step (the worker times it; observe() folds it
        into ``drafter_steps`` for one-request steps)."""
        self._draft_seconds = seconds

    def select(self, cands: DraftCandidates, plan: StepPlan) -> DraftCandidates:
        """The candidates this step verifies: the best ``plan.size - 1`` (closed under
        ancestors), cut by confidence."""
        if not plan.drafts:
            return DraftCandidates.empty()
        return self.pruning.prune(cands.best(plan.size - 1), plan.cut or Cut())

    def observe(self, batch: int, plan: StepPlan, drafted: bool, verified: list[DraftCandidates], accepted: list[list[int]], seconds: float) -> None:
        """One decode step played ``plan`` in ``seconds``; ``drafted``: the drafter proposed
        anything; ``verified``: the candidates each request's tree held; ``accepted``: the draft
        tokens the target accepted per request (root's child first)."""
        if self.budget.adaptive and batch not in self.fixed_batches:
            self._account(seconds, sum(len(a) + 1 for a in accepted) if accepted else batch)
        if drafted and accepted:
            mean = sum(len(a) for a in accepted) / len(accepted)
            self.accepted_mean = mean if self.accepted_mean is None else 0.9 * self.accepted_mean + 0.1 * mean
        if self._draft_seconds is not None and batch == 1 and len(accepted) == 1:
            now = (len(accepted[0]) + 1.0, seconds, self._draft_seconds)
            last = self.drafter_steps
            self.drafter_steps = now if last is None else tuple(0.9 * a + 0.1 * b for a, b in zip(last, now))
        self._draft_seconds = None
        if batch in self.fixed_batches:  # the configured tree every step: nothing to learn, no switch to time
            self._plain_before = False
            return
        if self.budget.adaptive and drafted:
            timed = None if self._plain_before else seconds
            self._retime = plan.size if self._plain_before and self._replay(batch, plan.size) else 0
            if plan.cut is None or not plan.cut.at_random:  # a random cut's yield and cost are not the steady cut's
                self.budget.observe(batch, plan.size, timed, counterfactual_yields(self.budget.sizes, plan.size, verified, accepted))
            # the node-cost fit learns from whole-tree steps only: a one-token step's draft is a
            # depth-1 one, cheaper than the tree's, and beside them the fit charged that saving to
            # the tree's extra nodes (its calibration learns from every step's nodes)
            whole = plan.size == self.shape.num_draft_tokens
            self.pruning.observe(batch, verified, accepted, timed if whole else None)
        elif self.budget.adaptive and plan.size == 1:
            self.budget.observe(batch, 1, seconds, None)
        self._plain_before = plan.size == 1

    def _account(self, seconds: float, tokens: int) -> None:
        """The exploring budget's account after a step of ``seconds`` that yielded ``tokens``."""
        excess = seconds - tokens / self._best_rate if self._best_rate else 0.0
        self._spent = self._spent * EXPLORE_MEMORY + seconds
        self._excess = self._excess * EXPLORE_MEMORY + excess

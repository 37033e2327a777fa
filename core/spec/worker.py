"""The speculative worker: prefill like plain decoding, then per decode step

    candidates = draft(reqs)                  # algorithm runtime
    trees      = build_tree(req, candidates)  # default in spec/tree.py unless overridden
    logits     = target forward over every tree node (ancestor masks), KV written per node
    results    = verify(req, tree, logits)    # default in spec/verify.py unless overridden
    commit KV (accepted path moved to the front of the tree's slots, rest freed); on_accept(...) → drafter catches up
"""
from __future__ import annotations

import logging
import os
import time

import pluggy
import torch

from .. import hookspecs
from ..model_runner import build_forward_batch
from ..request import Request
from ..sampling import TokenLogprob
from ..worker import SeqResult, prefill_chunks, sample_rows
from . import defaults
from .budget import DraftBudget, counterfactual_yields
from .config import resolve_tree_shape
from .confidence import ConfidencePruning, Cut
from .types import DraftCandidates, SpecContext, VerifyResult

logger = logging.getLogger(__name__)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


class SpeculativeWorker:
    speculative = True

    def __init__(self, engine, algorithm, registry):
        from ..config import speculative_config
        cfg = speculative_config(engine.cfg)
        shape = getattr(engine, "tree_shape", None) or resolve_tree_shape(cfg, engine.loaded.hf_config)
        self.runner = engine.runner
        self.ctx = SpecContext(config=cfg, shape=shape, runner=engine.runner, tokenizer=engine.tokenizer,
                               engine_config=engine.cfg, stats=engine.stats, target_path=engine.loaded.path,
                               force_greedy=cfg.force_greedy_verify or _env_flag("SPECFW_FORCE_GREEDY_VERIFY"))
        # per-engine hook relay: core defaults + the active algorithm's runtime + observers
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(defaults, name="specfw.defaults")
        for plugin in registry.distribution_plugins():
            if registry.pm.get_name(plugin) and hasattr(plugin, "specfw_observe_step"):
                self.pm.register(plugin, name=f"observer:{registry.pm.get_name(plugin)}")
        self.runtime = algorithm.factory(self.ctx)
        self.pm.register(self.runtime, name=f"algorithm:{algorithm.name}")
        self.pm.check_pending()
        self.hook = self.pm.hook
        self.algorithm = algorithm.name
        self.slots_per_decode = shape.num_draft_tokens
        self._plain_before = False   # the last decode step skipped drafting
        self._retime = 0             # size the next step must play (to time it), 0 = the budget's choice
        self.pruning = ConfidencePruning(enabled=cfg.adaptive_draft and getattr(cfg, "confidence_pruning", True))
        # with pruning, the tree size is decided per step from the draft's confidence; the budget
        # only decides whether drafting pays at all
        # (a pruned step's cost varies with the text like its yield does: average both alike)
        self.budget = DraftBudget(shape.num_draft_tokens, adaptive=cfg.adaptive_draft,
                                  **(dict(sizes=[1, shape.num_draft_tokens], cost_decay=0.95) if self.pruning.enabled else {}))
        logger.info("speculative decoding: %s num_steps=%d topk=%d num_draft_tokens=%d", algorithm.name,
                    shape.num_steps, shape.topk, shape.num_draft_tokens)

    # ---- prefill ------------------------------------------------------------------------
    def prefill(self, reqs: list[Request]) -> list[SeqResult]:
        chunks = prefill_chunks(self.runner, reqs)
        spans, start = [], 0
        for c in chunks:
            spans.append((start, int(c[0].numel())))
            start += int(c[0].numel())
        fb = build_forward_batch(chunks, last_only=True, capture_layers=self.ctx.capture_layers)
        out = self.runner.forward(fb)
        sampled = sample_rows(out.logits, reqs)
        self.hook.specfw_on_prefill(ctx=self.ctx, reqs=reqs, hidden=out.hidden, aux_hidden=out.aux_hidden, spans=spans)
        return [SeqResult([t], [lp] if lp else []) for t, lp in sampled]

    # ---- decode -------------------------------------------------------------------------
    def decode(self, reqs: list[Request]) -> list[SeqResult]:
        t0 = time.perf_counter()
        batch = len(reqs)
        # a drafted step right after plain steps is not timed (see below): the next one is, so it
        # drafts too, or a budget that left drafting would never see its cost again
        size = self._retime or self.budget.choose(batch)
        self._retime = 0
        cut = self.pruning.plan(batch, self.budget.rates(batch).get(size), size - 1) if size > 1 else Cut()
        drafted, candidates, results = self._decode(reqs, size, cut)
        seconds = time.perf_counter() - t0
        if self.budget.adaptive and drafted:
            # the first drafted step after plain steps also catches the drafter up on the tokens
            # those steps produced: a switching cost, not what a drafted step costs
            timed = None if self._plain_before else seconds
            self._retime = size if self._plain_before else 0
            accepted = [r.tokens[:r.num_accepted] for r in results]
            self.budget.observe(batch, size, timed, counterfactual_yields(self.budget.sizes, size, candidates, accepted))
            self.pruning.observe(batch, candidates, accepted, timed)
        elif self.budget.adaptive and size == 1:
            self.budget.observe(batch, size, seconds, None)
        self._plain_before = size == 1
        return [SeqResult(res.tokens, res.logprobs, res.num_draft, res.num_accepted) for res in results]

    def _draft(self, reqs: list[Request], size: int, cut: Cut) -> tuple[bool, list[DraftCandidates]]:
        """The candidates to verify (cut to ``size - 1`` nodes, then by confidence),
        and whether the drafter proposed anything before pruning."""
        if size == 1:    # the budget says drafting does not pay right now: a plain step
            return False, [DraftCandidates.empty() for _ in reqs]
        self.ctx.draft_budget = size
        self.ctx.draft_score_floor = self.pruning.score_floor(cut)
        candidates = self.hook.specfw_draft(ctx=self.ctx, reqs=reqs)
        if candidates is None or len(candidates) != len(reqs):
            raise RuntimeError(f"algorithm '{self.algorithm}': specfw_draft must return one DraftCandidates per request")
        drafted = any(len(c) for c in candidates)
        return drafted, [self.pruning.prune(c.best(size - 1), cut) for c in candidates]

    def _decode(self, reqs: list[Request], size: int,
                cut: Cut = Cut()) -> tuple[bool, list[DraftCandidates], list[VerifyResult]]:
        drafted, candidates = self._draft(reqs, size, cut)
        trees = [self.hook.specfw_build_tree(ctx=self.ctx, req=r, candidates=c) for r, c in zip(reqs, candidates)]
        chunks, slot_sets = [], []
        for r, t in zip(reqs, trees):
            slots = self.runner.allocator.alloc(len(t))
            slot_sets.append(slots)
            chunks.append((t.tokens, r.seq_len - 1 + t.depth, slots, r.slots.slots(), t.mask if len(t) > 1 else None))
        out = self.runner.forward(build_forward_batch(chunks, capture_layers=self.ctx.capture_layers))
        results, offset = [], 0
        for r, t, slots in zip(reqs, trees, slot_sets):
            n = len(t)
            logits = out.logits[offset:offset + n]
            res: VerifyResult = self.hook.specfw_verify(ctx=self.ctx, req=r, tree=t, logits=logits)
            keep = torch.tensor(res.accepted_nodes, dtype=torch.long)
            self._commit_kv(r, slots, keep)
            res.node_rows = offset + keep
            if r.params.logprobs:
                res.logprobs = self._logprobs(r, logits[keep], res.tokens)
            results.append(res)
            offset += n
        self.hook.specfw_on_accept(ctx=self.ctx, reqs=reqs, results=results, hidden=out.hidden, aux_hidden=out.aux_hidden)
        self.hook.specfw_observe_step(ctx=self.ctx, reqs=reqs, results=results)
        self.ctx.stats.record_positions([(res.num_accepted, int(t.depth.max())) for res, t in zip(results, trees)
                                         if res.num_draft])
        return drafted, candidates, results

    def _commit_kv(self, req: Request, slots: torch.Tensor, keep: torch.Tensor) -> None:
        """Keep the accepted path's KV and free the rest. The path's entries move to the first
        ``len(keep)`` slots of the tree's allocation (path nodes come in tree order, so each moves
        to an earlier or the same slot): a request's KV stays one ascending run where it was one,
        and attention reads it as a view instead of gathering it."""
        k = int(keep.numel())
        if not torch.equal(keep, torch.arange(k)):
            self.runner.kv.move(slots[keep], slots[:k])
        req.slots.append(slots[:k])
        self.runner.allocator.free(slots[k:])

    @staticmethod
    def _logprobs(req: Request, rows: torch.Tensor, tokens: list[int]) -> list[TokenLogprob]:
        logp = torch.log_softmax(rows.float(), -1)
        out = []
        for i, tok in enumerate(tokens):
            top = []
            if req.params.top_logprobs:
                v, ix = torch.topk(logp[i], req.params.top_logprobs)
                top = list(zip(ix.tolist(), v.tolist()))
            out.append(TokenLogprob(tok, float(logp[i, tok]), top))
        return out

    def release(self, req: Request) -> None:
        self.hook.specfw_release(ctx=self.ctx, req=req)

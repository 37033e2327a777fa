"""The speculative worker: prefill like plain decoding, then per decode step

    plan       = policy.plan(batch)                 # how much to draft and verify (speculative/policy.py)
    candidates = draft(reqs, plan)                  # algorithm runtime
               + assist_draft(reqs, plan), merged   # speculative.draft_assist, if set (speculative/merge.py);
                                                    # requests whose assist proposal suffices skip draft()
    trees      = build_tree(req, policy.select(candidates, plan), plan)   # default in speculative/tree.py
    logits     = target forward over every tree node (ancestor masks), KV into the step's reserved slots
    results    = verify(req, tree, logits)          # default in speculative/verify.py unless overridden
    on_accept(...)                                  # the drafter catches up on the accepted nodes

and returns the results (``VerifyResult``: a ``StepResult`` keeping the accepted path's KV); the
scheduler applies them. A step the policy plays plain (no draft) for a batch of greedy requests
skips the tree and verify hooks: one row per request, its argmax (what any lossless verify of a
root-only tree returns), then ``on_accept`` as after any step, so such a step costs what a plain
engine's step costs plus the drafter's bookkeeping.
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
from ..scheduler import ScheduledBatch
from ..step import StepResult
from ..worker import argmax_only, prefill_chunks, prefill_results, sample_rows
from . import defaults
from .config import resolve_tree_shape
from .merge import merge_candidates
from .policy import DraftPolicy
from .types import DraftCandidates, SpecContext, StepPlan, VerifyResult
from .verify_cost import PROBE_BATCH, flat_batches, resolve_adaptive

logger = logging.getLogger(__name__)


def _plain_greedy(req: Request) -> bool:
    """A request whose next token, without a draft, is the target's argmax (no penalties, no
    logprobs to report)."""
    return argmax_only([req])


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "on")


class SpeculativeWorker:
    speculative = True

    def __init__(self, runner, algorithm, registry, *, engine_config, tokenizer, stats, target_path, hf_config, shape=None):
        from ..config import speculative_config

        cfg = speculative_config(engine_config)
        shape = shape or resolve_tree_shape(cfg, hf_config)
        self.runner = runner
        self.ctx = SpecContext(
            config=cfg,
            shape=shape,
            runner=runner,
            tokenizer=tokenizer,
            engine_config=engine_config,
            stats=stats,
            target_path=target_path,
            force_greedy=cfg.force_greedy_verify
            or _env_flag("SPECFW_FORCE_GREEDY_VERIFY")
            or (algorithm.name == "ngram" and _env_flag("SGLANG_NGRAM_FORCE_GREEDY_VERIFY")),
        )
        # per-engine hook relay: core defaults + the active algorithm's runtime + observers
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(defaults, name="specfw.defaults")
        for plugin in registry.distribution_plugins():
            if registry.pm.get_name(plugin) and hasattr(plugin, "specfw_observe_step"):
                self.pm.register(plugin, name=f"observer:{registry.pm.get_name(plugin)}")
        self.runtime = algorithm.factory(self.ctx)
        self.pm.register(self.runtime, name=f"algorithm:{algorithm.name}")
        self.assist = None
        if getattr(cfg, "draft_assist", None) is not None:  # validated: a registered draft assist
            spec = registry.assists[str(cfg.draft_assist)]
            self.assist = spec.factory(self.ctx)
            taken = [h for h in ("specfw_draft", "specfw_build_tree", "specfw_verify") if hasattr(self.assist, h)]
            if taken:
                raise RuntimeError(f"draft assist '{spec.name}' implements {', '.join(taken)}: an assist adds candidates through specfw_assist_draft only")
            self.pm.register(self.assist, name=f"assist:{spec.name}")
        self.pm.check_pending()
        self.hook = self.pm.hook
        # the core's verification alone (no plugin's specfw_verify): greedy requests' tree rows are read for argmaxes only
        self.default_verify = all(impl.plugin_name == "specfw.defaults" for impl in self.hook.specfw_verify.get_hookimpls())
        # a greedy batch's argmaxes are read for specfw_verify where the core verifies alone or a
        # plugin's implementation takes them (one that does not gets the core's walk reading its own)
        self.verify_takes_argmax = self.default_verify or any(
            "argmax" in impl.argnames for impl in self.hook.specfw_verify.get_hookimpls() if impl.plugin_name != "specfw.defaults"
        )
        self.algorithm = algorithm.name
        self.slots_per_decode = shape.num_draft_tokens
        probe_batch = min(int(engine_config.engine.max_running_requests), PROBE_BATCH)  # validated >= 1 at startup
        grows_above = cfg.grows_above()  # the algorithm's own threshold (every config is a SpecAlgoConfig: plugins.py checks)
        adaptive = resolve_adaptive(cfg.adaptive_draft, runner, shape.num_draft_tokens, batch=probe_batch, grows_above=grows_above)
        fixed = flat_batches(cfg.adaptive_draft, runner, shape.num_draft_tokens, probe_batch, grows_above) if adaptive else frozenset()
        self.policy = DraftPolicy(shape, adaptive=adaptive, confidence_pruning=getattr(cfg, "confidence_pruning", True), fixed_batches=fixed)
        logger.info(
            "speculative decoding: %s num_steps=%d topk=%d num_draft_tokens=%d%s",
            algorithm.name,
            shape.num_steps,
            shape.topk,
            shape.num_draft_tokens,
            f" draft_assist={cfg.draft_assist}" if self.assist is not None else "",
        )

    @property
    def budget(self):
        return self.policy.budget

    @property
    def pruning(self):
        return self.policy.pruning

    def run(self, batch: ScheduledBatch) -> list[StepResult]:
        return self.prefill(batch) if batch.is_prefill else self.decode(batch)

    def prefix_to_reuse(self, req: Request, cached: int) -> int:
        """How many of the prefix cache's ``cached`` tokens of ``req`` the target reuses (the scheduler asks)."""
        use = self.hook.specfw_prefix_to_reuse(ctx=self.ctx, req=req, cached=cached)
        return cached if use is None else max(0, min(cached, int(use)))

    # ---- prefill ------------------------------------------------------------------------
    def prefill(self, batch: ScheduledBatch) -> list[StepResult]:
        chunks = prefill_chunks(batch)
        spans, start = [], 0
        for c in chunks:
            spans.append((start, int(c[0].numel())))
            start += int(c[0].numel())
        fb = build_forward_batch(chunks, last_only=True, capture_layers=self.ctx.capture_layers, greedy_only=argmax_only(batch.reqs))
        out = self.runner.forward(fb)
        sampled = sample_rows(out, batch.reqs)
        self.hook.specfw_on_prefill(ctx=self.ctx, reqs=batch.reqs, hidden=out.hidden, aux_hidden=out.aux_hidden, spans=spans)
        return prefill_results(sampled, batch)

    # ---- decode -------------------------------------------------------------------------
    def decode(self, batch: ScheduledBatch) -> list[StepResult]:
        t0 = time.perf_counter()
        reqs = batch.reqs
        plan = self.policy.plan(len(reqs))
        if not plan.drafts and all(_plain_greedy(r) for r in reqs):
            drafted, candidates, results = False, [DraftCandidates.empty() for _ in reqs], self._plain_step(batch)
        else:
            drafted, candidates = self._draft(reqs, plan)
            results = self._verify(batch, plan, candidates)
        accepted = [r.tokens[: r.num_accepted] for r in results]
        self.policy.observe(len(reqs), plan, drafted, candidates, accepted, time.perf_counter() - t0)
        return results

    def _draft(self, reqs: list[Request], plan: StepPlan) -> tuple[bool, list[DraftCandidates]]:
        """The candidates to verify (the policy's one cut of what the drafter and the draft assist
        proposed), and whether anything was proposed."""
        if not plan.drafts:  # the policy says drafting does not pay right now: a plain step
            return False, [DraftCandidates.empty() for _ in reqs]
        extra = self._assist_draft(reqs, plan)  # None without speculative.draft_assist
        drafting = reqs if extra is None else [r for r, e in zip(reqs, extra) if not self.policy.assist_suffices(e, len(reqs))]
        t0 = time.perf_counter()
        candidates = self.hook.specfw_draft(ctx=self.ctx, reqs=drafting, plan=plan) if drafting else []
        if drafting and extra is not None:  # what the assist's skip rule weighs
            self.policy.drafter_ran(time.perf_counter() - t0)
        if candidates is None or len(candidates) != len(drafting):
            raise RuntimeError(f"algorithm '{self.algorithm}': specfw_draft must return one DraftCandidates per request")
        if extra is not None:
            by_rid = {r.rid: c for r, c in zip(drafting, candidates)}
            candidates = [merge_candidates(by_rid.get(r.rid, DraftCandidates.empty()), e) for r, e in zip(reqs, extra)]
        drafted = any(len(c) for c in candidates)
        return drafted, [self.policy.select(c, plan) for c in candidates]

    def _assist_draft(self, reqs: list[Request], plan: StepPlan) -> list[DraftCandidates] | None:
        """The draft assist's proposal per request, or None when no assist is configured."""
        if self.assist is None:
            return None
        extra = self.hook.specfw_assist_draft(ctx=self.ctx, reqs=reqs, plan=plan)
        if extra is None or len(extra) != len(reqs):
            raise RuntimeError(f"draft assist '{self.ctx.config.draft_assist}': specfw_assist_draft must return one DraftCandidates per request")
        return extra

    def _plain_step(self, batch: ScheduledBatch) -> list[VerifyResult]:
        """A decode step without drafts for greedy requests: the plain worker's forward (one row
        per request, the drafter's feature taps on), its argmax, the drafter told what was kept."""
        reqs = batch.reqs
        chunks = [
            (torch.tensor(r.seq_ids[-1:], dtype=torch.long), torch.tensor([r.seq_len - 1]), slots[:1], r.slots.slots(), None)
            for r, slots in zip(reqs, batch.new_slots)
        ]
        out = self.runner.forward(build_forward_batch(chunks, capture_layers=self.ctx.capture_layers, greedy_only=True))  # all _plain_greedy
        rows = torch.arange(len(reqs))  # views of one tensor, not a tensor per request
        results = [VerifyResult([0], [t], 0, node_rows=rows[i : i + 1]) for i, t in enumerate(out.argmax_tokens())]
        self.hook.specfw_on_accept(ctx=self.ctx, reqs=reqs, results=results, hidden=out.hidden, aux_hidden=out.aux_hidden)
        self.hook.specfw_observe_step(ctx=self.ctx, reqs=reqs, results=results)
        return results

    def _verify(self, batch: ScheduledBatch, plan: StepPlan, candidates: list[DraftCandidates]) -> list[VerifyResult]:
        reqs = batch.reqs
        trees = [self.hook.specfw_build_tree(ctx=self.ctx, req=r, candidates=c, plan=plan) for r, c in zip(reqs, candidates)]
        chunks = []
        for r, t, slots in zip(reqs, trees, batch.new_slots):
            if len(t) > slots.numel():
                raise RuntimeError(f"algorithm '{self.algorithm}': a tree of {len(t)} nodes exceeds num_draft_tokens={slots.numel()}")
            chunks.append((t.tokens, r.seq_len - 1 + t.depth, slots[: len(t)], r.slots.slots(), t.mask if len(t) > 1 else None))
        # the core's greedy walk reads argmaxes only
        greedy = argmax_only(reqs)
        out = self.runner.forward(build_forward_batch(chunks, capture_layers=self.ctx.capture_layers, greedy_only=self.default_verify and greedy))
        best = out.argmax_tokens() if greedy and self.verify_takes_argmax else None  # every node's argmax in one read (one sync on a GPU)
        results, offset = [], 0
        for r, t in zip(reqs, trees):
            n = len(t)
            logits = out.logits[offset : offset + n]
            argmax = best[offset : offset + n] if best is not None else None
            res: VerifyResult = self.hook.specfw_verify(ctx=self.ctx, req=r, tree=t, logits=logits, argmax=argmax)
            res.node_rows = torch.tensor([offset + i for i in res.accepted_nodes], dtype=torch.long)  # one op: cold after the forward
            if r.params.logprobs:
                res.logprobs = self._logprobs(r, logits[torch.tensor(res.accepted_nodes, dtype=torch.long)], res.tokens)
            results.append(res)
            offset += n
        self.hook.specfw_on_accept(ctx=self.ctx, reqs=reqs, results=results, hidden=out.hidden, aux_hidden=out.aux_hidden)
        self.hook.specfw_observe_step(ctx=self.ctx, reqs=reqs, results=results)
        self.ctx.stats.record_positions([(res.num_accepted, int(t.depth.max())) for res, t in zip(results, trees) if res.num_draft])
        return results

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

    def flush_cache(self) -> None:
        self.hook.specfw_flush_cache(ctx=self.ctx)

    def capture_graphs(self) -> int:
        """The target's graphs for every row bucket (its forwards here tap ``ctx.capture_layers``),
        then the runtime's (``specfw_capture_graphs``). Returns how many were made."""
        made = self.runner.graphs.capture_all(self.ctx.capture_layers)
        return made + sum(n or 0 for n in self.hook.specfw_capture_graphs(ctx=self.ctx))

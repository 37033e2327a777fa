"""Drafting from (token, target feature) pairs: the EAGLE family (eagle, eagle3).

Pair i is (token t_{i+1}, feature f_i of the target at position i) at rope position i; the
head's output at pair i predicts t_{i+2}. The drafter keeps per request the features the
target produced but the head has not consumed yet:

* ``on_prefill`` stores the prompt's features and runs the extend pass over the prompt's pairs
  right away (part of the prefill, as SGLang's draft extend after prefill); ``on_accept`` stores the
  accepted nodes' features;
* ``draft`` runs one extend pass over each request's pending pairs (catching up to the root,
  the last sampled token), then the shared EAGLE-2 beam search, feeding each beam node the
  head's own output hidden of its parent.

Subclasses provide the head (``head_forward``), what is kept per target position
(``target_features``: one call per step over the batch's accepted rows; ``target_features_all``
where a step kept every row, optionally cheaper), how the head's input is
formed from it (``project_features``, default identity; applied once per extend pass over every
request's pending rows, so a step without a draft reads no head weights: EAGLE-3's fc runs
when drafting resumes, over all pairs at once) and the vocabulary mapping (``to_target``, a
host tensor). Features and the head's KV live on the target runner's device; ``head_forward``
gets its batch there.
"""

from __future__ import annotations

import torch

from ..forward_batch import ForwardBatch
from ..hookspecs import hookimpl
from ..kv_cache import KVPool, SlotTable
from ..model_runner import build_forward_batch
from .beam import beam_search
from .pair_cache import PairCache
from .types import DraftCandidates


# target tokens of a cached prefix recomputed, at most, so that the head's cached pairs continue
RECOMPUTE_FOR_PAIRS = 32


class _PairState:
    def __init__(self, base: int = 0):
        # the target prefilled from position ``base`` (the prefix before it came from the prefix
        # cache, so its features were never computed): the head's pairs start there
        self.base = base
        self.slots = SlotTable()  # head KV of pairs base..next_pair-1
        self.pending: list[torch.Tensor] = []  # features of positions next_pair.. (not consumed yet)

    @property
    def next_pair(self) -> int:
        return self.base + len(self.slots)


class FeatureDrafter:
    to_target: torch.Tensor | None = None  # draft-vocab index → target id (None = same vocab)
    rotary = None  # the head's rope tables (specfw.sdk.Rotary), for a backend's one-call beam search
    cache_pairs = True  # keep the head's KV of finished requests (pair_cache.py) for later ones sharing their tokens

    def __init__(self, ctx, layer, num_slots: int):
        self.ctx = ctx
        self.shape = ctx.shape
        self.layer = layer
        self.device = ctx.runner.device
        self.kv = KVPool(1, layer.n_kv, layer.head_dim, num_slots, dtype=ctx.runner.kv.dtype, device=self.device)
        self.states: dict[str, _PairState] = {}
        self.pair_cache = PairCache(self.kv.allocator) if self.cache_pairs else None
        self._held: dict[str, object] = {}  # per request, the cached pairs it started from (locked)
        self.graphs = None  # specfw.graphs.GraphedHead: beam steps from static buffers / CUDA graphs
        self.chain = None  # device_chain.DeviceChain: topk=1 drafts, the whole loop in one replay
        target = getattr(ctx.runner, "graphs", None)
        if target is not None:  # the target's forwards are graphed: the draft loop's too
            self.enable_graphs(target.max_rows, target.capture)

    def enable_graphs(self, max_rows: int, capture: bool = True) -> bool:
        """Beam-step head forwards of up to ``max_rows`` rows from static buffers (CUDA graphs on
        CUDA), and with ``topk=1`` the whole chain loop as one (``DeviceChain``); needs the head
        to attend with the Triton kernel. Returns whether they are on."""
        from ..graphs import GraphedHead

        if getattr(getattr(self.layer, "backend", None), "attention", None) != "triton":
            return False
        hidden = self.layer.self_attn.o_proj.out_features
        self.graphs = GraphedHead(self.head_forward, self.kv, self.kv.allocator.num_slots, hidden, self.device, max_rows, capture)
        if self.shape.topk == 1:  # a chain: no beam bookkeeping, so the whole draft loop is one graph
            from .device_chain import DeviceChain

            requests = max(1, max_rows // self.shape.num_draft_tokens)
            self.chain = DeviceChain(self.head_forward, self.kv, self.kv.allocator.num_slots, self.to_target, self.device, requests, max_rows, capture)
        return True

    # ---- subclass API -----------------------------------------------------------------------
    def target_features(self, hidden: torch.Tensor, aux: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """What the drafter keeps of target positions ``rows`` (one row each), until an extend
        pass consumes it."""
        raise NotImplementedError

    def target_features_all(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """``target_features`` of every row of the forward, in order (a step that kept every row:
        a plain-played one). Override where that is cheaper than selecting rows."""
        return self.target_features(hidden, aux, torch.arange(hidden.shape[0], device=hidden.device))

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """The head's feature input from kept rows (``target_features``), at extend time."""
        return features

    def head_forward(self, tokens: torch.Tensor, features: torch.Tensor, fb: ForwardBatch, from_target: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over pairs → (draft logits [T, V_draft], output hidden [T, H])."""
        raise NotImplementedError

    def kernel_draft_step(self):
        """The backend's one-call draft step for this head (``Backend.eagle3_draft``: the extend
        pass and the beam search, the candidates of ``_extend`` + ``beam_search`` over
        ``head_forward``), or None (default): the Python step."""
        return None

    # ---- hooks ------------------------------------------------------------------------------
    @hookimpl
    def specfw_on_prefill(self, ctx, reqs, hidden, aux_hidden, spans):
        for r, (start, n) in zip(reqs, spans):
            # rows cover positions r.num_cached.. (a retracted request's state was released: it
            # starts anew, from whatever prefix the cache gave it)
            st = self.states.get(r.rid) or self._start(r)
            st.pending = [self.target_features(hidden, aux_hidden, torch.arange(start, start + n, device=hidden.device))]
        # catch up on the prompt now, as part of the prefill: the first decode step then extends
        # one pair, like every other step, and its cost says what drafting costs
        ready = [r for r in reqs if r.seq_len - 1 > self.states[r.rid].next_pair]
        if ready and self._room(sum(r.seq_len - 1 - self.states[r.rid].next_pair for r in ready)):
            self._extend(ready)

    @hookimpl
    def specfw_on_accept(self, ctx, reqs, results, hidden, aux_hidden):
        kept = [(self.states[r.rid], res.node_rows) for r, res in zip(reqs, results) if r.rid in self.states]
        if not kept:
            return
        if sum(len(rows) for _, rows in kept) == hidden.shape[0]:
            # every row kept (each request's rows are its own block, ascending): the rows in order
            feats = self.target_features_all(hidden, aux_hidden)
        else:
            feats = self.target_features(hidden, aux_hidden, torch.cat([rows for _, rows in kept]).to(hidden.device))
        for (st, _), f in zip(kept, feats.split([len(rows) for _, rows in kept])):
            st.pending.append(f)

    @hookimpl
    def specfw_release(self, ctx, req):
        st = self.states.pop(req.rid, None)
        if st is None:
            return
        held = self._held.pop(req.rid, None)
        if self.pair_cache is not None and st.base == 0:
            self.pair_cache.give(req.seq_ids, st.slots.truncate(0), held)
        else:
            self.kv.allocator.free(st.slots.truncate(0))

    @hookimpl
    def specfw_flush_cache(self, ctx):
        if self.pair_cache is not None:
            self.pair_cache.flush()

    @hookimpl
    def specfw_capture_graphs(self, ctx):
        made = self.graphs.capture_all(self.kv.dtype) if self.graphs is not None else 0
        if self.chain is not None:
            depth = max(1, min(self.shape.num_steps, self.shape.num_draft_tokens - 1))  # a plan's depth at full size
            made += self.chain.capture_all(depth, self.graphs.hidden, self.kv.dtype)
        return made

    @hookimpl
    def specfw_prefix_to_reuse(self, ctx, req, cached):
        """Reuse the target's cached prefix up to where this drafter's cached pairs end, so the
        target computes the features the pairs continue from: in a chat's next turn the last
        turn's final few tokens (its last step's pairs were never extended). Where the pairs end
        far earlier (evicted), the whole prefix is reused and the head starts without context."""
        if self.pair_cache is None:
            return None
        have = self.pair_cache.reach(req.seq_ids, cached)
        return have if cached - have <= RECOMPUTE_FOR_PAIRS else cached

    def _start(self, r) -> _PairState:
        """A request's state at its prefill: its pairs before ``r.num_cached`` (the target's cached
        prefix) from the pair cache where all are there, else its pairs start at ``r.num_cached``."""
        p0 = r.num_cached
        held = self.pair_cache.take(r.seq_ids, p0) if self.pair_cache is not None and p0 else None
        st = self.states[r.rid] = _PairState(0 if held is not None else p0)
        if held is not None:
            st.slots.append(held.slots)
            self._held[r.rid] = held
        return st

    def _room(self, n: int) -> bool:
        return self.pair_cache.room(n) if self.pair_cache is not None else self.kv.allocator.can_alloc(n)

    @hookimpl
    def specfw_draft(self, ctx, reqs, plan):
        ready = [r for r in reqs if r.rid in self.states]
        need = sum(r.seq_len for r in ready) + len(ready) * self.shape.topk * self.shape.num_steps
        if not ready or not self._room(need - sum(self.states[r.rid].next_pair for r in ready)):
            return [DraftCandidates.empty() for _ in reqs]
        drafted = dict(zip([r.rid for r in ready], self._draft(ready, plan)))
        return [drafted.get(r.rid, DraftCandidates.empty()) for r in reqs]

    # ---- drafting ---------------------------------------------------------------------------
    def _extend(self, reqs):
        """One head forward over each request's pending pairs (from its draft KV length up to the
        pair whose token is the last in ``seq_ids``); returns (logits, hidden) at each request's
        last pair."""
        logits, hidden, fb = self._extend_rows(reqs)
        return logits, hidden[fb.logits_indices]

    def _extend_rows(self, reqs):
        """``_extend``'s forward: (logits at each request's last pair, output hidden of every pair,
        the ForwardBatch, whose ``seqs`` give each request's rows)."""
        return self._run_extend(*self._extend_batch(reqs))

    def _extend_batch(self, reqs):
        """The extend pass's inputs, each request's pending pairs' draft KV slots allocated and
        recorded: (host ForwardBatch whose ``logits_indices`` are each request's last pair, the
        pairs' projected features)."""
        chunks, feats = [], []
        for r in reqs:
            st = self.states[r.rid]
            d = st.next_pair
            pending = torch.cat(st.pending) if len(st.pending) > 1 else st.pending[0]
            m = r.seq_len - 1 - d  # pairs d .. seq_len-2 (the last pairs the root)
            f = pending[:m]
            st.pending = [pending[m:]] if pending.shape[0] > m else []  # at prefill: the last prompt position's
            tokens = torch.tensor(r.seq_ids[d + 1 : d + 1 + m], dtype=torch.long)
            slots = self.kv.allocator.alloc(m)
            chunks.append((tokens, torch.arange(d, d + m), slots, st.slots.slots(), None))
            st.slots.append(slots)
            feats.append(f)
        fb = build_forward_batch(chunks, last_only=True)  # on the host: a graph copies it in at once
        return fb, self.project_features(torch.cat(feats))

    def _run_extend(self, fb, features):
        if self.graphs is not None:  # a step's few accepted pairs fit a graph; a prompt's do not
            out = self.graphs.run(fb, features)
            if out is not None:
                return out[0], out[1], fb
        fb = fb.to(self.device)
        logits, hidden = self.head_forward(fb.input_ids, features, fb, from_target=True)
        return logits, hidden, fb

    def _draft(self, reqs, plan):
        if self.chain is not None:  # topk=1 under graphs: the extend pass and the whole chain in one replay, one read back
            fb, features = self._extend_batch(reqs)
            chains = self._chain(reqs, fb, features, plan)
            if chains is not None:
                return chains
            logits, hidden, fb = self._run_extend(fb, features)
            return self._beams(reqs, logits, hidden[fb.logits_indices.to(hidden.device)], plan)
        one_call = self.kernel_draft_step() if self.graphs is None else None
        if one_call is not None:
            fb, features = self._extend_batch(reqs)
            if all(s.prefix_len or s.q_len == 1 for s in fb.seqs):  # (pairs without earlier ones: the Python pass sends them to SDPA)
                return self._step_in_one_call(one_call, reqs, plan, extend=(fb, features))
            logits, hidden, fb = self._run_extend(fb, features)
            return self._step_in_one_call(one_call, reqs, plan, first=(logits, hidden[fb.logits_indices]))
        logits, last_hidden = self._extend(reqs)
        return self._beams(reqs, logits, last_hidden, plan)

    def _step_in_one_call(self, one_call, reqs, plan, extend=None, first=None):
        """The extend pass (``extend``: its batch and features; else ``first``: its output) and
        ``_beams`` as one backend call: every beam node's draft KV slot allocated up front (``topk``
        a depth a request), freed after, as ``beam_search`` frees its own."""
        k, depth = self.shape.topk, plan.depth
        per = k * max(depth - 1, 0)
        slots = self.kv.allocator.alloc(len(reqs) * per)
        try:
            committed = [self.states[r.rid].slots.slots() for r in reqs]
            roots = [r.seq_len - 2 for r in reqs]
            out = one_call(committed, roots, slots.view(len(reqs), per), self.kv, self.rotary, k, depth, plan.score_floor, plan.size - 1, extend, first)
        finally:
            self.kv.allocator.free(slots)
        tokens, parents, scores, counts = out
        sizes = counts.tolist()
        return [DraftCandidates(t, p, s) for t, p, s in zip(tokens.split(sizes), parents.split(sizes), scores.split(sizes))]

    def _chain(self, reqs, extend, features, plan):
        """``_beams``' candidates for ``topk=1`` from ``DeviceChain``, the extend pass included
        (None: the batch does not fit it; the extend has not run)."""
        committed = [self.states[r.rid].slots.slots() for r in reqs]
        return self.chain.draft(extend, features, committed, [r.seq_len - 2 for r in reqs], plan.depth, plan.score_floor, plan.size - 1)

    def _beams(self, reqs, logits, last_hidden, plan):
        """The EAGLE-2 beam search from the extend pass's output at each request's root."""

        def step(step_chunks, parent_hidden):
            sfb = build_forward_batch(step_chunks)  # on the host: a graph copies it in at once
            if self.graphs is not None:
                out = self.graphs.run(sfb, parent_hidden)
                if out is not None:
                    return out
            sfb = sfb.to(self.device)
            return self.head_forward(sfb.input_ids, parent_hidden, sfb, from_target=False)

        return beam_search(
            reqs,
            logits,
            last_hidden,
            self.shape.topk,
            plan.depth,
            lambda r: self.states[r.rid].slots.slots(),
            self.kv.allocator,
            step,
            to_target=self.to_target,
            root_position=lambda r: r.seq_len - 2,
            score_floor=plan.score_floor,
            keep=plan.size - 1,
            top_logprobs=self.ctx.runner.backend.top_logprobs,
        )

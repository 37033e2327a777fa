"""``speculative.multi_layer`` (SGLang's ``--enable-multi-layer-eagle``): a checkpoint with several
NextN layers drafts a chain in which layer j (``mtp_layer + j``) proposes step j, as DeepSeek-V3's
sequential MTP modules are trained.

Layer j's pair i is (token t_{i+1+j}, h^{j-1}_i) and predicts t_{i+2+j}; h^{-1} is the target's
final (post-norm) hidden state, h^{j-1} the output of layer j-1 at the same position. With the
committed sequence t_0..t_n (t_n the root):

* the extend pass runs every layer over its new committed pairs, in layer order: layer j's pairs
  end at n-1-j (the last with a committed token), and its outputs wait (``pending``) as the
  next layer's hidden inputs;
* layer 0's output at pair n-1 gives draft d_{n+1}; step j (j >= 1) runs layer j over its pairs
  n-j..n-1, whose tokens include the drafts d_{n+1}..d_{n+j} and whose hidden inputs are layer
  j-1's committed output at n-j followed by its outputs of step j-1; the last row gives d_{n+j+1}.
  Those rows' KV is dropped after drafting: each layer's pool keeps committed pairs only.

Every layer has its own KV pool; drafting is greedy (top-1 per layer), scores are cumulative
log-probabilities, so the adaptive policy's depth and score floor apply as for beam drafters.
"""

from __future__ import annotations

import logging

import torch

from specfw.sdk import ConfigError, DraftCandidates, KVPool, SlotTable, build_forward_batch, draft_kv_slots, hookimpl, place_on_target, target_dtype

from .drafter import MtpDrafter
from .model import load_mtp, mtp_layers

logger = logging.getLogger(__name__)


class _LayerState:
    """One upper layer's view of a request: its committed pairs' KV (from pair ``base``, where the
    target's prefill started) and the lower layer's outputs it has not consumed yet (pairs
    next_pair..)."""

    def __init__(self, base: int = 0):
        self.base = base
        self.slots = SlotTable()
        self.pending: list[torch.Tensor] = []

    @property
    def next_pair(self) -> int:
        return self.base + len(self.slots)

    def take(self, m: int) -> torch.Tensor:
        rows = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]
        self.pending = [rows[m:]] if rows.shape[0] > m else []
        return rows[:m]

    def peek(self) -> torch.Tensor | None:
        return (torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]) if self.pending else None


class MultiLayerMtpDrafter(MtpDrafter):
    # the upper layers consume layer 0's outputs pair by pair: pairs taken from a cache would leave
    # them nothing to consume, so a cached target prefix starts every layer's pairs after it
    cache_pairs = False

    def __init__(self, ctx):
        super().__init__(ctx)  # layer mtp_layer (step 0) and its KV pool: FeatureDrafter's
        cfg, steps = ctx.config, ctx.shape.num_steps
        want = list(range(cfg.mtp_layer, cfg.mtp_layer + steps))
        have = mtp_layers(self.path, ctx.runner.hf_config, self.load_format)
        if any(i not in have for i in want):
            raise ConfigError(
                "speculative.num_steps",
                f"multi_layer drafts step i with NextN layer mtp_layer + i: num_steps={steps} from mtp_layer={cfg.mtp_layer} needs layers {want}, "
                f"{self.path} has {sorted(have)}",
            )
        self.uppers = [place_on_target(ctx, load_mtp(self.path, ctx.runner.hf_config, target_dtype(ctx), i, self.load_format)) for i in want[1:]]
        slots = draft_kv_slots(ctx, cfg)
        self.upper_kv = [KVPool(1, h.layer.n_kv, h.layer.head_dim, slots, dtype=ctx.runner.kv.dtype, device=self.device) for h in self.uppers]
        self.layer_states: dict[str, list[_LayerState]] = {}
        logger.info("mtp multi_layer: NextN layers %s draft steps 0..%d", want, steps - 1)

    def _layers(self, r) -> list[_LayerState]:
        return self.layer_states.setdefault(r.rid, [_LayerState(self.states[r.rid].base) for _ in self.uppers])

    def _drop(self, rid: str) -> None:
        for kv, st in zip(self.upper_kv, self.layer_states.pop(rid, [])):
            kv.allocator.free(st.slots.truncate(0))

    # ---- hooks ------------------------------------------------------------------------------
    @hookimpl
    def specfw_on_prefill(self, ctx, reqs, hidden, aux_hidden, spans):
        for r in reqs:
            if r.rid not in self.states:  # a fresh (or re-prefilled) request starts every layer anew
                self._drop(r.rid)
        super().specfw_on_prefill(ctx, reqs, hidden, aux_hidden, spans)

    @hookimpl
    def specfw_release(self, ctx, req):
        self._drop(req.rid)
        super().specfw_release(ctx, req)

    @hookimpl
    def specfw_draft(self, ctx, reqs, plan):
        ready = [r for r in reqs if r.rid in self.states]
        steps = self.shape.num_steps
        fits = self.kv.allocator.can_alloc(sum(r.seq_len - self.states[r.rid].next_pair for r in ready))
        for j, kv in enumerate(self.upper_kv):
            fits = fits and kv.allocator.can_alloc(sum(r.seq_len - self._layers(r)[j].next_pair for r in ready) + len(ready) * steps)
        if not ready or not fits:
            return [DraftCandidates.empty() for _ in reqs]
        drafted = dict(zip([r.rid for r in ready], self._draft(ready, plan)))
        return [drafted.get(r.rid, DraftCandidates.empty()) for r in reqs]

    # ---- extend: every layer over its new committed pairs -----------------------------------
    def _extend(self, reqs):
        logits, hidden, fb = self._extend_rows(reqs)  # layer 0 (FeatureDrafter's bookkeeping)
        outs = [hidden[s.q_start : s.q_start + s.q_len] for s in fb.seqs]
        for j, (head, kv) in enumerate(zip(self.uppers, self.upper_kv), start=1):
            for r, out in zip(reqs, outs):
                if out is not None:
                    self._layers(r)[j - 1].pending.append(out)
            outs = self._extend_layer(j, head, kv, reqs)
        return logits, hidden[fb.logits_indices]

    def _extend_layer(self, j, head, kv, reqs) -> list[torch.Tensor | None]:
        """Layer j over pairs next_pair..seq_len-2-j of each request; its outputs per request."""
        chunks, feats, who = [], [], []
        for i, r in enumerate(reqs):
            st = self._layers(r)[j - 1]
            d = st.next_pair
            m = r.seq_len - 1 - j - d  # pairs d .. seq_len-2-j: tokens t_{d+1+j} .. t_{seq_len-1}
            if m <= 0:
                continue
            slots = kv.allocator.alloc(m)
            chunks.append((torch.tensor(r.seq_ids[d + 1 + j : d + 1 + j + m], dtype=torch.long), torch.arange(d, d + m), slots, st.slots.slots(), None))
            st.slots.append(slots)
            feats.append(st.take(m))
            who.append(i)
        outs: list[torch.Tensor | None] = [None] * len(reqs)
        if chunks:
            fb = build_forward_batch(chunks, last_only=True).to(self.device)
            _, out = self.layer_forward(head, kv, fb.input_ids, torch.cat(feats), fb)
            for i, s in zip(who, fb.seqs):
                outs[i] = out[s.q_start : s.q_start + s.q_len]
        return outs

    # ---- drafting: layer j proposes step j -------------------------------------------------
    @torch.inference_mode()
    def _draft(self, reqs, plan):
        logits, _ = self._extend(reqs)
        v, t = torch.log_softmax(logits.float(), -1).max(-1)
        drafts = [[tok] for tok in t.tolist()]
        scores = [[s] for s in v.tolist()]
        prev: list[torch.Tensor | None] = [None] * len(reqs)  # layer j-1's outputs of the last step
        temp = []
        try:
            for j in range(1, min(plan.depth, 1 + len(self.uppers))):
                live = [i for i in range(len(reqs)) if scores[i][-1] >= plan.score_floor and len(drafts[i]) == j]
                if not live:
                    break
                head, kv = self.uppers[j - 1], self.upper_kv[j - 1]
                chunks, feats = [], []
                for i in live:
                    r, st = reqs[i], self._layers(reqs[i])[j - 1]
                    n, c = r.seq_len - 1, st.next_pair  # rows: pairs c .. n-1
                    parts = [x for x in (st.peek(), prev[i]) if x is not None]
                    f = torch.cat(parts) if len(parts) > 1 else parts[0]
                    assert f.shape[0] == n - c, (f.shape, n, c, j)
                    toks = [r.seq_ids[k] if k <= n else drafts[i][k - n - 1] for k in range(c + 1 + j, n + 1 + j)]
                    slots = kv.allocator.alloc(n - c)
                    temp.append((kv, slots))
                    chunks.append((torch.tensor(toks, dtype=torch.long), torch.arange(c, n), slots, st.slots.slots(), None))
                    feats.append(f)
                fb = build_forward_batch(chunks, last_only=True).to(self.device)
                step_logits, out = self.layer_forward(head, kv, fb.input_ids, torch.cat(feats), fb)
                v, t = torch.log_softmax(step_logits.float(), -1).max(-1)
                for row, (i, s) in enumerate(zip(live, fb.seqs)):
                    drafts[i].append(int(t[row]))
                    scores[i].append(scores[i][-1] + float(v[row]))
                    prev[i] = out[s.q_start : s.q_start + s.q_len]
        finally:
            for kv, slots in temp:
                kv.allocator.free(slots)
        return [
            DraftCandidates(torch.tensor(d, dtype=torch.long), torch.arange(-1, len(d) - 1, dtype=torch.long), torch.tensor(s, dtype=torch.float32))
            for d, s in zip(drafts, scores)
        ]

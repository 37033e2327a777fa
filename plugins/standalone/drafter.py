"""The standalone algorithm runtime: a draft LLM with its own KV pool, kept in step lazily.

Per decode step, for all requests in one batch:
  1. extend: feed each request's tokens the draft has not cached yet (accepted tokens + root);
     its last logits give the first ``topk`` candidates;
  2. ``num_steps - 1`` times: forward the ``topk`` beams (tree-masked over this step's drafted
     nodes), expand each by ``topk`` children scored by cumulative log-prob, keep the best
     ``topk`` as the next beams (EAGLE-2 style);
  3. drop the drafted nodes' draft KV (the committed prefix stays cached).
"""
from __future__ import annotations

import logging

import torch

from specfw.config import ConfigError
from specfw.hookspecs import hookimpl
from specfw.kv_cache import SlotTable
from specfw.model_loader import load_model
from specfw.model_runner import ModelRunner, build_forward_batch
from specfw.sampling import target_probs
from specfw.spec.types import DraftCandidates

logger = logging.getLogger(__name__)


def check_same_tokenizer(target_tok, draft_tok, draft_path) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError("speculative.draft_model_path",
                          f"draft model {draft_path} does not share the target's tokenizer "
                          f"(vocab sizes {len(draft_tok.get_vocab())} vs {len(target_tok.get_vocab())} or differing ids)")


class _DraftState:
    def __init__(self):
        self.slots = SlotTable()   # draft KV of seq_ids[:len(slots)]


class StandaloneDrafter:
    def __init__(self, ctx):
        cfg = ctx.config
        if not cfg.draft_model_path:
            raise ConfigError("speculative.draft_model_path", "standalone needs a draft model directory or hub id")
        dtype = str(getattr(ctx.engine_config.model.dtype, "value", ctx.engine_config.model.dtype))
        loaded = load_model(cfg.draft_model_path, dtype=dtype, revision=cfg.draft_model_revision or "main"
                            if not str(cfg.draft_model_path).startswith(("/", ".")) else None,
                            max_positions=ctx.runner.max_context)
        check_same_tokenizer(ctx.tokenizer, loaded.tokenizer, cfg.draft_model_path)
        if loaded.hf_config.vocab_size != ctx.runner.vocab_size:
            raise ConfigError("speculative.draft_model_path",
                              f"draft vocab_size {loaded.hf_config.vocab_size} != target vocab_size {ctx.runner.vocab_size}")
        slots = cfg.draft_kv_tokens or ctx.runner.allocator.num_slots
        self.draft = ModelRunner(loaded.model, loaded.hf_config, slots, ctx.runner.kv.dtype)
        self.shape = ctx.shape
        self.sample_draft = cfg.sample_draft and not ctx.force_greedy
        self.states: dict[str, _DraftState] = {}
        logger.info("standalone draft: %s (%d layers)", loaded.path, loaded.model.num_layers)

    # ---- hooks ----------------------------------------------------------------------------
    @hookimpl
    def specfw_draft(self, ctx, reqs):
        alloc = self.draft.allocator
        need = sum(r.seq_len - len(self._state(r).slots) for r in reqs) + len(reqs) * self.shape.topk * self.shape.num_steps
        if not alloc.can_alloc(need):
            self._evict_idle(reqs)
            if not alloc.can_alloc(need):
                logger.warning("draft KV pool full: decoding this step without drafts")
                return [DraftCandidates.empty() for _ in reqs]
        try:
            return self._draft(reqs)
        finally:
            for r in reqs:  # forget this step's drafted nodes; keep the committed prefix
                self.draft.allocator.free(self._state(r).slots.truncate(r.seq_len))

    @hookimpl
    def specfw_release(self, ctx, req):
        st = self.states.pop(req.rid, None)
        if st is not None:
            self.draft.allocator.free(st.slots.truncate(0))

    # ---- drafting -------------------------------------------------------------------------
    def _state(self, req) -> _DraftState:
        return self.states.setdefault(req.rid, _DraftState())

    def _evict_idle(self, active) -> None:
        keep = {r.rid for r in active}
        for rid in [rid for rid in self.states if rid not in keep]:
            self.draft.allocator.free(self.states.pop(rid).slots.truncate(0))

    def _sampled(self, req) -> bool:
        return self.sample_draft and self.shape.topk == 1 and not req.params.greedy

    def _draft(self, reqs):
        k, steps = self.shape.topk, self.shape.num_steps
        # 1. extend: catch the draft cache up to the root token (inclusive)
        chunks = []
        for r in reqs:
            st = self._state(r)
            start = len(st.slots)
            ids = r.seq_ids[start:]
            slots = self.draft.allocator.alloc(len(ids))
            chunks.append((torch.tensor(ids, dtype=torch.long), torch.arange(start, r.seq_len), slots, st.slots.slots(), None))
            st.slots.append(slots)
        logits = self.draft.forward(build_forward_batch(chunks, last_only=True)).logits
        cands = [dict(tokens=[], parents=[], scores=[], probs=[]) for _ in reqs]
        beams = []  # per request: list of (candidate index, score, token)
        for i, r in enumerate(reqs):
            beams.append(self._expand(r, logits[i:i + 1], [(-1, 0.0)], k, cands[i]))
        # 2. deeper steps: forward the beams; each sees the committed prefix, its drafted
        #    ancestors and itself (a tree mask over this step's drafted nodes)
        drafted = [[] for _ in reqs]        # per request: draft slots of forwarded nodes, in order
        row_of = [dict() for _ in reqs]     # candidate index → row in drafted[i]
        for depth in range(1, steps):
            chunks = []
            for i, r in enumerate(reqs):
                bs, prev = beams[i], len(drafted[i])
                mask = torch.zeros(len(bs), prev + len(bs), dtype=torch.bool)
                for j, (c, _) in enumerate(bs):
                    p = cands[i]["parents"][c]
                    while p >= 0:
                        mask[j, row_of[i][p]] = True
                        p = cands[i]["parents"][p]
                    mask[j, prev + j] = True
                    row_of[i][c] = prev + j
                slots = self.draft.allocator.alloc(len(bs))
                prefix = torch.cat([self._state(r).slots.slots(), torch.tensor(drafted[i], dtype=torch.long)])
                toks = torch.tensor([cands[i]["tokens"][c] for c, _ in bs], dtype=torch.long)
                chunks.append((toks, torch.full((len(bs),), r.seq_len - 1 + depth, dtype=torch.long), slots, prefix, mask))
                drafted[i].extend(slots.tolist())
            logits = self.draft.forward(build_forward_batch(chunks)).logits
            off = 0
            for i, r in enumerate(reqs):
                n = len(beams[i])
                beams[i] = self._expand(r, logits[off:off + n], beams[i], k, cands[i])
                off += n
        for i in range(len(reqs)):
            self.draft.allocator.free(torch.tensor(drafted[i], dtype=torch.long))
        out = []
        for c in cands:
            probs = torch.stack(c["probs"]) if c["probs"] and all(p is not None for p in c["probs"]) else None
            out.append(DraftCandidates(torch.tensor(c["tokens"], dtype=torch.long), torch.tensor(c["parents"], dtype=torch.long),
                                       torch.tensor(c["scores"], dtype=torch.float32), probs))
        return out

    def _expand(self, req, logits, beams, k, cand):
        """Score ``k`` children of every beam; record them as candidates; return the best ``k``."""
        children = []
        for row, (parent, score) in enumerate(beams):
            if self._sampled(req):
                probs = target_probs(logits[row:row + 1], req.params)[0]
                tok = int(torch.multinomial(probs, 1, generator=req.generator))
                children.append((score + float(torch.log(probs[tok] + 1e-20)), parent, tok, probs))
                continue
            logp = torch.log_softmax(logits[row].float(), -1)
            v, ix = torch.topk(logp, k)
            children.extend((score + float(a), parent, int(b), None) for a, b in zip(v, ix))
        children.sort(key=lambda c: -c[0])
        nxt = []
        for j, (score, parent, tok, probs) in enumerate(children):
            cand["tokens"].append(tok)
            cand["parents"].append(parent)
            cand["scores"].append(score)
            cand["probs"].append(probs)
            if j < k:
                nxt.append((len(cand["tokens"]) - 1, score))
        return nxt

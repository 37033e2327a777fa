"""The standalone algorithm runtime: a draft LLM with its own KV pool, kept in step lazily.

After the target's prefill the draft prefills the prompt too. Per decode step, for all requests
in one batch: an extend pass feeds each request's tokens the draft has not cached yet (accepted
tokens + root); its last logits start the EAGLE-2 style beam
search of ``specfw.speculative.beam`` (``num_steps`` deep, ``topk`` wide); drafted nodes' KV is dropped
afterwards, the committed prefix stays cached.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specfw.sdk import (
    ConfigError,
    demo_draft_for,
    DraftCandidates,
    ModelRunner,
    SlotTable,
    beam_search,
    build_forward_batch,
    draft_kv_slots,
    draft_load_format,
    hookimpl,
    load_model,
    load_token_map,
    resolve_token_map,
    restricted_lm_head,
    target_device,
    target_dtype,
)

from .draft_head import use_draft_lm_head

logger = logging.getLogger(__name__)


def check_same_tokenizer(target_tok, draft_tok, draft_path) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ConfigError(
            "speculative.draft_model_path",
            f"draft model {draft_path} does not share the target's tokenizer "
            f"(vocab sizes {len(draft_tok.get_vocab())} vs {len(target_tok.get_vocab())} or differing ids)",
        )


DEMO_DRAFT = Path(__file__).parent / "demo_draft"


def default_draft(ctx) -> str:
    """The committed demo draft (trained by `specfw train draft=standalone`) serves the demo target."""
    demo = demo_draft_for(ctx, DEMO_DRAFT)
    if demo is not None:
        return str(demo)
    raise ConfigError(
        "speculative.draft_model_path",
        "standalone needs a draft model (HF directory or hub id) for this "
        "target, e.g. one from `specfw train draft=standalone` or "
        "`python -m specfw_plugins.standalone.make_draft OUT --layers 4`",
    )


class _DraftState:
    def __init__(self):
        self.slots = SlotTable()  # draft KV of seq_ids[:len(slots)]


class StandaloneDrafter:
    def __init__(self, ctx):
        self.ctx = ctx
        cfg = ctx.config
        ref = cfg.draft_model_path or default_draft(ctx)
        dtype = str(getattr(ctx.engine_config.model.dtype, "value", ctx.engine_config.model.dtype))
        revision = (cfg.draft_model_revision or "main") if cfg.draft_model_path and not Path(ref).exists() else None
        model = ctx.engine_config.model
        loaded = load_model(
            ref,
            dtype=dtype,
            revision=revision,
            max_positions=ctx.runner.max_context,
            device=target_device(ctx),
            load_format=draft_load_format(ctx),
            trust_remote_code=bool(getattr(model, "trust_remote_code", False)),
            format_key="speculative.draft_load_format",
        )
        check_same_tokenizer(ctx.tokenizer, loaded.tokenizer, ref)
        if loaded.hf_config.vocab_size != ctx.runner.vocab_size:
            raise ConfigError("speculative.draft_model_path", f"draft vocab_size {loaded.hf_config.vocab_size} != target vocab_size {ctx.runner.vocab_size}")
        self.to_target = restrict_to_token_map(ctx, loaded.model, resolve_token_map(cfg.token_map, None if cfg.draft_model_path else DEMO_DRAFT))
        slots = draft_kv_slots(ctx, cfg)
        self.draft = ModelRunner(loaded.model, loaded.hf_config, slots, target_dtype(ctx), backend=ctx.runner.backend.for_drafting())
        use_draft_lm_head(cfg.draft_lm_head, loaded.model, self.draft.backend, None, self.to_target)
        self.shape = ctx.shape
        self.sample_draft = cfg.sample_draft and not ctx.force_greedy
        self.states: dict[str, _DraftState] = {}
        logger.info(
            "standalone draft: %s (%d layers)%s",
            loaded.path,
            loaded.model.num_layers,
            f", FR-Spec token map of {len(self.to_target)} ids" if self.to_target is not None else "",
        )

    # ---- hooks ----------------------------------------------------------------------------
    @hookimpl
    def specfw_draft(self, ctx, reqs, plan):
        alloc = self.draft.allocator
        need = sum(r.seq_len - len(self._state(r).slots) for r in reqs) + len(reqs) * self.shape.topk * self.shape.num_steps
        if not alloc.can_alloc(need):
            self._evict_idle(reqs)
            if not alloc.can_alloc(need):
                logger.warning("draft KV pool full: decoding this step without drafts")
                return [DraftCandidates.empty() for _ in reqs]
        try:
            return self._draft(reqs, plan)
        finally:
            for r in reqs:  # forget this step's drafted nodes; keep the committed prefix
                self.draft.allocator.free(self._state(r).slots.truncate(r.seq_len))

    @hookimpl
    def specfw_on_prefill(self, ctx, reqs, hidden, aux_hidden, spans):
        # catch the draft up on the prompt now, as part of the prefill: the first decode step then
        # extends one token, like every other step, and its cost says what drafting costs
        ready = [r for r in reqs if r.seq_len > len(self._state(r).slots)]
        if ready and self.draft.allocator.can_alloc(sum(r.seq_len - len(self._state(r).slots) for r in ready)):
            self._extend(ready)

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

    def _extend(self, reqs) -> torch.Tensor:
        """Catch each request's draft cache up to its last token (inclusive); the draft's logits there."""
        chunks = []
        for r in reqs:
            st = self._state(r)
            start = len(st.slots)
            ids = r.seq_ids[start:]
            slots = self.draft.allocator.alloc(len(ids))
            chunks.append((torch.tensor(ids, dtype=torch.long), torch.arange(start, r.seq_len), slots, st.slots.slots(), None))
            st.slots.append(slots)
        return self.draft.forward(build_forward_batch(chunks, last_only=True)).logits

    def _draft(self, reqs, plan):
        logits = self._extend(reqs)  # up to the root token; its logits start the beams
        return draft_beams(self, reqs, plan, logits, lambda r: self._state(r).slots.slots())


def restrict_to_token_map(ctx, model, token_map) -> torch.Tensor | None:
    """FR-Spec: ``model``'s lm_head cut to the target ids of ``token_map`` (a resolved path, or
    None: the whole vocabulary); returns the draft row -> target id map (None without one)."""
    if not token_map:
        return None
    to_target = load_token_map(token_map, ctx.runner.vocab_size)
    model.lm_head = restricted_lm_head(model.lm_head.weight, to_target)
    return to_target


def draft_beams(drafter, reqs, plan, logits, committed_slots) -> list[DraftCandidates]:
    """The beam search over a draft LLM's own forwards, from its ``logits`` at each root;
    ``drafter``: a ``StandaloneDrafter`` or a ``SelfDrafter`` (its runner, shape, token map)."""

    def step(step_chunks, _parent_hidden):
        return drafter.draft.forward(build_forward_batch(step_chunks)).logits, None

    return beam_search(
        reqs,
        logits,
        None,
        drafter.shape.topk,
        plan.depth,
        committed_slots,
        drafter.draft.allocator,
        step,
        drafter._sampled,
        to_target=drafter.to_target,
        score_floor=plan.score_floor,
        keep=plan.size - 1,
        vocab_size=drafter.ctx.runner.vocab_size,
        top_logprobs=drafter.draft.backend.top_logprobs,
    )

"""The self-draft (``speculative.draft_model_path=target``): the target's own checkpoint,
quantized, drafts on the target's KV cache.

On a CPU a decode step streams the weights, so the same model with 4-bit GGUF blocks and int8
activations (``draft_model_quantization=gguf``, on a target converted from a GGUF file such as
the demo) or int8 weights and activations (``w8a8_int8``) steps in a fraction of the target's
time, and it agrees with the target far more often than a small draft does: only its rounding
differs. The target verifies every token, so the output is the target's.

It shares the target's KV pool (``ModelRunner(kv=...)``): the committed prefix's keys and values
are the target's own, so the draft has no prompt to prefill and no accepted tokens to catch up
on. Per step it forwards the root (the last committed token, whose KV the target writes in the
verify forward) into a scratch slot of the target's pool, then the beam search's nodes into
more; all of them go back to the pool before the target verifies.
"""

from __future__ import annotations

import logging

import torch

from specfw.sdk import (
    ConfigError,
    DraftCandidates,
    ModelRunner,
    build_forward_batch,
    draft_load_format,
    hookimpl,
    load_model,
    resolve_token_map,
    target_device,
    target_dtype,
)

from .drafter import draft_beams, restrict_to_token_map
from .draft_head import use_draft_lm_head

logger = logging.getLogger(__name__)


def check_self_draft(ctx) -> str:
    """The draft's weight scheme, after checking a self-draft can run and is not the target itself."""
    backend, model = ctx.runner.backend, ctx.engine_config.model
    scheme = getattr(backend, "draft_quantization", None)
    if scheme is None:
        raise ConfigError("speculative.draft_model_path", "target (a self-draft) needs the CPU kernels' quantized linears: model.device=cpu")
    if ctx.runner.tp is not None:
        raise ConfigError("speculative.draft_model_path", "target (a self-draft) reads the target's KV pool on one rank: not with model.tp_size > 1")
    if getattr(ctx.config, "draft_kv_tokens", None) is not None:
        raise ConfigError("speculative.draft_kv_tokens", "a self-draft (draft_model_path=target) drafts on the target's KV pool: leave it null")
    if ctx.target_path is None:
        raise ConfigError("speculative.draft_model_path", "target (a self-draft) needs the target's checkpoint directory")
    # the target's scheme as the backend runs it (model.quantization=auto resolved)
    same = (scheme, getattr(backend, "draft_activations", "none")) == (str(backend.quantization), str(model.activation_quantization))
    if same:
        raise ConfigError(
            "speculative.draft_model_quantization",
            f"a self-draft (draft_model_path=target) with the target's own scheme ('{scheme}') costs a target step per draft token: "
            "set gguf (a target converted from a GGUF file: its 4-bit blocks, int8 activations) or w8a8_int8",
        )
    return scheme


class SelfDrafter:
    def __init__(self, ctx):
        self.ctx = ctx
        cfg = ctx.config
        scheme = check_self_draft(ctx)
        model = ctx.engine_config.model
        try:
            loaded = load_model(
                str(ctx.target_path),
                dtype=str(getattr(model.dtype, "value", model.dtype)),
                max_positions=ctx.runner.max_context,
                device=target_device(ctx),
                quantization="gguf" if scheme == "gguf" else "none",
                load_format=draft_load_format(ctx),
                trust_remote_code=bool(getattr(model, "trust_remote_code", False)),
                format_key="speculative.draft_load_format",
            )
        except ValueError as e:
            if scheme != "gguf" or isinstance(e, ConfigError):
                raise
            msg = f"gguf: the target has no GGUF blocks to draft with ({e}); w8a8_int8 works on any target"
            raise ConfigError("speculative.draft_model_quantization", msg) from e
        self.to_target = restrict_to_token_map(ctx, loaded.model, resolve_token_map(cfg.token_map, None))  # None: the whole vocabulary
        self.draft = ModelRunner(loaded.model, loaded.hf_config, 0, target_dtype(ctx), backend=ctx.runner.backend.for_drafting(), kv=ctx.runner.kv)
        head = use_draft_lm_head(cfg.draft_lm_head, loaded.model, self.draft.backend, scheme, self.to_target)
        self.shape = ctx.shape
        self.sample_draft = cfg.sample_draft and not ctx.force_greedy
        logger.info(
            "standalone self-draft: the target's own %d layers, %s weights, on the target's KV pool; lm_head: %s", loaded.model.num_layers, scheme, head
        )

    def _sampled(self, req) -> bool:
        return self.sample_draft and self.shape.topk == 1 and not req.params.greedy

    @hookimpl
    def specfw_draft(self, ctx, reqs, plan):
        pool = self.draft.allocator  # the target's: the scheduler already holds this step's verify slots
        if not pool.can_alloc(len(reqs) * (1 + self.shape.topk * self.shape.num_steps)):
            logger.warning("KV pool full: decoding this step without drafts")
            return [DraftCandidates.empty() for _ in reqs]
        roots = pool.alloc(len(reqs))
        try:
            return self._draft(reqs, plan, roots)
        finally:
            pool.free(roots)

    def _draft(self, reqs, plan, roots: torch.Tensor) -> list[DraftCandidates]:
        # each root (the last committed token) on the target's KV of everything before it
        chunks = [
            (torch.tensor(r.seq_ids[-1:], dtype=torch.long), torch.tensor([r.seq_len - 1]), roots[i : i + 1], r.slots.slots(), None) for i, r in enumerate(reqs)
        ]
        logits = self.draft.forward(build_forward_batch(chunks, last_only=True)).logits
        committed = {r.rid: torch.cat([c[3], c[2]]) for r, c in zip(reqs, chunks)}  # prefix slots, then the root's: made once, read every depth
        return draft_beams(self, reqs, plan, logits, lambda r: committed[r.rid])

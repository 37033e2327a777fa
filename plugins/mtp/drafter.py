"""The mtp algorithm runtime: the target's own NextN layer drafts, EAGLE-style.

Pair i = (token t_{i+1}, the target's final hidden state at i) → the NextN layer → its norm and
the target's lm_head (or the layer's own ``shared_head.head``) predict t_{i+2}; deeper steps feed
the layer's own output hidden back, reusing the one layer (SGLang does the same with DeepSeek's
single NextN layer). Drafting, the KV of the layer and tree search are the shared
``FeatureDrafter``'s. The demo target has no NextN layer: a committed one (``demo_draft/``,
docs/drafts.md) is its default."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specfw.sdk import (
    FeatureDrafter,
    demo_draft_for,
    Rotary,
    draft_kv_slots,
    draft_logits,
    draft_load_format,
    load_token_map,
    place_on_target,
    resolve_model_path,
    resolve_token_map,
    restricted_lm_head,
    target_device,
    target_dtype,
)

from .model import load_mtp

logger = logging.getLogger(__name__)
DEMO_DRAFT = Path(__file__).parent / "demo_draft"


def nextn_path(ctx) -> Path:
    """Where the NextN layer comes from: ``speculative.draft_model_path``; else, for the demo target
    (which has none of its own), the committed demo layer; else the target's own checkpoint."""
    cfg = ctx.config
    if cfg.draft_model_path:
        return Path(resolve_model_path(cfg.draft_model_path, cfg.draft_model_revision))
    return demo_draft_for(ctx, DEMO_DRAFT) or Path(ctx.target_path)


class MtpDrafter(FeatureDrafter):
    def __init__(self, ctx):
        cfg = ctx.config
        path = nextn_path(ctx)
        self.path, self.load_format = path, draft_load_format(ctx)
        target = ctx.runner.model
        # on the target's device, with the CPU's faster linears (the NextN lm_head included)
        self.head = place_on_target(ctx, load_mtp(path, ctx.runner.hf_config, target_dtype(ctx), cfg.mtp_layer, self.load_format))
        self.target = target
        self.rotary = Rotary(self.head.config, ctx.runner.max_context, target_dtype(ctx)).to(target_device(ctx))
        # FR-Spec: the committed demo layer scores its map's ids (the lm_head is most of a draft step)
        self.map_head = None
        demo = not cfg.draft_model_path and demo_draft_for(ctx, DEMO_DRAFT) is not None
        token_map = None if cfg.multi_layer else resolve_token_map(cfg.token_map, DEMO_DRAFT if demo else None)
        if token_map:
            self.to_target = load_token_map(token_map, ctx.runner.vocab_size)
            full = self.head.head if self.head.head is not None else target.lm_head
            self.map_head = place_on_target(ctx, restricted_lm_head(full.weight, self.to_target))
        super().__init__(ctx, self.head.layer, draft_kv_slots(ctx, cfg))
        logger.info(
            "mtp: NextN layer %d of %s (%s layout)%s",
            cfg.mtp_layer,
            path,
            self.head.layout,
            f", FR-Spec token map of {len(self.to_target)} ids" if self.to_target is not None else "",
        )

    @torch.inference_mode()
    def target_features(self, hidden, aux, rows):
        return self.target.norm(hidden.index_select(0, rows))

    @torch.inference_mode()
    def target_features_all(self, hidden, aux):
        return self.target.norm(hidden)

    @torch.inference_mode()
    def head_forward(self, tokens, features, fb, from_target):
        return self.layer_forward(self.head, self.kv, tokens, features, fb)

    def layer_forward(self, head, kv, tokens, features, fb):
        """One NextN layer over pairs (token, hidden) in its KV pool → (logits at ``fb.logits_indices``
        (every row when None), output hidden of every row)."""
        x = head.fuse(self.target.embed_tokens(tokens), features)
        out = head.layer(head.input_layernorm(x), x, fb, kv, self.rotary)
        sel = out if fb.logits_indices is None else out.index_select(0, fb.logits_indices)
        if head is self.head and self.map_head is not None:
            lm_head = self.map_head
        else:
            lm_head = head.head if head.head is not None else self.target.lm_head
        return draft_logits(lm_head, head.final_norm(sel)), out

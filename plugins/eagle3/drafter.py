"""The eagle3 algorithm runtime."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from specfw.sdk import (
    ConfigError,
    FeatureDrafter,
    demo_draft_for,
    Rotary,
    draft_kv_slots,
    draft_logits,
    draft_load_format,
    place_on_target,
    resolve_model_path,
    target_device,
    target_dtype,
)

from .model import aux_layer_ids, load_eagle3

logger = logging.getLogger(__name__)
DEMO_DRAFT = Path(__file__).parent / "demo_draft"


def default_draft_path(ctx) -> str:
    """The committed demo draft is the default for the demo target."""
    demo = demo_draft_for(ctx, DEMO_DRAFT)
    if demo is not None:
        return str(demo)
    raise ConfigError("speculative.draft_model_path", "eagle3 needs a draft checkpoint (EAGLE-3 layout) for this target")


class Eagle3Drafter(FeatureDrafter):
    def __init__(self, ctx):
        cfg = ctx.config
        if cfg.token_map:
            logger.warning("speculative.token_map is ignored for EAGLE-3 (the draft vocabulary comes from d2t)")
        path = resolve_model_path(cfg.draft_model_path or default_draft_path(ctx), cfg.draft_model_revision)
        target = ctx.runner.model
        head = load_eagle3(Path(path), ctx.runner.hf_config, target_dtype(ctx), draft_load_format(ctx))
        self.to_target = head.to_target_ids()  # host map, read per drafted token
        self.head = place_on_target(ctx, head)
        self.embed = target.embed_tokens
        self.rotary = Rotary(self.head.config, ctx.runner.max_context, target_dtype(ctx)).to(target_device(ctx))
        ctx.capture_layers = aux_layer_ids(self.head.config, target.num_layers, cfg.aux_layers)
        super().__init__(ctx, self.head.midlayer, draft_kv_slots(ctx, cfg))
        logger.info("eagle3 draft %s: draft vocab %d, target taps %s", path, self.head.draft_vocab, ctx.capture_layers)

    def target_features(self, hidden, aux, rows):
        return torch.cat([a.index_select(0, rows) for a in aux], dim=-1)

    def target_features_all(self, hidden, aux):
        return torch.cat(aux, dim=-1)

    @torch.inference_mode()
    def project_features(self, features):
        return self.head.fc(features)

    def kernel_draft_step(self):
        layer = self.head.midlayer
        if layer.backend is None:
            return None
        return layer.backend.eagle3_draft(layer, self.embed, self.head.norm, self.head.lm_head, self.to_target)

    @torch.inference_mode()
    def head_forward(self, tokens, features, fb, from_target):
        layer = self.head.midlayer
        out = layer(layer.attn_input(self.embed(tokens), features), features, fb, self.kv, self.rotary)
        sel = out if fb.logits_indices is None else out.index_select(0, fb.logits_indices)
        return draft_logits(self.head.lm_head, layer.norm_rows(self.head.norm, sel)), out

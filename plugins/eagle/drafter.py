"""The eagle (EAGLE-1/2) algorithm runtime, with optional FR-Spec token map."""

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
    load_token_map,
    place_on_target,
    resolve_model_path,
    resolve_token_map,
    restricted_lm_head,
    target_device,
    target_dtype,
)

from .model import load_eagle

logger = logging.getLogger(__name__)
DEMO_DRAFT = Path(__file__).parent / "demo_draft"


class EagleDrafter(FeatureDrafter):
    def __init__(self, ctx):
        cfg = ctx.config
        ref = cfg.draft_model_path
        if not ref:
            demo = demo_draft_for(ctx, DEMO_DRAFT)
            if demo is None:
                raise ConfigError("speculative.draft_model_path", "eagle needs a draft checkpoint (EAGLE layout) for this target")
            ref = str(demo)
        token_map = resolve_token_map(cfg.token_map, None if cfg.draft_model_path else DEMO_DRAFT)  # the demo draft's FR-Spec map
        path = resolve_model_path(ref, cfg.draft_model_revision)
        target = ctx.runner.model
        self.head = place_on_target(ctx, load_eagle(Path(path), ctx.runner.hf_config, target_dtype(ctx), draft_load_format(ctx)))
        self.target = target
        self.rotary = Rotary(self.head.config, ctx.runner.max_context, target_dtype(ctx)).to(target_device(ctx))
        self.lm_head = target.lm_head  # shared with the target
        if token_map:  # FR-Spec: score only the frequent tokens
            self.to_target = load_token_map(token_map, ctx.runner.vocab_size)
            self.lm_head = place_on_target(ctx, restricted_lm_head(target.lm_head.weight, self.to_target))
        super().__init__(ctx, self.head.layers[0], draft_kv_slots(ctx, cfg))
        logger.info("eagle draft %s%s", path, f", FR-Spec token map of {len(self.to_target)} ids" if token_map else "")

    @torch.inference_mode()
    def target_features(self, hidden, aux, rows):
        return self.target.norm(hidden.index_select(0, rows))

    @torch.inference_mode()
    def target_features_all(self, hidden, aux):
        return self.target.norm(hidden)

    @torch.inference_mode()
    def head_forward(self, tokens, features, fb, from_target):
        x = self.head.fc(torch.cat([self.target.embed_tokens(tokens), features], dim=-1))
        out = self.head.layers[0](x, x, fb, self.kv, self.rotary)
        sel = out if fb.logits_indices is None else out.index_select(0, fb.logits_indices)
        return draft_logits(self.lm_head, sel), out

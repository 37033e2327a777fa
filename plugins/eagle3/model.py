"""The EAGLE-3 draft head in the published checkpoint layout:

``fc.weight`` [H, 3·H_target]; ``midlayer.{hidden_norm, input_layernorm, post_attention_layernorm,
self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}`` (q/k/v take 2H: cat(input_layernorm(embed),
hidden_norm(h))); ``norm.weight``; ``lm_head.weight`` [draft_vocab, H]; ``d2t`` [draft_vocab]
(target id = i + d2t[i]); ``t2d`` [vocab] bool. Embeddings are the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specfw.sdk import ConfigError, DraftDecoderLayer, RMSNorm


class Eagle3MidLayer(DraftDecoderLayer):
    def __init__(self, cfg):
        super().__init__(cfg, in_dim=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.norm_rows(self.input_layernorm, embeds), self.norm_rows(self.hidden_norm, hidden)], dim=-1)


class Eagle3Head(nn.Module):
    def __init__(self, cfg, target_hidden: int, vocab_size: int):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.draft_vocab = getattr(cfg, "draft_vocab_size", None) or vocab_size
        self.fc = nn.Linear(3 * target_hidden, h, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool))

    def to_target_ids(self) -> torch.Tensor:
        """Target id of each draft-vocabulary index, on the host."""
        return torch.arange(self.draft_vocab) + self.d2t.cpu()


def aux_layer_ids(draft_cfg, num_target_layers: int, override: list[int] | None) -> tuple[int, ...]:
    """Target layers whose input hidden states feed fc, low → high."""
    if override:
        return tuple(override)
    ids = (getattr(draft_cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(i + 1 for i in ids)  # published ids name the layer whose *output* is tapped
    L = num_target_layers
    return (2, L // 2, L - 3)


def load_eagle3(path: Path, target_cfg, dtype: torch.dtype, load_format: str = "auto") -> Eagle3Head:
    """``load_format``: as ``speculative.draft_load_format`` (``dummy``: random weights, identity ``d2t``, no file read)."""
    from transformers import LlamaConfig
    from specfw.sdk import dummy_weights_, load_state_dict

    raw = json.loads((path / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg.eagle_config = raw.get("eagle_config")
    cfg.draft_vocab_size = raw.get("draft_vocab_size")
    target_h = raw.get("target_hidden_size") or target_cfg.hidden_size
    if target_h != target_cfg.hidden_size:
        raise ConfigError("speculative.draft_model_path", f"EAGLE-3 draft expects target hidden size {target_h}, the target has {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError("speculative.draft_model_path", f"EAGLE-3 draft vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ConfigError(
            "speculative.draft_model_path",
            f"EAGLE-3 draft hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size} (the head embeds tokens with the target's embeddings)",
        )
    head = Eagle3Head(cfg, target_h, target_cfg.vocab_size)
    if load_format == "dummy":  # d2t zeros: draft id i is target id i
        return dummy_weights_(head).to(dtype).eval().requires_grad_(False)
    state = {k.removeprefix("model."): v for k, v in load_state_dict(path, load_format, "speculative.draft_load_format").items()}
    state.pop("embed_tokens.weight", None)
    if "d2t" not in state:
        if head.draft_vocab != target_cfg.vocab_size:
            raise ConfigError("speculative.draft_model_path", "EAGLE-3 draft with a reduced vocabulary lacks d2t")
        state["d2t"] = torch.zeros(head.draft_vocab, dtype=torch.long)
    state.setdefault("t2d", torch.ones(target_cfg.vocab_size, dtype=torch.bool))
    if state["lm_head.weight"].shape[0] != head.draft_vocab or state["d2t"].shape[0] != head.draft_vocab:
        raise ConfigError(
            "speculative.draft_model_path",
            f"EAGLE-3 lm_head/d2t size {state['lm_head.weight'].shape[0]}/{state['d2t'].shape[0]} != draft_vocab_size {head.draft_vocab}",
        )
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing:
        raise ConfigError("speculative.draft_model_path", f"EAGLE-3 checkpoint {path} lacks tensors: {missing[:6]}")
    head.unexpected = unexpected
    return head.to(dtype).eval().requires_grad_(False)

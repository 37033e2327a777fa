"""The EAGLE (v1/v2) draft head in the published layout: ``fc.weight`` [H, 2H] (+ ``fc.bias``)
applied to cat(embed(token), feature), then ``layers.0`` — a Llama decoder layer without
``input_layernorm``. Embeddings and lm_head are the target's; features are the target's
final (post-norm) hidden states. Names may carry a ``model.`` prefix."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specfw.sdk import ConfigError, DraftDecoderLayer


class EagleHead(nn.Module):
    def __init__(self, cfg, bias: bool):
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * h, h, bias=bias)
        self.layers = nn.ModuleList([DraftDecoderLayer(cfg)])


def load_eagle(path: Path, target_cfg, dtype: torch.dtype, load_format: str = "auto") -> EagleHead:
    """``load_format``: as ``speculative.draft_load_format`` (``dummy``: random weights, no file read)."""
    from transformers import LlamaConfig
    from specfw.sdk import dummy_weights_, load_state_dict

    raw = json.loads((path / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ConfigError("speculative.draft_model_path", f"EAGLE draft hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError("speculative.draft_model_path", f"EAGLE draft vocab_size {cfg.vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if load_format == "dummy":
        return dummy_weights_(EagleHead(cfg, bias=False)).to(dtype).eval().requires_grad_(False)
    state = {k.removeprefix("model."): v for k, v in load_state_dict(path, load_format, "speculative.draft_load_format").items()}
    for k in [k for k in state if k.startswith(("embed_tokens.", "lm_head.", "norm.")) or ".input_layernorm." in k]:
        state.pop(k)  # the target's embeddings/head are used; EAGLE's layer has no input norm
    if "fc.weight" not in state or state["fc.weight"].shape != (cfg.hidden_size, 2 * cfg.hidden_size):
        raise ConfigError("speculative.draft_model_path", f"{path}: not an EAGLE checkpoint (fc.weight [H, 2H] missing)")
    head = EagleHead(cfg, bias="fc.bias" in state)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing:
        raise ConfigError("speculative.draft_model_path", f"EAGLE checkpoint {path} lacks tensors: {missing[:6]}")
    head.unexpected = unexpected
    return head.to(dtype).eval().requires_grad_(False)

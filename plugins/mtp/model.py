"""NextN / MTP layers read from a target checkpoint, in the two published layouts:

* DeepSeek-V3 style, at ``model.layers.{num_hidden_layers + i}.``: ``enorm``, ``hnorm``,
  ``eh_proj`` [H, 2H] over cat(enorm(embed(token)), hnorm(hidden)), a decoder layer
  (``input_layernorm``, ``self_attn``, ``mlp``, ``post_attention_layernorm``), ``shared_head.norm``
  (and optionally ``shared_head.head``; else the target's lm_head). Config: ``num_nextn_predict_layers``.
* MiMo style, at ``model.mtp_layers.{i}.``: ``token_layernorm``, ``hidden_layernorm``,
  ``input_proj`` [H, 2H] over cat(hidden_layernorm(hidden), token_layernorm(embed(token))), the
  decoder layer, ``final_layernorm``.

The hidden fed in is the target's final (post-norm) hidden state, then the layer's own output.
Only the NextN tensors are read (safetensors are opened lazily), never the whole target again.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from specfw.sdk import ConfigError, DraftDecoderLayer, RMSNorm, dummy_weights_

KEY = "speculative.draft_model_path"
FORMAT_KEY = "speculative.draft_load_format"
DEEPSEEK, MIMO = "deepseek", "mimo"


class MtpHead(nn.Module):
    def __init__(self, cfg, layout: str, has_head: bool, attn_bias: bool = False):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config, self.layout = cfg, layout
        self.embed_norm = RMSNorm(h, eps)  # enorm | token_layernorm
        self.hidden_norm = RMSNorm(h, eps)  # hnorm | hidden_layernorm
        self.proj = nn.Linear(2 * h, h, bias=False)  # eh_proj | input_proj
        self.input_layernorm = RMSNorm(h, eps)
        self.layer = DraftDecoderLayer(cfg, attn_bias=attn_bias)
        self.final_norm = RMSNorm(h, eps)  # shared_head.norm | final_layernorm
        self.head = nn.Linear(h, cfg.vocab_size, bias=False) if has_head else None

    def fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        e, h = self.embed_norm(embeds), self.hidden_norm(hidden)
        return self.proj(torch.cat([e, h] if self.layout == DEEPSEEK else [h, e], dim=-1))


def _names(layout: str, prefix: str, attn_bias: bool) -> dict[str, str]:
    """Checkpoint name of each MtpHead tensor."""
    layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "post_attention_layernorm.weight",
    ]
    if attn_bias:
        layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    common = {f"layer.{k}": k for k in layer}
    common["input_layernorm.weight"] = "input_layernorm.weight"
    if layout == DEEPSEEK:
        own = {
            "embed_norm.weight": "enorm.weight",
            "hidden_norm.weight": "hnorm.weight",
            "proj.weight": "eh_proj.weight",
            "final_norm.weight": "shared_head.norm.weight",
            "head.weight": "shared_head.head.weight",
        }
    else:
        own = {
            "embed_norm.weight": "token_layernorm.weight",
            "hidden_norm.weight": "hidden_layernorm.weight",
            "proj.weight": "input_proj.weight",
            "final_norm.weight": "final_layernorm.weight",
        }
    return {k: prefix + v for k, v in {**common, **own}.items()}


def find_mtp_layers(keys, num_hidden_layers: int) -> dict[int, tuple[str, str]]:
    """{mtp index: (layout, tensor-name prefix)} for the NextN layers among checkpoint ``keys``."""
    found = {}
    for k in keys:
        m = re.match(r"(?:model\.)?layers\.(\d+)\.eh_proj\.weight$", k)
        if m and int(m.group(1)) >= num_hidden_layers:
            found[int(m.group(1)) - num_hidden_layers] = (DEEPSEEK, k.removesuffix("eh_proj.weight"))
        m = re.match(r"(?:model\.)?mtp_layers\.(\d+)\.input_proj\.weight$", k)
        if m:
            found[int(m.group(1))] = (MIMO, k.removesuffix("input_proj.weight"))
    return found


def _open_tensors(path: Path, load_format: str = "auto") -> dict:
    """{tensor name: a callable reading it}: safetensors are opened lazily per tensor; PyTorch
    files (``pt``) are memory-mapped."""
    from safetensors import safe_open

    from specfw.sdk import load_state_dict

    files = sorted(path.glob("*.safetensors"))
    if load_format == "pt" or (load_format == "auto" and not files):
        state = load_state_dict(path, "pt" if load_format == "pt" else "auto", FORMAT_KEY)
        return {k: (lambda v=v: v) for k, v in state.items()}
    if not files:
        raise ConfigError(FORMAT_KEY, f"'{load_format}': {path} has no .safetensors files to read MTP layers from")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where[k] = f

    def reader(name, f):
        def read():
            with safe_open(str(f), framework="pt") as fh:
                return fh.get_tensor(name)

        return read

    return {k: reader(k, f) for k, f in where.items()}


def _dummy_layers(raw: dict, target_cfg) -> dict[int, tuple[str, str]]:
    """``draft_load_format=dummy``: the NextN layers the config announces (``num_nextn_predict_layers``,
    default 1) in the config's layout, with no tensor read."""
    n = int(raw.get("num_nextn_predict_layers") or getattr(target_cfg, "num_nextn_predict_layers", None) or 1)
    layout = MIMO if raw.get("model_type", getattr(target_cfg, "model_type", "")) == "mimo" else DEEPSEEK
    L = raw.get("num_hidden_layers", target_cfg.num_hidden_layers)
    return {i: (layout, f"model.layers.{L + i}." if layout == DEEPSEEK else f"model.mtp_layers.{i}.") for i in range(n)}


def mtp_layers(path: Path, target_cfg, load_format: str = "auto") -> dict[int, tuple[str, str]]:
    """{mtp index: (layout, prefix)} of the checkpoint at ``path`` (from its config for ``dummy``)."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if load_format == "dummy":
        return _dummy_layers(raw, target_cfg)
    return find_mtp_layers(_open_tensors(path, load_format), raw.get("num_hidden_layers", target_cfg.num_hidden_layers))


def load_mtp(path: Path, target_cfg, dtype: torch.dtype, index: int = 0, load_format: str = "auto") -> MtpHead:
    """The ``index``-th NextN layer of the checkpoint at ``path`` as an MtpHead. ``load_format``:
    as ``speculative.draft_load_format`` (``dummy``: random weights of the layout the config
    implies, no tensor read)."""
    raw = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    hidden = raw.get("hidden_size", target_cfg.hidden_size)
    if hidden != target_cfg.hidden_size:
        raise ConfigError(KEY, f"MTP checkpoint hidden_size {hidden} != target hidden_size {target_cfg.hidden_size}")
    if raw.get("vocab_size", target_cfg.vocab_size) != target_cfg.vocab_size:
        raise ConfigError(KEY, f"MTP checkpoint vocab_size {raw['vocab_size']} != target vocab_size {target_cfg.vocab_size}")
    where = {} if load_format == "dummy" else _open_tensors(path, load_format)
    layers = _dummy_layers(raw, target_cfg) if load_format == "dummy" else find_mtp_layers(where, raw.get("num_hidden_layers", target_cfg.num_hidden_layers))
    if not layers:
        raise ConfigError(
            KEY,
            f"{path} has no MTP/NextN layers (looked for model.layers.{{>=num_hidden_layers}}.eh_proj "
            "and model.mtp_layers.{i}.input_proj); give a checkpoint with them or pick another algorithm",
        )
    if index not in layers:
        raise ConfigError("speculative.mtp_layer", f"{index} is not one of the checkpoint's MTP layers {sorted(layers)}")
    layout, prefix = layers[index]
    attn_bias = (prefix + "self_attn.q_proj.bias" in where) if where else bool(getattr(target_cfg, "attention_bias", False))
    names = _names(layout, prefix, attn_bias)
    tensors = {}
    for own, name in names.items() if where else ():
        if name not in where:
            if own == "head.weight":
                continue
            raise ConfigError(KEY, f"MTP layer {prefix}* in {path} lacks tensor '{name}'")
        tensors[own] = where[name]()
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "rope_parameters",
        "max_position_embeddings",
    )
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: getattr(target_cfg, k) for k in keys if getattr(target_cfg, k, None) is not None})
    head = MtpHead(cfg, layout, "head.weight" in tensors, attn_bias)
    if load_format == "dummy":
        return dummy_weights_(head, prefix=prefix).to(dtype).eval().requires_grad_(False)
    own = head.state_dict()
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ConfigError(KEY, f"MTP tensor '{names[k]}' has shape {tuple(v.shape)}, the target needs {tuple(own[k].shape)}")
    head.load_state_dict(tensors)
    return head.to(dtype).eval().requires_grad_(False)

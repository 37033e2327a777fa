"""Resolve a model reference (demo / local HF dir / hub id / GGUF file) and load it into
specfw's lean Llama implementation, with its tokenizer."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .demo_model import cache_dir, convert_gguf, demo_model_dir
from .models.llama import LlamaModel

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MiMoForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: LlamaModel
    hf_config: object
    tokenizer: object
    path: Path


def resolve_model_path(ref: str | None, revision: str | None = None) -> Path:
    """``None``/"demo" → cached demo model; a .gguf file → converted cache; a directory → itself;
    anything else is treated as a Hugging Face hub id."""
    if ref in (None, "", "demo"):
        return demo_model_dir()
    p = Path(os.path.expanduser(ref))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"model.path: GGUF file not found: {p}")
        key = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"{p.stem}-{key}"
        if not (out / "specfw_converted.json").exists():
            convert_gguf(p, out)
        return out
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelLoadError(f"model.path: {p} has no config.json")
        return p
    if p.exists() or ref.startswith((".", "/")):
        raise ModelLoadError(f"model.path: {ref} is neither a model directory nor a .gguf file")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:  # offline, unknown id, ...
        raise ModelLoadError(f"model.path: could not fetch '{ref}' from the hub: {e}") from e


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path}")
    state = {}
    for f in tqdm(files, desc="loading weights", unit="shard", disable=len(files) < 2):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                state[name] = fh.get_tensor(name)
    return state


def _fuse_into(model: LlamaModel, state: dict[str, torch.Tensor]) -> None:
    def take(name):
        try:
            return state.pop(name)
        except KeyError:
            raise ModelLoadError(f"checkpoint is missing tensor '{name}'") from None

    p = "model."
    with torch.no_grad():
        model.embed_tokens.weight.copy_(take(p + "embed_tokens.weight"))
        model.norm.weight.copy_(take(p + "norm.weight"))
        lm = state.pop("lm_head.weight", None)
        model.lm_head.weight = model.embed_tokens.weight if lm is None else torch.nn.Parameter(lm.to(model.embed_tokens.weight.dtype))
        for i, layer in enumerate(tqdm(model.layers, desc="loading layers", unit="layer", leave=False, disable=None)):
            lp = f"{p}layers.{i}."
            qkv = [take(lp + f"self_attn.{n}_proj.weight") for n in "qkv"]
            layer.qkv_proj.weight.copy_(torch.cat(qkv, 0))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias.copy_(torch.cat([take(lp + f"self_attn.{n}_proj.bias") for n in "qkv"], 0))
            layer.o_proj.weight.copy_(take(lp + "self_attn.o_proj.weight"))
            layer.gate_up_proj.weight.copy_(torch.cat([take(lp + "mlp.gate_proj.weight"), take(lp + "mlp.up_proj.weight")], 0))
            layer.down_proj.weight.copy_(take(lp + "mlp.down_proj.weight"))
            layer.input_layernorm.weight.copy_(take(lp + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(lp + "post_attention_layernorm.weight"))
    mtp = [k for k in state if k.startswith(f"{p}mtp_layers.") or (k.startswith(f"{p}layers.") and int(k.split(".")[2]) >= len(model.layers))]
    if mtp:
        logger.info("%d MTP/NextN tensors left for speculative=mtp", len(mtp))
    leftover = [k for k in state if "rotary_emb" not in k and k not in set(mtp)]
    if leftover:
        logger.warning("ignored %d unexpected tensors, e.g. %s", len(leftover), leftover[:3])


def _attach_gguf(model: LlamaModel, cfg, path: Path) -> None:
    import json
    from .backends.quant_linear import attach_gguf_blocks

    meta = Path(path) / "specfw_converted.json"
    source = json.loads(meta.read_text()).get("source") if meta.exists() else None
    if not source or not Path(source).is_file():
        raise ModelLoadError(f"model.quantization: gguf needs a .gguf model.path (or the demo model); {path} was not converted from a GGUF file")
    n = attach_gguf_blocks(model, source, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    logger.info("gguf: %d linears keep the blocks of %s", n, Path(source).name)


def load_config(path: Path):
    """The target's transformers config. MiMo checkpoints (``model_type: mimo``, remote code in
    transformers) are Qwen2 plus MTP layers: their config loads as a Qwen2Config."""
    import json
    from transformers import AutoConfig, Qwen2Config

    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type") == "mimo":
        cfg = Qwen2Config(**{k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
        cfg.model_type = "mimo"
        return cfg
    return AutoConfig.from_pretrained(path)


def load_model(
    ref: str | None,
    dtype: str = "float32",
    revision: str | None = None,
    max_positions: int | None = None,
    device: str | torch.device = "cpu",
    quantization: str = "none",
) -> LoadedModel:
    """The model in ``dtype`` on ``device`` (weights are read on the host, then moved; tied
    embeddings stay tied), its config and tokenizer. ``quantization="gguf"``: the linears also
    get the source GGUF file's blocks (``gguf_weight``), which the CPU backend runs."""
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype: '{dtype}' is not one of {sorted(DTYPES)}")
    path = resolve_model_path(ref, revision)
    cfg = load_config(path)
    archs = set(getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])
    if not archs & SUPPORTED_ARCHS:
        raise ModelLoadError(f"model architecture {sorted(archs)} is not supported; supported: {sorted(SUPPORTED_ARCHS)}")
    if getattr(cfg, "model_type", "llama") in ("qwen2", "mimo"):  # MiMo = Qwen2 + MTP layers
        cfg.attention_bias = True
    tdtype = DTYPES[dtype]
    npos = max_positions or cfg.max_position_embeddings
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions=1, dtype=tdtype)
    model = model.to_empty(device="cpu").to(tdtype)
    model.rotary = type(model.rotary)(cfg, npos, tdtype)
    _fuse_into(model, load_state_dict(path))
    model.eval()
    if quantization == "gguf":
        _attach_gguf(model, cfg, path)
    if torch.device(device).type != "cpu":
        model.to(device)
        model.rotary.to(device)
    tok = AutoTokenizer.from_pretrained(path)
    tok.model_input_names = ["input_ids", "attention_mask"]
    return LoadedModel(model=model, hf_config=cfg, tokenizer=tok, path=path)

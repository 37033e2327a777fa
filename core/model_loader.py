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

from .config import DRAFT_LOAD_FORMATS, LOAD_FORMATS
from .demo_model import cache_dir, convert_gguf, demo_model_dir
from .models.llama import LlamaModel

logger = logging.getLogger(__name__)

SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MiMoForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PT_PATTERNS = ("*.bin", "*.pt")
PT_NOT_WEIGHTS = {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}  # trainer state, not weights
DUMMY_SEED = 1234  # SGLang's: dummy weights are the same in every process (and for a draft with the target's config)


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    model: LlamaModel
    hf_config: object
    tokenizer: object
    path: Path


def resolve_model_path(ref: str | None, revision: str | None = None, load_format: str = "auto") -> Path:
    """``None``/"demo" → cached demo model; a .gguf file → converted cache; a directory → itself;
    anything else is treated as a Hugging Face hub id. ``load_format="gguf"`` also takes a directory
    holding exactly one .gguf file; the other formats refuse a .gguf file (naming the key)."""
    if ref in (None, "", "demo"):
        return demo_model_dir()
    p = Path(os.path.expanduser(ref))
    if load_format == "gguf" and p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"model.load_format: 'gguf' needs model.path to be a .gguf file or a directory holding one; {p} holds {len(ggufs)}")
        p = ggufs[0]
    elif load_format == "gguf" and p.suffix != ".gguf":
        raise ModelLoadError(f"model.load_format: 'gguf' needs model.path to be a .gguf file or a directory holding one, got {ref}")
    if p.suffix == ".gguf" and load_format not in ("auto", "gguf"):
        raise ModelLoadError(f"model.load_format: '{load_format}' cannot read the GGUF file {p}; use one of ['auto', 'gguf'] for it")
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(f"model.path: GGUF file not found: {p}")
        key = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"{p.stem}-{key}"
        return convert_gguf(p, out)  # once: later calls find the conversion done
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


def draft_load_format(spec, model_cfg) -> str:
    """``speculative.draft_load_format``, null = as ``model.load_format`` (SGLang's rule; a GGUF
    target's drafts load as ``auto``)."""
    fmt = getattr(spec, "draft_load_format", None)
    if fmt is None:
        fmt = str(getattr(model_cfg, "load_format", "auto"))
        return "auto" if fmt == "gguf" else fmt
    return check_load_format(fmt, "speculative.draft_load_format", DRAFT_LOAD_FORMATS)


def check_load_format(value, key: str, allowed=LOAD_FORMATS) -> str:
    """``value`` as a load format, or ConfigError naming ``key`` and the allowed values."""
    from .config import ConfigError

    if str(value) not in allowed:
        raise ConfigError(key, f"'{value}' is not one of {list(allowed)}")
    return str(value)


def weight_files(path: Path, load_format: str = "auto", key: str = "model.load_format") -> list[Path]:
    """The checkpoint files ``load_format`` reads in ``path``: ``safetensors`` → *.safetensors,
    ``pt`` → PyTorch pickles (*.bin, *.pt, trainer state left out), ``auto`` → safetensors if any,
    else pt files. A format whose files are missing is an error naming ``key``."""
    st = sorted(path.glob("*.safetensors"))
    pt = sorted(f for pat in PT_PATTERNS for f in path.glob(pat) if f.name not in PT_NOT_WEIGHTS)
    files = {"safetensors": st, "pt": pt, "auto": st or pt}[load_format]
    if not files:
        what = {"safetensors": "*.safetensors files", "pt": "PyTorch weight files (*.bin, *.pt)", "auto": "weight files (*.safetensors, *.bin, *.pt)"}
        present = sorted(f.name for f in path.iterdir() if f.is_file())[:8] if path.is_dir() else []
        raise ModelLoadError(
            f"{key}: '{load_format}' finds no {what[load_format]} in {path} (it holds {present}); {key}=dummy loads random weights of its config instead"
        )
    return files


def load_state_dict(path: Path, load_format: str = "auto", key: str = "model.load_format") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``path``, read as ``load_format`` says (``weight_files``)."""
    from safetensors import safe_open

    files = weight_files(Path(path), load_format, key)
    state = {}
    for f in tqdm(files, desc="loading weights", unit="shard", disable=len(files) < 2):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    state[name] = fh.get_tensor(name)
            continue
        part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(part, dict) or not all(isinstance(v, torch.Tensor) for v in part.values()):
            raise ModelLoadError(f"{key}: {f} is not a state dict of tensors (name -> tensor)")
        state.update(part)
    return state


def dummy_weights_(module: torch.nn.Module, seed: int = DUMMY_SEED, prefix: str = "") -> torch.nn.Module:
    """``load_format=dummy``: every floating-point parameter uniform in [-1e-3, 1e-3] (SGLang's
    range), drawn from a generator seeded by ``seed`` and the parameter's name, so the values
    depend on neither load order nor process: two engines (or a draft with the target's config)
    get the same weights. ``prefix`` joins the names (modules of one class, e.g. a checkpoint's
    NextN layers, then differ). Buffers (rotary tables, vocabulary maps) keep their constructed values."""
    import zlib

    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.is_floating_point():
                g = torch.Generator().manual_seed(seed + zlib.crc32((prefix + name).encode()))
                p.uniform_(-1e-3, 1e-3, generator=g)
    return module


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


def gguf_source(path: Path) -> Path | None:
    """The GGUF file a model directory was converted from (specfw's conversion records it), if
    it is still there; None for any other directory."""
    import json

    meta = Path(path) / "specfw_converted.json"
    source = json.loads(meta.read_text()).get("source") if meta.exists() else None
    return Path(source) if source and Path(source).is_file() else None


def _attach_gguf(model: LlamaModel, cfg, path: Path) -> None:
    from .backends.quant_linear import attach_gguf_blocks

    source = gguf_source(path)
    if source is None:
        raise ModelLoadError(f"model.quantization: gguf needs a .gguf model.path (or the demo model); {path} was not converted from a GGUF file")
    n = attach_gguf_blocks(model, source, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    logger.info("gguf: %d linears keep the blocks of %s", n, Path(source).name)


def shipped_code(path: Path) -> dict[str, str]:
    """{Auto class: "module.Class"} for the code a model directory ships for the parts specfw lets
    transformers build (config and tokenizer; never the model: specfw's own code runs the weights).
    MiMo's config needs none (it loads as a Qwen2Config)."""
    import json

    found = {}
    for name in ("config.json", "tokenizer_config.json"):
        f = Path(path) / name
        raw = json.loads(f.read_text()) if f.is_file() else {}
        for auto, ref in (raw.get("auto_map") or {}).items():
            if auto == "AutoTokenizer" or (auto == "AutoConfig" and raw.get("model_type") != "mimo"):
                refs = [r for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if r]
                if refs and "--" not in refs[0]:  # "repo--module.Class": code from another hub repo
                    found[auto] = ", ".join(refs)
    return found


def check_remote_code(path: Path, trust_remote_code: bool) -> None:
    """Refuse a directory that ships config/tokenizer code unless ``model.trust_remote_code``: loading
    it runs that code (transformers would otherwise fall back to a built-in class silently)."""
    code = shipped_code(path)
    if code and not trust_remote_code:
        raise ModelLoadError(
            f"model.trust_remote_code: {path} ships its own code ({'; '.join(f'{k}: {v}' for k, v in code.items())}), "
            "which transformers runs to build its config/tokenizer; set model.trust_remote_code=true "
            "(SGLang's --trust-remote-code) if you trust it, or use a directory without auto_map"
        )


def load_config(path: Path, trust_remote_code: bool = False):
    """The target's transformers config. MiMo checkpoints (``model_type: mimo``, remote code in
    transformers) are Qwen2 plus MTP layers: their config loads as a Qwen2Config."""
    import json
    from transformers import AutoConfig, Qwen2Config

    raw = json.loads((Path(path) / "config.json").read_text())
    if raw.get("model_type") == "mimo":
        cfg = Qwen2Config(**{k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
        cfg.model_type = "mimo"
        return cfg
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_remote_code(path, trust_remote_code)
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tok.model_input_names = ["input_ids", "attention_mask"]
    return tok


def model_config(ref: str | None, revision: str | None = None, load_format: str = "auto", trust_remote_code: bool = False):
    """The model's directory and transformers config, without its weights (a GGUF source is
    converted on first use, so later loads find it in the cache)."""
    path = resolve_model_path(ref, revision, "auto" if load_format == "dummy" else load_format)
    check_remote_code(path, trust_remote_code)
    return path, load_config(path, trust_remote_code)


def load_model(
    ref: str | None,
    dtype: str = "float32",
    revision: str | None = None,
    max_positions: int | None = None,
    device: str | torch.device = "cpu",
    quantization: str = "none",
    load_format: str = "auto",
    trust_remote_code: bool = False,
    format_key: str = "model.load_format",
) -> LoadedModel:
    """The model in ``dtype`` on ``device`` (weights are read on the host, then moved; tied
    embeddings stay tied), its config and tokenizer. ``quantization="gguf"``: the linears also
    get the source GGUF file's blocks (``gguf_weight``), which the CPU backend runs.
    ``load_format``: ``LOAD_FORMATS`` (``dummy``: random weights of the config's shapes, no weight
    file read); ``trust_remote_code``: let transformers run config/tokenizer code the directory
    ships (``check_remote_code``)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype: '{dtype}' is not one of {sorted(DTYPES)}")
    check_load_format(load_format, format_key)
    if load_format == "dummy" and quantization == "gguf":
        raise ModelLoadError("model.quantization: 'gguf' reads the GGUF file's blocks; it cannot run with model.load_format=dummy (no weight file is read)")
    if load_format == "dummy" and ref not in (None, "", "demo") and Path(os.path.expanduser(ref)).suffix == ".gguf":
        raise ModelLoadError(f"{format_key}: 'dummy' needs a model directory with config.json, not the GGUF file {ref}")
    path, cfg = model_config(ref, revision, load_format, trust_remote_code)
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
    if load_format == "dummy":
        dummy_weights_(model)
        if getattr(cfg, "tie_word_embeddings", False):
            model.lm_head.weight = model.embed_tokens.weight
        logger.info("%s=dummy: random weights (uniform +-1e-3, seed %d), no weight file read", format_key, DUMMY_SEED)
    else:
        _fuse_into(model, load_state_dict(path, "auto" if load_format == "gguf" else load_format, format_key))
    model.eval()
    if quantization == "gguf":
        _attach_gguf(model, cfg, path)
    if torch.device(device).type != "cpu":
        model.to(device)
        model.rotary.to(device)
    tok = load_tokenizer(path, trust_remote_code)
    return LoadedModel(model=model, hf_config=cfg, tokenizer=tok, path=path)

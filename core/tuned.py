"""Tuned defaults: the tree keys ``specfw tune`` measured best, per model, machine, algorithm and
batch-size bucket, in a JSON file outside the repository; ``specfw serve`` applies them when none
of the tree keys was given.

Layout: ``<dir>/<machine>/<model>.json`` = ``{"model": ..., "machine": ..., "algorithms": {name:
{"buckets": {"1": {num_steps, topk, num_draft_tokens, adaptive_draft, tok_s, auto_tok_s, keys, ...}}}}}``
(``keys``: the algorithm's own keys the grid varied, e.g. ngram's ``match_type``);
``<dir>`` is ``tuned.dir``, else ``$SPECFW_TUNED_DIR``, else ``<cache>/tuned``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

logger = logging.getLogger("specfw")

TREE_KEYS = ("num_steps", "topk", "num_draft_tokens", "adaptive_draft", "draft_assist", "draft_model_quantization")


@dataclass
class TunedEntry:
    """The best grid point of one batch-size bucket, with what it was measured at."""

    num_steps: Optional[int]
    topk: Optional[int]
    num_draft_tokens: Optional[int]
    adaptive_draft: str
    draft_assist: Optional[str] = None  # speculative.draft_assist (files written before it existed: none)
    draft_model_quantization: Optional[str] = None  # speculative.draft_model_quantization (files written before it existed: null)
    tok_s: float = 0.0  # on the tuning prompts, at the bucket's concurrency
    auto_tok_s: Optional[float] = None  # the auto defaults on the same prompts (None: not measured)
    measured: dict = field(default_factory=dict)  # prompts, max_new_tokens, grid size, time
    keys: dict = field(default_factory=dict)  # the algorithm's own keys the grid varied (ngram: match_type; files written before: none)

    def overrides(self) -> dict:
        return {**{k: getattr(self, k) for k in TREE_KEYS}, **self.keys}


def tuned_dir(configured: str | None = None) -> Path:
    if configured:
        return Path(configured)
    if os.environ.get("SPECFW_TUNED_DIR"):
        return Path(os.environ["SPECFW_TUNED_DIR"])
    from .demo_model import cache_dir

    return cache_dir() / "tuned"


def machine_key(cfg) -> str:
    """The device the engine will run on: the GPU's name, or the CPU's model name, its ISA flags
    that matter to the kernels, and the thread count."""
    from .device import resolve_device

    device = resolve_device(str(getattr(cfg.model, "device", "auto")))
    if device.type == "cuda":
        import torch

        return f"cuda {torch.cuda.get_device_name(device)}"
    import torch

    from .machine import _FLAGS_OF_INTEREST, _cpuinfo

    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    threads = cfg.engine.num_threads or torch.get_num_threads()
    isa = str(getattr(cfg.engine, "cpu_isa", "auto"))
    return f"{info.get('model name', 'cpu')} {'+'.join(f for f in _FLAGS_OF_INTEREST if f in flags)} t{threads} isa-{isa}"


def model_key(cfg) -> str:
    """The target as configured: path (demo when null), dtype, quantization."""
    m = cfg.model
    dtype = str(getattr(m.dtype, "value", m.dtype))
    parts = [str(m.path or "demo"), dtype, str(getattr(m, "quantization", "none")), str(getattr(m, "activation_quantization", "none"))]
    return " ".join(parts)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_")[:120]


def tuned_file(cfg) -> Path:
    tuned = getattr(cfg, "tuned", None)
    return tuned_dir(tuned.dir if tuned is not None else None) / _slug(machine_key(cfg)) / f"{_slug(model_key(cfg))}.json"


def read(cfg) -> dict:
    path = tuned_file(cfg)
    return json.loads(path.read_text()) if path.exists() else {}


def write_entry(cfg, algorithm: str, bucket: int, entry: TunedEntry) -> Path:
    """Record ``entry`` as the best setting of ``algorithm`` at batch-size bucket ``bucket``."""
    path = tuned_file(cfg)
    data = read(cfg) or {"model": model_key(cfg), "machine": machine_key(cfg), "algorithms": {}}
    data["algorithms"].setdefault(algorithm, {"buckets": {}})["buckets"][str(bucket)] = asdict(entry)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
    return path


def lookup(cfg, algorithm: str, batch_size: int) -> tuple[int, TunedEntry] | None:
    """The entry of the largest tuned bucket <= ``batch_size`` (else the smallest bucket)."""
    buckets = read(cfg).get("algorithms", {}).get(algorithm, {}).get("buckets", {})
    if not buckets:
        return None
    sizes = sorted(int(b) for b in buckets)
    chosen = max((b for b in sizes if b <= batch_size), default=sizes[0])
    return chosen, TunedEntry(**buckets[str(chosen)])


def given_tree_keys(cfg, extra: tuple[str, ...] = ()) -> list[str]:
    """Tree keys (and the ``extra`` keys: a tuned entry's own) given on the command line (Hydra's
    task overrides), or set away from their defaults when there is no Hydra run (a config built
    in code)."""
    from hydra.core.hydra_config import HydraConfig

    keys = (*TREE_KEYS, *extra)
    if HydraConfig.initialized():
        names = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]
        return [k for k in keys if f"speculative.{k}" in names]
    spec = cfg.speculative
    defaults = _schema_defaults(spec, keys)
    return [k for k in keys if _plain(spec.get(k)) != _plain(defaults.get(k))]


def _plain(value):
    """An enum member as its value (``MatchType.BFS`` -> ``"BFS"``), anything else as is."""
    return getattr(value, "value", value)


def _schema_defaults(spec, keys: tuple[str, ...] = TREE_KEYS) -> dict:
    """The algorithm's own defaults of the tree keys (EAGLE-3's ``draft_model_quantization`` is
    ``auto``; every algorithm's ``adaptive_draft`` is ``auto``, the rest null)."""
    import dataclasses

    from omegaconf import OmegaConf

    schema = OmegaConf.get_type(spec) if OmegaConf.is_config(spec) else type(spec)
    fields = {f.name: f.default for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}
    return {k: fields.get(k, "auto" if k == "adaptive_draft" else None) for k in keys}


def apply_tuned(cfg) -> str | None:
    """Set the tuned tree keys on ``cfg.speculative`` (in place) when tuned defaults exist for this
    model, machine and algorithm and none of the tree keys was given; returns the log line, or
    None when nothing was applied."""
    tuned = getattr(cfg, "tuned", None)
    algorithm = str(cfg.speculative.get("algorithm", "none"))
    if tuned is None or not tuned.use or algorithm == "none":
        return None
    found = lookup(cfg, algorithm, int(tuned.batch_size))
    if found is None:
        return None
    bucket, entry = found
    if given_tree_keys(cfg, tuple(entry.keys)):
        return None
    from .overlap import overlap_requested

    if overlap_requested(cfg) and entry.topk not in (None, 1):
        return None  # the overlap scheduler takes chains only; its auto shape is a chain
    for k, v in entry.overrides().items():
        cfg.speculative[k] = v
    shown = ", ".join(f"{k}={v}" for k, v in entry.overrides().items() if v is not None)
    return (
        f"tuned defaults applied for speculative={algorithm} (batch-size bucket {bucket}): {shown} "
        f"(measured {entry.tok_s:.1f} tok/s" + (f" vs {entry.auto_tok_s:.1f} with the auto defaults" if entry.auto_tok_s else "") + f"; {tuned_file(cfg)})"
    )

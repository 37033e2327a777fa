"""FR-Spec token maps (``speculative.token_map``): the target token ids a draft's lm_head is
restricted to, so each draft step scores a frequent subset of the vocabulary (its lm_head reads
that share of the bytes) and ``beam_search`` maps the chosen indices back (``to_target``).

A committed demo draft may ship one (``token_map.pt`` beside it, made by
``scripts/make_token_map.py``): ``resolve_token_map`` applies it when the key is null and the
demo draft is in use; ``full`` always means the whole vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError

FULL = "full"


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """Sorted unique target ids from a ``.pt`` tensor (or list) of ids, all in ``[0, vocab_size)``."""
    ids = torch.load(path, map_location="cpu", weights_only=True)
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ConfigError("speculative.token_map", f"{path}: token ids must be in [0, {vocab_size})")
    return torch.unique(ids)


def resolve_token_map(configured: str | None, demo_draft_dir: Path | None) -> str | None:
    """The map file to use: the configured one; with none configured, the committed demo
    draft's (``demo_draft_dir`` is its directory when the demo draft serves); ``full``: none."""
    if configured is None and demo_draft_dir is not None and (Path(demo_draft_dir) / "token_map.pt").exists():
        return str(Path(demo_draft_dir) / "token_map.pt")
    return None if configured == FULL else configured


def restricted_lm_head(weight: torch.Tensor, ids: torch.Tensor) -> torch.nn.Linear:
    """An lm_head (no bias) scoring only target ids ``ids``: ``weight``'s rows, in that order."""
    w = weight.detach()
    out = torch.nn.Linear(w.shape[1], len(ids), bias=False, dtype=w.dtype, device=w.device)
    out.weight = torch.nn.Parameter(w.index_select(0, ids.to(w.device)), requires_grad=False)
    return out

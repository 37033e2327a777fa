"""``speculative=eagle3`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.spec.config import SpecAlgoConfig


@dataclass
class Eagle3Config(SpecAlgoConfig):
    token_map: Optional[str] = None        # FR-Spec token map: ignored for EAGLE-3 (its draft vocab is d2t)
    draft_kv_tokens: Optional[int] = None  # draft KV pool size in tokens; null = same as the target's pool
    aux_layers: Optional[list[int]] = None  # target layers whose *input* is tapped; null = draft config or (2, L//2, L-3)

"""``speculative=eagle`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.spec.config import SpecAlgoConfig


@dataclass
class EagleConfig(SpecAlgoConfig):
    token_map: Optional[str] = None        # FR-Spec: .pt file of target token ids the draft lm_head is restricted to
    draft_kv_tokens: Optional[int] = None  # draft KV pool size in tokens; null = same as the target's pool

"""``speculative=eagle`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.sdk import DraftTrainConfig, SpecAlgoConfig


@dataclass
class EagleConfig(SpecAlgoConfig):
    token_map: Optional[str] = None        # FR-Spec: .pt file of target token ids the draft lm_head is restricted to; null = the committed demo draft's map (8,192 ids) with that draft, else the full vocabulary; full = the full vocabulary
    draft_kv_tokens: Optional[int] = None  # draft KV pool size in tokens; null = same as the target's pool


@dataclass
class EagleTrainConfig(DraftTrainConfig):
    """``specfw train draft=eagle`` options."""
    kind: str = "eagle"
    feature_weight: float = 1.0               # SmoothL1 on the predicted feature
    token_weight: float = 0.1                 # cross-entropy of the target's lm_head on the predicted feature
    noise_std: float = 0.2                    # uniform noise on input features (EAGLE's robustness trick)

"""``speculative=mtp`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.sdk import ConfigError, DraftTrainConfig, SpecAlgoConfig, TreeShape


@dataclass
class MtpConfig(SpecAlgoConfig):
    # draft_model_path: null = the target checkpoint itself (its built-in NextN layers); or a
    # NextN-only checkpoint holding the same tensor names (as published for DeepSeek-V3/R1).
    mtp_layer: int = 0                     # which NextN layer drafts (each step reuses it, as SGLang does); with multi_layer, the first of the layers
    multi_layer: bool = False              # SGLang's --enable-multi-layer-eagle: NextN layer mtp_layer+i drafts chain step i (each with its own KV), for checkpoints with several NextN layers; topk=1 only, num_steps <= the layers
    draft_kv_tokens: Optional[int] = None  # draft KV pool size in tokens; null = same as the target's pool
    token_map: Optional[str] = None        # FR-Spec: .pt file of target token ids the NextN lm_head is restricted to; null = the committed demo layer's map (8,192 ids) with that layer, else the full vocabulary; full = the full vocabulary; not with multi_layer

    def validate(self) -> None:
        super().validate()
        if self.multi_layer and self.token_map not in (None, "full"):
            raise ConfigError("speculative.token_map", "speculative.multi_layer drafts over the full vocabulary: token_map must be null or full")
        if self.mtp_layer < 0:
            raise ConfigError("speculative.mtp_layer", f"must be >= 0, got {self.mtp_layer}")
        if self.multi_layer and self.topk not in (None, 1):
            raise ConfigError("speculative.topk", f"speculative.multi_layer drafts a chain (one token per NextN layer): topk must be 1, got {self.topk}")

    def auto_shape(self, target_arch: str) -> TreeShape:
        """A chain of 3 (SGLang's recommendation for DeepSeek MTP): one NextN layer reused per step."""
        return TreeShape(3, 1, 4)


@dataclass
class MtpTrainConfig(DraftTrainConfig):
    """``specfw train draft=mtp`` options."""
    kind: str = "mtp"                         # one DeepSeek-style NextN layer, exported as a NextN-only checkpoint
    ttt_steps: int = 3                        # unroll depth: the layer is reused for this many chain steps
    ttt_decay: float = 0.8                    # loss weight of unroll step j is decay**j

    @staticmethod
    def check(draft) -> None:
        if draft.ttt_steps < 1:
            raise ConfigError("draft.ttt_steps", f"must be >= 1, got {draft.ttt_steps}")

"""``speculative=eagle3`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from specfw.sdk import ConfigError, DraftTrainConfig, SpecAlgoConfig


@dataclass
class Eagle3Config(SpecAlgoConfig):
    # adaptive_draft=auto turns the draft policy on only where verifying the tree costs more than 1.5x
    # a row: on a Zen 4 EPYC at one request (the (5, 4, 8) tree's probe 0.9-1.36x) the fixed tree
    # decoded MT-bench 1.00-1.15x faster than the policy (fp32 and bf16, four runs: a tie at worst), which spent ~5% of steps plain
    # (exploring) and pruned accepted nodes; at 8 requests the probe measures ~4.5x and the policy
    # stays on (docs/benchmarks.md, session 61)
    adaptive_grows_above: ClassVar[float] = 1.5

    token_map: Optional[str] = None        # FR-Spec token map: ignored for EAGLE-3 (its draft vocab is d2t)
    draft_kv_tokens: Optional[int] = None  # draft KV pool size in tokens; null = same as the target's pool
    aux_layers: Optional[list[int]] = None  # target layers whose *input* is tapped; null = draft config or (2, L//2, L-3)
    draft_model_quantization: Optional[str] = "auto"  # auto: int8 weights and activations for the head on the avx512 kernels of a CPU with AVX512-VNNI or on the avx2 kernels (an unquantized target), else null; every value of speculative.draft_model_quantization applies


@dataclass
class Eagle3TrainConfig(DraftTrainConfig):
    """``specfw train draft=eagle3`` options."""
    kind: str = "eagle3"
    draft_vocab_size: int = 8192              # most frequent target tokens kept in the draft lm_head (d2t)
    ttt_steps: int = 4                        # training-time-test unroll depth
    ttt_decay: float = 0.8                    # loss weight of unroll step j is decay**j
    aux_layers: Optional[list[int]] = None    # target taps (layer inputs); null = (2, L//2, L-3)

    @staticmethod
    def check(draft) -> None:
        if draft.ttt_steps < 1:
            raise ConfigError("draft.ttt_steps", f"must be >= 1, got {draft.ttt_steps}")

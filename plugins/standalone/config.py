"""``speculative=standalone`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.sdk import ConfigError, DraftTrainConfig, SpecAlgoConfig, TreeShape


SELF_DRAFT = "target"  # the draft_model_path value that names the target's own checkpoint
DRAFT_LM_HEADS = ("auto", "full", "proxy")
SELF_DRAFT_GROWS_ABOVE = 1.5  # adaptive_draft=auto's threshold for the self-draft (StandaloneConfig.grows_above)


@dataclass
class StandaloneConfig(SpecAlgoConfig):
    draft_model_path: Optional[str] = None  # draft weights (HF dir / hub id); null = the committed demo draft for the demo target; target = the target's own checkpoint, quantized by draft_model_quantization (gguf or w8a8_int8), drafting on the target's KV cache (self-speculation; its auto shape is a chain of 5, (5, 1, 6))
    draft_kv_tokens: Optional[int] = None   # draft KV pool size in tokens; null = same as the target's pool
    sample_draft: bool = True               # topk=1 + sampled requests: sample drafts and verify by rejection sampling
    draft_lm_head: str = "auto"             # auto | full | proxy: proxy = the draft's 8-bit lm_head read as a 4-bit copy, its best candidates rescored on the 8-bit codes (core/backends/proxy_head.py); auto = proxy for a self-draft on GGUF blocks, else full
    token_map: Optional[str] = None         # FR-Spec: .pt file of target token ids the draft's lm_head is restricted to; null = the committed demo draft's map (8,192 ids) with that draft, else the full vocabulary; full = the full vocabulary

    def auto_shape(self, target_arch: str) -> TreeShape:
        """SGLang's STANDALONE auto default: (num_steps, topk, num_draft_tokens) = (3, 1, 4). A
        self-draft (``draft_model_path=target``, specfw's own) gets a chain of 5, (5, 1, 6): it
        agrees with the target on ~0.97 of its tokens, so a longer chain pays (MT-bench 1-80 x 64:
        1.58x plain against 1.52x with (3, 1, 4); 1-40 x 64: 1.47x against 1.41x; docs/benchmarks.md)."""
        if self.draft_model_path == SELF_DRAFT:
            return TreeShape(5, 1, 6)
        return TreeShape(3, 1, 4)

    def grows_above(self) -> float:
        """The self-draft's ``adaptive_draft=auto`` threshold is EAGLE-3's, 1.5: its chain is accepted
        ~95% a node, and where one request's six rows verify near-flat (1.18x a row on an AVX2 Zen 3)
        the fixed chain decoded MT-bench 1-80 x 64 at 1.474x plain against the policy's 1.359x (1-40:
        1.423x / 1.285x, 1.425x / 1.372x; docs/benchmarks.md, session 69): the policy's calibration
        starts from the draft's own probabilities, which a self-draft's flat softmax puts far below
        its acceptance, and cut its chains to ~3 tokens for many answers. At 8 requests the probe
        measures far above 1.5 and the policy stays on."""
        return SELF_DRAFT_GROWS_ABOVE if self.draft_model_path == SELF_DRAFT else super().grows_above()

    def validate(self) -> None:
        super().validate()
        if self.draft_lm_head not in DRAFT_LM_HEADS:
            raise ConfigError("speculative.draft_lm_head", f"'{self.draft_lm_head}' is not one of {list(DRAFT_LM_HEADS)}")
        if self.draft_kv_tokens is not None and self.draft_kv_tokens < 1:
            raise ConfigError("speculative.draft_kv_tokens", f"must be >= 1, got {self.draft_kv_tokens}")


@dataclass
class StandaloneTrainConfig(DraftTrainConfig):
    """``specfw train draft=standalone`` options."""
    kind: str = "standalone"
    num_layers: int = 4                       # draft depth
    hidden_size: int = 256                    # narrow: keeps the checkpoint small
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    temperature: float = 1.0                  # distillation temperature (KL to the target)

    @staticmethod
    def check(draft) -> None:
        if not 1 <= draft.num_layers <= 8:
            raise ConfigError("draft.num_layers", f"must be in 1..8, got {draft.num_layers}")

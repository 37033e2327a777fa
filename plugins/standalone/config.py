"""``speculative=standalone`` options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specfw.config import ConfigError
from specfw.spec.config import SpecAlgoConfig, TreeShape


@dataclass
class StandaloneConfig(SpecAlgoConfig):
    draft_kv_tokens: Optional[int] = None   # draft KV pool size in tokens; null = same as the target's pool
    sample_draft: bool = True               # topk=1 + sampled requests: sample drafts and verify by rejection sampling

    def auto_shape(self, target_arch: str) -> TreeShape:
        """SGLang's STANDALONE auto default: (num_steps, topk, num_draft_tokens) = (3, 1, 4)."""
        return TreeShape(3, 1, 4)

    def validate(self) -> None:
        super().validate()
        if self.draft_kv_tokens is not None and self.draft_kv_tokens < 1:
            raise ConfigError("speculative.draft_kv_tokens", f"must be >= 1, got {self.draft_kv_tokens}")

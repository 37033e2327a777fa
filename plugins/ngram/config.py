"""``speculative=ngram`` options (SGLang's NGRAM parameter names and defaults)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

from specfw.sdk import ConfigError, SpecAlgoConfig, TreeShape


class MatchType(str, enum.Enum):
    BFS = "BFS"
    PROB = "PROB"


@dataclass
class NgramConfig(SpecAlgoConfig):
    min_match_window_size: int = 1      # shortest context suffix to match
    max_match_window_size: int = 12     # longest context suffix to match
    min_bfs_breadth: int = 1            # BFS breadth for the longest matches
    max_bfs_breadth: int = 10           # BFS breadth for the shortest matches
    match_type: MatchType = MatchType.BFS  # BFS (recency) or PROB (frequency-weighted best-first)
    branch_length: int = 18             # tokens of each window inserted into the trie
    capacity: int = 10_000_000          # trie nodes kept (LRU eviction beyond)

    unused_keys = ("draft_model_path", "draft_model_revision", "draft_model_quantization", "draft_load_format", "draft_attention_backend", "num_steps", "topk")  # no draft model; the trie shapes the tree
    tune_grid = {"match_type": ("BFS", "PROB")}  # specfw tune tries both (HumanEval on a Zen 4 EPYC: PROB with 8 nodes 1.986x, the best point; docs/benchmarks.md)

    def resolve_shape(self, target_arch: str) -> TreeShape:
        """Tree size = num_draft_tokens (default: max_match_window_size); depth and breadth follow
        the trie, so num_steps / topk are not used by ngram."""
        for k in ("min_match_window_size", "max_match_window_size", "min_bfs_breadth", "max_bfs_breadth",
                  "branch_length", "capacity"):
            if getattr(self, k) < 1:
                raise ConfigError(f"speculative.{k}", f"must be >= 1, got {getattr(self, k)}")
        if self.min_match_window_size > self.max_match_window_size:
            raise ConfigError("speculative.min_match_window_size",
                              f"{self.min_match_window_size} > max_match_window_size={self.max_match_window_size}")
        if self.min_bfs_breadth > self.max_bfs_breadth:
            raise ConfigError("speculative.min_bfs_breadth", f"{self.min_bfs_breadth} > max_bfs_breadth={self.max_bfs_breadth}")
        for k in ("num_steps", "topk"):
            if getattr(self, k) is not None:
                raise ConfigError(f"speculative.{k}", "is not used by ngram (the tree follows the n-gram trie); "
                                  "set speculative.num_draft_tokens and the match/bfs options instead")
        n = self.num_draft_tokens if self.num_draft_tokens is not None else self.max_match_window_size
        if n < 2:
            raise ConfigError("speculative.num_draft_tokens", f"must be >= 2 (root + one draft token), got {n}")
        return TreeShape(num_steps=n - 1, topk=self.max_bfs_breadth, num_draft_tokens=n)

"""Typed objects passed between the speculative stages (draft → tree → verify → commit)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..step import StepResult, VerifyResult  # noqa: F401  (re-exported: the verify hook's result type)
from .config import SpecAlgoConfig, TreeShape

if TYPE_CHECKING:  # annotations only: the context is built by the core, read by plugins
    from transformers import PreTrainedTokenizerBase

    from ..config import EngineConfig
    from ..model_runner import ModelRunner
    from ..stats import EngineStats


@dataclass
class SpecContext:
    """Engine-wide state shared by the hooks of one engine; it does not change from step to step
    (a step's own inputs come as arguments: the batch's requests, the :class:`StepPlan`)."""

    config: SpecAlgoConfig  # the algorithm's validated config (the plugin's own dataclass)
    shape: TreeShape  # num_steps, topk, num_draft_tokens after the auto / validation rules
    runner: "ModelRunner"  # the target: model, hf_config, device, kv pool, allocator, backend
    tokenizer: "PreTrainedTokenizerBase"
    engine_config: "EngineConfig"  # the engine.* keys
    stats: "EngineStats"  # counters (read-only for plugins)
    target_path: Path | None = None  # the target's resolved checkpoint directory (MTP reads its NextN layers)
    capture_layers: tuple[int, ...] = ()  # target layers whose input hidden states the drafter needs
    force_greedy: bool = False


@dataclass(frozen=True)
class StepPlan:
    """What this decode step drafts and verifies, decided by the draft policy
    (``speculative/policy.py``) before drafting and passed to ``specfw_draft`` and ``specfw_build_tree``.

    ``size``: tree nodes (root included) the step verifies at most; 1 means no draft this step
    (``specfw_draft`` is not called). ``depth``: the useful draft depth,
    ``min(num_steps, size - 1)``. ``score_floor``: candidates scoring below it are pruned this
    step (confidence pruning), so beams below it need not be expanded (-inf: none are)."""

    size: int
    depth: int
    score_floor: float = float("-inf")
    cut: Any = None  # the policy's own cut of the candidates (speculative/confidence.py Cut)

    @property
    def drafts(self) -> bool:
        return self.size > 1


_NO_TOKENS, _NO_SCORES = torch.empty(0, dtype=torch.long), torch.empty(0)


@dataclass
class DraftCandidates:
    """A drafter's proposal for one request: a tree of candidates under the root.

    Candidates are listed parents-first; ``parents[i]`` indexes an earlier candidate or is -1
    (child of the root, the request's last sampled token). ``scores`` rank candidates for the
    tree builder (higher is better; EAGLE uses cumulative log-probabilities).
    ``draft_probs`` (optional, ``[n, vocab]``) is the draft distribution candidate i was
    sampled from; with a chain it enables lossless rejection sampling for sampled requests.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> "DraftCandidates":
        # shared zero-length tensors (nothing can be written into them): a plain-played step of 8
        # requests made 24 allocations for these
        return cls(_NO_TOKENS, _NO_TOKENS, _NO_SCORES)

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: torch.Tensor | None = None) -> "DraftCandidates":
        n = len(tokens)
        return cls(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long), -torch.arange(n, dtype=torch.float32), draft_probs)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def best(self, n: int) -> "DraftCandidates":
        """The ``n`` best candidates by score, closed under ancestors (parents re-indexed)."""
        if len(self) <= n:
            return self
        from .tree import select_candidates

        # on lists, new tensors made from them (the same values: float32 scores round-trip exactly)
        old_parents, scores, tokens = self.parents.tolist(), self.scores.tolist(), self.tokens.tolist()
        keep = select_candidates(self, n, scores, old_parents)
        remap = {old: new for new, old in enumerate(keep)}
        parents = [remap[old_parents[i]] if old_parents[i] >= 0 else -1 for i in keep]
        return DraftCandidates(
            torch.tensor([tokens[i] for i in keep], dtype=self.tokens.dtype, device=self.tokens.device),
            torch.tensor(parents, dtype=torch.long, device=self.parents.device),
            torch.tensor([scores[i] for i in keep], dtype=self.scores.dtype, device=self.scores.device),
            None if self.draft_probs is None else self.draft_probs[keep],
        )


@dataclass
class DraftTree:
    """The tree the target verifies. Node 0 is the root (the last sampled token, no KV yet).

    ``mask[i, j]`` is True when node j is node i itself or one of its ancestors.
    ``retrieve_next_token[i]`` is i's first child, ``retrieve_next_sibling[i]`` its next sibling
    (-1 when none): walking them visits children in candidate (score) order.
    """

    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N], -1 for the root
    depth: torch.Tensor  # [N]
    mask: torch.Tensor  # [N, N] bool
    retrieve_next_token: torch.Tensor  # [N]
    retrieve_next_sibling: torch.Tensor  # [N]
    draft_probs: torch.Tensor | None = None  # [N-1, V], node i+1's draft distribution

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def children(self, node: int) -> list[int]:
        out, c = [], int(self.retrieve_next_token[node])
        while c >= 0:
            out.append(c)
            c = int(self.retrieve_next_sibling[c])
        return out

    @property
    def is_chain(self) -> bool:
        return bool((self.parents[1:] == torch.arange(len(self) - 1)).all())

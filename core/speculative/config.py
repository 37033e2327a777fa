"""The common schema of speculative algorithms (SGLang's names) and its startup rules.

Tree shape (``num_steps``, ``topk``, ``num_draft_tokens``): leave all three unset for the
algorithm's auto defaults, or set all three. Exception (decided for specfw): ``topk=1`` alone
or with ``num_steps`` is complete, because a chain's size follows from its depth
(``num_draft_tokens = num_steps + 1``). Impossible shapes are rejected naming the keys.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import ClassVar, Optional

from ..config import ConfigError, SpeculativeConfig

logger = logging.getLogger(__name__)

# ``adaptive_draft=auto``'s default threshold (SpecAlgoConfig.adaptive_grows_above): was 1.15 until
# session 18, where on a fp32 EPYC (8 rows ~1.1-1.2x one row) the probe came out on or off from run
# to run, and every specfw tune there found the policy on as fast or faster (eagle3 +9% on held-out
# MT-bench, ngram +10% on HumanEval); a GPU's launch-bound verify stays below 1.05. Session 62 (Zen 4,
# fp32, batch 1) kept it for eagle (its fixed tree against the policy: 1.08x, 0.90x, 1.00x in three
# runs) and mtp (the policy as fast or faster in all three) (docs/benchmarks.md).
ADAPTIVE_GROWS_ABOVE = 1.05


class AttentionMode(str, enum.Enum):
    prefill = "prefill"
    decode = "decode"


@dataclass(frozen=True)
class TreeShape:
    num_steps: int
    topk: int
    num_draft_tokens: int


def max_draft_candidates(num_steps: int, topk: int) -> int:
    """Draft tokens an EAGLE-2 tree search offers for the rerank, as SGLang's: ``topk`` children of
    the root, then ``topk`` children of each of the ``topk`` beams per later step."""
    return topk + (num_steps - 1) * topk * topk


@dataclass
class SpecAlgoConfig(SpeculativeConfig):
    draft_model_path: Optional[str] = None      # draft weights (HF dir / hub id); algorithm-specific default
    draft_model_revision: Optional[str] = None  # hub revision of the draft ("main" when a hub id is given)
    draft_load_format: Optional[str] = None     # null (as model.load_format) | auto | safetensors | pt | dummy (random draft weights of its config: benchmarking); SGLang's --speculative-draft-load-format
    num_steps: Optional[int] = None             # draft depth; null = auto (see docs)
    topk: Optional[int] = None                  # branching per step (SGLang speculative_eagle_topk); null = auto
    num_draft_tokens: Optional[int] = None      # tree size incl. root; null = auto
    accept_threshold_single: float = 1.0        # accept a draft token if p_target >= this (1.0 = lossless)
    accept_threshold_acc: float = 1.0           # accept if coin <= accumulated p_target / this (1.0 = lossless)
    draft_attention_backend: Optional[str] = None  # null (as model.attention_backend) | auto | torch | triton | flashinfer: the drafter's attention (SGLang's --speculative-draft-attention-backend)
    attention_mode: AttentionMode = AttentionMode.prefill  # SGLang compat: verify/extend kernel choice; specfw has one attention path, same result
    adaptive_draft: str = "auto"               # auto | true | false: per step, draft or not and the tree size to verify, from measured tokens/s (tree flags become upper bounds); auto = on where a verify of num_draft_tokens rows a request costs more than the algorithm's threshold (1.05x one row; eagle3 1.5x) (measured at startup with min(engine.max_running_requests, 8) requests: CPUs), off where flat and always on CUDA devices (SGLang's behaviour)
    confidence_pruning: bool = True             # with adaptive_draft: per step, drop draft nodes whose learned acceptance probability is below tokens/s x seconds per verified node
    force_greedy_verify: bool = False           # verify greedily even for sampled requests (also SPECFW_FORCE_GREEDY_VERIFY=1)
    draft_assist: Optional[str] = None          # null | ngram | any registered draft assist: extra candidates merged into the drafter's tree every drafted step (e.g. the n-gram trie's continuation of the context beside an EAGLE head)

    # Inherited keys this algorithm does not read (e.g. draft_model_path for a drafter without a
    # model). Giving one a value other than its default is an error naming the key (a specfw
    # decision: silently ignoring a path the user typed hides a mistake).
    unused_keys: ClassVar[tuple[str, ...]] = ()

    # Grid values ``specfw tune`` tries by default for keys of this algorithm's own (beyond the tree
    # keys every algorithm has), e.g. ngram's ``{"match_type": ("BFS", "PROB")}``; ``tune.keys``
    # replaces a key's values or adds keys. Values are the strings a command line would give.
    tune_grid: ClassVar[dict[str, tuple]] = {}

    # ``adaptive_draft=auto``'s threshold for this algorithm: the draft policy is on where the startup
    # probe finds a verify of ``num_draft_tokens`` rows a request costing more than this times one
    # row (``speculative/verify_cost.py``). The policy prunes and sizes trees for what they cost; where
    # the configured tree is near-flat its exploring plain steps and pruned nodes cost a drafter whose
    # trees verify well more than they save (EAGLE-3 sets 1.5: docs/benchmarks.md, session 61).
    adaptive_grows_above: ClassVar[float] = ADAPTIVE_GROWS_ABOVE

    def grows_above(self) -> float:
        """This config's ``adaptive_draft=auto`` threshold: the class's ``adaptive_grows_above``, or
        what a variant of the algorithm needs (the standalone self-draft's 1.5)."""
        return type(self).adaptive_grows_above

    def auto_shape(self, target_arch: str) -> TreeShape:
        """SGLang's auto defaults: Llama/Grok (5, 4, 8), everything else (3, 1, 4)."""
        if any(a in target_arch for a in ("Llama", "Grok")):
            return TreeShape(5, 4, 8)
        return TreeShape(3, 1, 4)

    def resolve_shape(self, target_arch: str) -> TreeShape:
        key = "speculative"
        given = {k: getattr(self, k) for k in ("num_steps", "topk", "num_draft_tokens")}
        for k, v in given.items():
            if v is not None and v < 1:
                raise ConfigError(f"{key}.{k}", f"must be >= 1, got {v}")
        auto = self.auto_shape(target_arch)
        if all(v is None for v in given.values()):
            shape = auto
        elif given["topk"] == 1:
            steps = given["num_steps"] or auto.num_steps
            if given["num_draft_tokens"] not in (None, steps + 1):
                logger.warning("speculative.num_draft_tokens=%s adjusted to num_steps + 1 = %d because topk=1",
                               given["num_draft_tokens"], steps + 1)
            shape = TreeShape(steps, 1, steps + 1)
        elif any(v is None for v in given.values()):
            unset = [k for k, v in given.items() if v is None]
            raise ConfigError(f"{key}.{unset[0]}",
                              "set num_steps, topk and num_draft_tokens all three or none "
                              f"(given: {', '.join(f'{k}={v}' for k, v in given.items() if v is not None)}; "
                              f"unset: {', '.join(unset)}); topk=1 alone is also accepted")
        else:
            shape = TreeShape(given["num_steps"], given["topk"], given["num_draft_tokens"])
        if shape.num_draft_tokens < 2:
            raise ConfigError(f"{key}.num_draft_tokens", f"must be >= 2 (root + one draft token), got {shape.num_draft_tokens}")
        most = max_draft_candidates(shape.num_steps, shape.topk) + 1
        if shape.num_draft_tokens > most:
            # SGLang's EAGLE-2 drafting offers topk candidates at the first step and topk x topk at
            # each later one; its rerank cannot pick more. A specfw decision: adjust (as topk=1
            # does) rather than reject a shape SGLang's own docs use, e.g. (2, 2, 8) -> 7
            logger.warning("speculative.num_draft_tokens=%d adjusted to %d: a tree of num_steps=%d, topk=%d offers at most "
                           "topk + (num_steps - 1) * topk^2 = %d draft tokens", shape.num_draft_tokens, most,
                           shape.num_steps, shape.topk, most - 1)
            shape = TreeShape(shape.num_steps, shape.topk, most)
        return shape

    def validate(self) -> None:
        """Value rules beyond the types (Hydra checks those); subclasses call ``super().validate()``."""
        for k in self.unused_keys:
            default = type(self).__dataclass_fields__[k].default
            if getattr(self, k) != default:
                raise ConfigError(f"speculative.{k}", f"is not used by speculative={self.algorithm}; "
                                                      f"leave it unset (got {getattr(self, k)!r})")
        from ..config import DRAFT_LOAD_FORMATS
        if self.draft_load_format is not None and str(self.draft_load_format) not in DRAFT_LOAD_FORMATS:
            raise ConfigError("speculative.draft_load_format", f"'{self.draft_load_format}' is not one of {[None, *DRAFT_LOAD_FORMATS]}")
        from .verify_cost import MODES, adaptive_mode
        if adaptive_mode(self.adaptive_draft) not in MODES:
            raise ConfigError("speculative.adaptive_draft", f"'{self.adaptive_draft}' is not one of {list(MODES)}")
        if self.draft_assist is not None:
            from ..plugins import plugin_manager
            assists = plugin_manager().assists
            if str(self.draft_assist) not in assists:
                raise ConfigError("speculative.draft_assist", f"'{self.draft_assist}' is not one of {[None, *sorted(assists)]}")
            if str(self.draft_assist) == self.algorithm:
                raise ConfigError("speculative.draft_assist", f"'{self.draft_assist}' is the algorithm itself (speculative={self.algorithm}); "
                                                              "use it with a model-based drafter, or leave it null")
        for k in ("accept_threshold_single", "accept_threshold_acc"):
            v = getattr(self, k)
            if not 0 < v <= 1:
                raise ConfigError(f"speculative.{k}", f"must be in (0, 1], got {v}")


def resolve_tree_shape(spec: SpecAlgoConfig, hf_config) -> TreeShape:
    """Validate ``spec`` and resolve its tree shape for the target (its architecture picks the
    auto defaults); raises ``ConfigError`` naming the key."""
    spec.validate()
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    return spec.resolve_shape(arch)

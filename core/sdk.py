"""The plugin SDK: every name a speculative-decoding plugin may import from specfw, in one place.

Built-in algorithms (``plugins/``) import from specfw only this module (tested:
``tests/unit/test_core_boundary.py``), so a third-party plugin written against it has the same access
they have. Everything else under ``specfw`` is internal and may change between versions; the
names here change only with a note in ``docs/plugins.md``.

Contract (every plugin)
    ``hookimpl`` (mark each hook implementation), ``ConfigError`` (config problems, naming the
    key), ``SpecAlgoConfig`` / ``TreeShape`` (the algorithm's config and tree shape),
    ``SpecContext`` (the per-engine state each hook receives), ``StepPlan`` (this step's draft
    size, depth and score floor), ``DraftCandidates`` (what ``specfw_draft`` returns),
    ``DraftTree``, ``VerifyResult`` / ``StepResult`` (what verification returns), ``Request`` (what
    hooks receive per request; read-only).

Model-based drafters
    ``FeatureDrafter`` (EAGLE-family bookkeeping: target features, the head's own KV, catch-up
    extend, EAGLE-2 beams), ``beam_search`` (EAGLE-2 beams over any drafter's forward),
    ``DraftDecoderLayer`` (the one-layer draft decoder), ``RMSNorm``, ``Rotary``, draft KV
    (``KVPool``, ``SlotTable``), a draft model with its own runner (``load_model``,
    ``ModelRunner``, ``build_forward_batch``, ``ForwardBatch``), checkpoints
    (``resolve_model_path``, ``load_state_dict``, ``draft_load_format``: the format
    ``speculative.draft_load_format`` resolves to, ``dummy_weights_``: its random weights), and placement beside the target:
    ``place_on_target`` (device + the engine's kernel backend), ``target_dtype``,
    ``target_device``, ``draft_kv_slots``, ``draft_logits`` (a head's fp32 logits without a
    round trip through the model's dtype where its lm_head computes in fp32).

Trainers (``specfw_register_trainers``)
    ``DraftTrainConfig`` (the common draft-training keys), ``ModuleTrainer``, ``load_matching``,
    ``unroll``, ``unrolled_layer_step`` (the training-time-test unroll).
"""

from __future__ import annotations

import torch

from .committed_drafts import committed_draft, demo_draft_for
from .config import ConfigError
from .forward_batch import ForwardBatch
from .hookspecs import hookimpl
from .kv_cache import KVPool, SlotTable
from .model_loader import dummy_weights_, load_model, load_state_dict, resolve_model_path
from .model_runner import ModelRunner, build_forward_batch
from .models.draft_layer import DraftDecoderLayer
from .models.llama import RMSNorm, Rotary
from .request import Request
from .speculative.beam import beam_search
from .speculative.config import SpecAlgoConfig, TreeShape
from .speculative.feature_drafter import FeatureDrafter
from .speculative.token_map import load_token_map, resolve_token_map, restricted_lm_head
from .speculative.types import DraftCandidates, DraftTree, SpecContext, StepPlan
from .step import StepResult, VerifyResult
from .train.common import ModuleTrainer, load_matching, unroll, unrolled_layer_step
from .train.config import DraftTrainConfig

__all__ = [
    "committed_draft",
    "demo_draft_for",
    # contract
    "hookimpl",
    "ConfigError",
    "SpecAlgoConfig",
    "TreeShape",
    "SpecContext",
    "StepPlan",
    "DraftCandidates",
    "DraftTree",
    "VerifyResult",
    "StepResult",
    "Request",
    # model-based drafters
    "FeatureDrafter",
    "beam_search",
    "load_token_map",
    "resolve_token_map",
    "restricted_lm_head",
    "DraftDecoderLayer",
    "RMSNorm",
    "Rotary",
    "KVPool",
    "SlotTable",
    "load_model",
    "ModelRunner",
    "build_forward_batch",
    "ForwardBatch",
    "resolve_model_path",
    "load_state_dict",
    "draft_load_format",
    "dummy_weights_",
    "place_on_target",
    "target_dtype",
    "target_device",
    "draft_kv_slots",
    "draft_logits",
    # trainers
    "DraftTrainConfig",
    "ModuleTrainer",
    "load_matching",
    "unroll",
    "unrolled_layer_step",
]


def place_on_target(ctx: SpecContext, module: torch.nn.Module) -> torch.nn.Module:
    """Move draft weights to the target's device and hand them to the engine's kernel backend
    (on a CPU: specfw's compiled linears and fused norms, as the target's). Returns the module."""
    return ctx.runner.prepare(module)


def draft_logits(lm_head: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``rows`` (the head's normed output, in the model's dtype). An lm_head whose
    kernel takes an fp32 row and sums in fp32 (``computes_fp32``: the int8-activation linears,
    which quantize the row either way) gets the row in fp32 and returns its fp32 sums as they
    are: no rounding to bf16 and back. On the 2-core Xeon that round trip cost ~90 us of the
    ~240 us an EAGLE-3 int8 lm_head call took (8,192 logits written by both cores, converted
    twice), 5 calls a draft step."""
    if getattr(lm_head, "computes_fp32", False) and rows.dtype != torch.float32:
        return lm_head(rows.float())
    return lm_head(rows).float()


def target_dtype(ctx: SpecContext) -> torch.dtype:
    """The dtype the target computes and keeps KV in (``model.dtype``); draft heads use it too."""
    return ctx.runner.kv.dtype


def target_device(ctx: SpecContext) -> torch.device:
    """Where the target runs: the hooks' hidden states and logits are there."""
    return ctx.runner.device


def draft_load_format(ctx: SpecContext) -> str:
    """How the drafter reads its weights: ``speculative.draft_load_format``, null = as
    ``model.load_format`` (``auto`` for a GGUF target); ``dummy`` = ``dummy_weights_``, no file read."""
    from .model_loader import draft_load_format as resolve

    return resolve(ctx.config, ctx.engine_config.model)


def draft_kv_slots(ctx: SpecContext, config: SpecAlgoConfig) -> int:
    """KV slots for a drafter's own pool: ``speculative.draft_kv_tokens``, else as many as the
    target's pool (a draft position per target position)."""
    return getattr(config, "draft_kv_tokens", None) or ctx.runner.allocator.num_slots

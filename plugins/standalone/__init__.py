"""STANDALONE speculative decoding: a smaller draft LLM with the target's tokenizer.

Registered through the ``specfw`` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from specfw.sdk import hookimpl

from .config import SELF_DRAFT, StandaloneConfig, StandaloneTrainConfig
from .drafter import DEMO_DRAFT, StandaloneDrafter
from .self_draft import SelfDrafter


def make_drafter(ctx):
    """A draft LLM with its own KV pool, or the target's own checkpoint quantized on the target's
    KV pool (``speculative.draft_model_path=target``)."""
    return SelfDrafter(ctx) if ctx.config.draft_model_path == SELF_DRAFT else StandaloneDrafter(ctx)


@hookimpl
def specfw_register_algorithms(register):
    register("standalone", StandaloneConfig, make_drafter, "small draft LLM (same tokenizer), drafting num_steps deep with topk branching")


def _make_trainer(cfg, teacher, examples):
    from .trainer import StandaloneTrainer  # torch-heavy: imported only by `specfw train`

    return StandaloneTrainer(cfg, teacher, examples)


@hookimpl
def specfw_register_trainers(register):
    register("standalone", StandaloneTrainConfig, _make_trainer, "small Llama draft distilled from the target", demo_draft=DEMO_DRAFT, copy_tokenizer=True)

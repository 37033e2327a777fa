"""MTP / NextN speculative decoding: the target checkpoint's built-in multi-token-prediction
layers (DeepSeek-V3 ``eh_proj`` or MiMo ``mtp_layers`` layout) draft for it; no separate draft
model. Registered through the ``specfw`` entry-point group."""

from __future__ import annotations

from specfw.sdk import hookimpl

from .config import MtpConfig, MtpTrainConfig
from .drafter import MtpDrafter


def _make_drafter(ctx):
    if ctx.config.multi_layer:
        from .multi_layer import MultiLayerMtpDrafter

        return MultiLayerMtpDrafter(ctx)
    return MtpDrafter(ctx)


@hookimpl
def specfw_register_algorithms(register):
    register("mtp", MtpConfig, _make_drafter, "MTP/NextN: the target's built-in multi-token-prediction layers draft")


def _make_trainer(cfg, teacher, examples):
    from .trainer import MtpTrainer  # torch-heavy: imported only by `specfw train`

    return MtpTrainer(cfg, teacher, examples)


@hookimpl
def specfw_register_trainers(register):
    register("mtp", MtpTrainConfig, _make_trainer, "a NextN (MTP) layer for a target without one (chain-trained)")

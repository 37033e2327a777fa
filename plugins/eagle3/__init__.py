"""EAGLE-3 speculative decoding: a one-layer head over fused low/mid/high target features with a
reduced draft vocabulary (``d2t``). Registered through the ``specfw`` entry-point group."""

from __future__ import annotations

from specfw.sdk import hookimpl

from .config import Eagle3Config, Eagle3TrainConfig
from .drafter import DEMO_DRAFT, Eagle3Drafter


@hookimpl
def specfw_register_algorithms(register):
    register("eagle3", Eagle3Config, Eagle3Drafter, "EAGLE-3 draft head (fused target features, d2t vocabulary)")


def _make_trainer(cfg, teacher, examples):
    from .trainer import Eagle3Trainer  # torch-heavy: imported only by `specfw train`

    return Eagle3Trainer(cfg, teacher, examples)


@hookimpl
def specfw_register_trainers(register):
    register("eagle3", Eagle3TrainConfig, _make_trainer, "EAGLE-3 head (d2t vocabulary, training-time test)", demo_draft=DEMO_DRAFT)

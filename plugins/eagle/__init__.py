"""EAGLE-1/2 speculative decoding: a one-layer feature head with the target's embeddings and
lm_head; EAGLE-2 dynamic trees; FR-Spec token map. Registered through the ``specfw``
entry-point group."""

from __future__ import annotations

from specfw.sdk import hookimpl

from .config import EagleConfig, EagleTrainConfig
from .drafter import DEMO_DRAFT, EagleDrafter


@hookimpl
def specfw_register_algorithms(register):
    register("eagle", EagleConfig, EagleDrafter, "EAGLE-2 draft head (dynamic tree, FR-Spec token map)")


def _make_trainer(cfg, teacher, examples):
    from .trainer import EagleTrainer  # torch-heavy: imported only by `specfw train`

    return EagleTrainer(cfg, teacher, examples)


@hookimpl
def specfw_register_trainers(register):
    register("eagle", EagleTrainConfig, _make_trainer, "EAGLE-1/2 feature head", demo_draft=DEMO_DRAFT)

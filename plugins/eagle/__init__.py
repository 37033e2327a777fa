"""EAGLE-1/2 speculative decoding: a one-layer feature head with the target's embeddings and
lm_head; EAGLE-2 dynamic trees; FR-Spec token map. Registered through the ``specfw``
entry-point group."""
from __future__ import annotations

from specfw.hookspecs import hookimpl

from .config import EagleConfig
from .drafter import EagleDrafter


@hookimpl
def specfw_register_algorithms(register):
    register("eagle", EagleConfig, EagleDrafter, "EAGLE-2 draft head (dynamic tree, FR-Spec token map)")

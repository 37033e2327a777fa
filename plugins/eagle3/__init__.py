"""EAGLE-3 speculative decoding: a one-layer head over fused low/mid/high target features with a
reduced draft vocabulary (``d2t``). Registered through the ``specfw`` entry-point group."""
from __future__ import annotations

from specfw.hookspecs import hookimpl

from .config import Eagle3Config
from .drafter import Eagle3Drafter


@hookimpl
def specfw_register_algorithms(register):
    register("eagle3", Eagle3Config, Eagle3Drafter, "EAGLE-3 draft head (fused target features, d2t vocabulary)")

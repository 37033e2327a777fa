"""STANDALONE speculative decoding: a smaller draft LLM with the target's tokenizer.

Registered through the ``specfw`` entry-point group like any third-party plugin.
"""
from __future__ import annotations

from specfw.hookspecs import hookimpl

from .config import StandaloneConfig
from .drafter import StandaloneDrafter


@hookimpl
def specfw_register_algorithms(register):
    register("standalone", StandaloneConfig, StandaloneDrafter,
             "small draft LLM (same tokenizer), drafting num_steps deep with topk branching")

"""NGRAM speculative decoding: drafts come from an n-gram trie over prompts and outputs.

Registered through the ``specfw`` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from specfw.sdk import hookimpl

from .assist import NgramAssist
from .config import NgramConfig
from .drafter import NgramDrafter


@hookimpl
def specfw_register_algorithms(register):
    register("ngram", NgramConfig, NgramDrafter, "n-gram cache drafting (no draft model); SGLang's NGRAM, on CPU too")


@hookimpl
def specfw_register_draft_assists(register):
    register("ngram", NgramAssist, "the n-gram cache's continuation of the context, merged into any drafter's tree")

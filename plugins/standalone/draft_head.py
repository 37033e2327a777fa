"""``speculative.draft_lm_head``: which lm_head a standalone draft runs.

``proxy`` asks the drafting backend for a stand-in (``Backend.proxy_head``: on the CPU kernels a
4-bit copy of an 8-bit head whose best candidates are rescored on the 8-bit codes, about 60% of the
head's bytes a draft token); ``full`` keeps the head; ``auto`` takes the proxy for a self-draft on
GGUF blocks over the whole vocabulary, where the head is a third of what a draft token streams.
"""

from __future__ import annotations

from specfw.sdk import ConfigError


def use_draft_lm_head(mode: str, model, backend, self_draft_scheme: str | None, token_map) -> str:
    """Applies ``mode`` to the loaded, quantized draft ``model``; returns what it runs, for the log."""
    if mode == "full":
        return "full"
    proxy = backend.proxy_head(model.lm_head) if mode == "proxy" or (self_draft_scheme == "gguf" and token_map is None) else None
    if proxy is None:
        if mode == "proxy":
            raise ConfigError(
                "speculative.draft_lm_head",
                f"proxy needs the draft's lm_head on 8-bit codes (GGUF Q8_0 blocks or w8a8_int8) on the CPU kernels, not {type(model.lm_head).__name__}: "
                "use auto or full",
            )
        return "full"
    model.lm_head = proxy
    return "proxy (4-bit copy, 8 candidates a row rescored on its 8-bit codes)"

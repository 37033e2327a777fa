"""``speculative.adaptive_draft=auto``: whether a verify forward's cost grows with the tree on this
device, measured once at startup.

Where verifying ``num_draft_tokens`` rows costs about what one row does (GPUs, or an AMX CPU with
small trees), drafting every step at the full tree is what pays, as SGLang does: the adaptive
draft policy is off and the tree flags mean what they say. Where it grows (CPUs), the policy is on:
it decides per step whether to draft and how large a tree to verify, from measured tokens/s, and
the tree flags are upper bounds.
"""

from __future__ import annotations

import logging
import time

import torch

from ..device import synchronize
from ..model_runner import build_forward_batch

logger = logging.getLogger(__name__)

PREFIX = 128  # tokens of context the probe's rows attend to
# verify cost / one-row cost above which the adaptive policy is worth running. Was 1.15 until
# session 18: on a fp32 EPYC (8 rows ~1.1-1.2x one row) the probe then came out on or off from run
# to run, and every specfw tune there found the policy on as fast or faster (eagle3 +9% on held-out
# MT-bench, ngram +10% on HumanEval); a GPU's launch-bound verify stays below 1.05.
GROWS_ABOVE = 1.05

MODES = ("auto", "true", "false")


def adaptive_mode(value) -> str:
    """``speculative.adaptive_draft`` as one of ``MODES`` (bools and their strings accepted)."""
    v = str(value).strip().lower()
    return {"1": "true", "on": "true", "yes": "true", "0": "false", "off": "false", "no": "false"}.get(v, v)


def verify_cost_ratio(runner, rows: int, reps: int = 3) -> float:
    """Seconds of a forward of ``rows`` tree rows (a chain) over ``PREFIX`` cached tokens, divided by
    those of one row; the best of ``reps`` each, after a warm-up. KV slots are borrowed and freed."""
    alloc = runner.allocator
    if runner.device.type == "meta" or not alloc.can_alloc(PREFIX + rows + 1):
        return float("inf")  # nothing to time (meta tensors) or no room: keep the policy on
    prefix = alloc.alloc(PREFIX)
    try:

        def timed(n: int) -> float:
            slots = alloc.alloc(n)
            try:
                mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
                chunk = [(torch.randint(0, 1000, (n,)), PREFIX + torch.arange(n), slots, prefix, mask)]
                runner.forward(build_forward_batch(chunk))
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    runner.forward(build_forward_batch(chunk))
                    synchronize(runner.device)
                    best = min(best, time.perf_counter() - t0)
                return best
            finally:
                alloc.free(slots)

        one = timed(1)
        return timed(rows) / one
    finally:
        alloc.free(prefix)


def resolve_adaptive(value, runner, num_draft_tokens: int) -> bool:
    """The adaptive draft policy on or off for ``speculative.adaptive_draft`` = ``value``; ``auto``
    measures (and logs what it found and what it means)."""
    mode = adaptive_mode(value)
    if mode != "auto":
        return mode == "true"
    ratio = verify_cost_ratio(runner, num_draft_tokens)
    on = ratio > GROWS_ABOVE
    if on:
        logger.info(
            "speculative.adaptive_draft=auto: on -- verifying %d rows costs %.2fx one row on this device, so "
            "each step drafts only when it pays and verifies the tree size that pays best (the tree flags "
            "are upper bounds); speculative.adaptive_draft=false verifies num_draft_tokens every step, as SGLang",
            num_draft_tokens,
            ratio,
        )
    else:
        logger.info(
            "speculative.adaptive_draft=auto: off -- verifying %d rows costs %.2fx one row on this device "
            "(flat), so every step drafts and verifies the configured tree, as SGLang",
            num_draft_tokens,
            ratio,
        )
    return on

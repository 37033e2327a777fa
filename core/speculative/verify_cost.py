"""``speculative.adaptive_draft=auto``: whether a verify forward's cost grows with the tree on this
device, measured once at startup with as many requests as the engine runs together (at most
``PROBE_BATCH``).

Where verifying ``num_draft_tokens`` rows costs about what one row does (GPUs, or an AMX CPU with
small trees), drafting every step at the full tree is what pays, as SGLang does: the adaptive
draft policy is off and the tree flags mean what they say. Where it grows (CPUs), the policy is
on: it decides per step whether to draft and how large a tree to verify, from measured tokens/s,
and the tree flags are upper bounds.

On a CUDA device ``auto`` is off without a probe: the probe times eager forwards (the graphed ones
serve), it came out above the threshold on an H200 (session 33), and there the policy lost to the
fixed tree in every side-by-side run.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ..device import synchronize
from ..model_runner import build_forward_batch
from .config import ADAPTIVE_GROWS_ABOVE

logger = logging.getLogger(__name__)

PREFIX = 128  # tokens of context the probe's rows attend to
# verify cost / one-row cost above which the adaptive policy is worth running, unless the algorithm
# sets its own (SpecAlgoConfig.adaptive_grows_above; the history of the value is there)
GROWS_ABOVE = ADAPTIVE_GROWS_ABOVE
# requests the probe verifies at once (at most engine.max_running_requests): whether a tree costs
# more than a plain step matters most where many requests share the forward. Session 27: with one
# request, 4 rows against 1 measured 0.88-1.14x in repeated probes on a fp32 EPYC (Zen 4), so
# standalone's policy came out on or off by chance, and off it ran 0.72x plain at 8 in flight (on,
# 0.93x); 8 requests x 4 rows against 8 x 1 measure well above the threshold there.
PROBE_BATCH = 8

MODES = ("auto", "true", "false")


def adaptive_mode(value) -> str:
    """``speculative.adaptive_draft`` as one of ``MODES`` (bools and their strings accepted)."""
    v = str(value).strip().lower()
    return {"1": "true", "on": "true", "yes": "true", "0": "false", "off": "false", "no": "false"}.get(v, v)


def triton_interpreted(runner) -> bool:
    """The forward's attention runs specfw's Triton kernels under ``TRITON_INTERPRET=1`` (CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1" and getattr(getattr(runner, "backend", None), "attention", None) == "triton"


def verify_cost_ratio(runner, rows: int, reps: int = 5, batch: int = 1) -> float:
    """Seconds of a forward of ``batch`` requests with ``rows`` tree rows each (a chain) over
    ``PREFIX`` cached tokens each, divided by those of the same requests with one row each: the
    best of ``reps`` each, timed alternately (a machine whose speed drifts drifts for both), after
    a warm-up. KV slots are borrowed and freed."""
    alloc = runner.allocator
    if runner.device.type == "meta" or not alloc.can_alloc(batch * (PREFIX + rows + 1)):
        return float("inf")  # nothing to time (meta tensors) or no room: keep the policy on
    if triton_interpreted(runner):
        return float("inf")  # it would time Triton's Python interpreter, not a kernel: keep the policy on
    prefixes = [alloc.alloc(PREFIX) for _ in range(batch)]
    try:

        def forward(n: int) -> float:
            slots = [alloc.alloc(n) for _ in range(batch)]
            try:
                mask = torch.tril(torch.ones(n, n, dtype=torch.bool)) if n > 1 else None
                chunks = [(torch.randint(0, 1000, (n,)), PREFIX + torch.arange(n), s, p, mask) for s, p in zip(slots, prefixes)]
                t0 = time.perf_counter()
                runner.forward(build_forward_batch(chunks))
                synchronize(runner.device)
                return time.perf_counter() - t0
            finally:
                for s in slots:
                    alloc.free(s)

        forward(1), forward(rows)  # warm-up
        one, tree = float("inf"), float("inf")
        for _ in range(reps):
            one, tree = min(one, forward(1)), min(tree, forward(rows))
        return tree / one
    finally:
        for p in prefixes:
            alloc.free(p)


def resolve_adaptive(value, runner, num_draft_tokens: int, batch: int = 1, grows_above: float = GROWS_ABOVE) -> bool:
    """The adaptive draft policy on or off for ``speculative.adaptive_draft`` = ``value``; ``auto``
    measures at ``batch`` requests (the engine passes ``min(engine.max_running_requests,
    PROBE_BATCH)``), turns it on above ``grows_above`` (the algorithm's ``adaptive_grows_above``) and
    logs what it found and what it means."""
    mode = adaptive_mode(value)
    if mode != "auto":
        return mode == "true"
    if runner.device.type == "cuda":
        logger.info(
            "speculative.adaptive_draft=auto: off on a CUDA device -- every step drafts and verifies the configured tree, "
            "as SGLang (docs/gpu.md: on an H200 the policy lost to the fixed tree in every A/B); speculative.adaptive_draft=true turns it on"
        )
        return False
    ratio = verify_cost_ratio(runner, num_draft_tokens, batch=batch)
    on = ratio > grows_above
    if on:
        logger.info(
            "speculative.adaptive_draft=auto: on -- verifying %d rows a request costs %.2fx one row (%d requests; this algorithm's "
            "threshold %.2fx) on this device, so "
            "each step drafts only when it pays and verifies the tree size that pays best (the tree flags "
            "are upper bounds); speculative.adaptive_draft=false verifies num_draft_tokens every step, as SGLang",
            num_draft_tokens,
            ratio,
            batch,
            grows_above,
        )
    else:
        logger.info(
            "speculative.adaptive_draft=auto: off -- verifying %d rows a request costs %.2fx one row (%d requests; this algorithm's threshold %.2fx) "
            "on this device (flat enough), so every step drafts and verifies the configured tree, as SGLang",
            num_draft_tokens,
            ratio,
            batch,
            grows_above,
        )
    return on


def flat_batches(value, runner, num_draft_tokens: int, probe_batch: int, grows_above: float = GROWS_ABOVE) -> frozenset[int]:
    """With ``auto`` and the policy on from a probe of several requests: whether one request's full
    tree verifies within ``grows_above`` of one row too, timed the same way. Returns ``{1}`` if so
    (the policy then plays the configured tree every one-request step: a server's policy is on for
    its concurrency, while a lone chat's verify of EAGLE-3's (5, 4, 8) tree measured 0.9-1.36x a row
    on a Zen 4 EPYC and its fixed tree decoded 1.00-1.15x the policy's speed, session 61), else empty."""
    if adaptive_mode(value) != "auto" or probe_batch <= 1 or runner.device.type == "cuda":
        return frozenset()
    ratio = verify_cost_ratio(runner, num_draft_tokens, batch=1)
    if ratio > grows_above:
        return frozenset()
    logger.info(
        "speculative.adaptive_draft=auto: one request's %d rows cost %.2fx one row (threshold %.2fx): steps with one request in "
        "flight verify the configured tree, the policy decides for more",
        num_draft_tokens,
        ratio,
        grows_above,
    )
    return frozenset({1})

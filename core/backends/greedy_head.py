"""``GreedyHead``: the lm_head of rows that are read only for their argmax, at half the bytes.

The demo target's fp32 lm_head is 113 MB of the 538 MB a decode step streams. A greedy row needs
only its argmax, so ``cpu_ops.greedy_logits`` multiplies by a bf16 copy of the weight (56 MB, on
the kernel's one-row bf16 path), bounds each logit's distance from the fp32 product by
``|x| * bound[v]``, and recomputes from the fp32 weight, with the full product's own tile and k
order, only the few logits whose range reaches the row's largest lower end (1.2 a row on average
on MT-bench decode rows of the demo target; measured in session 22). Every other logit is -inf.
So the argmax -- first index on ties -- and the logit there are bit for bit the full product's:
greedy decoding gives the same tokens. Sampling, logprobs, penalties and non-greedy verification
need whole rows and never get these (``ForwardBatch.greedy_only``).

``bound[v] = |w_v - w'_v| + gamma (|w_v| + |w'_v|)``, rounded up, with
``gamma = (K + 2) u / (1 - (K + 2) u)``, ``u = 2^-24``: by Cauchy-Schwarz ``|x . w_v - x . w'_v| <=
|x| |w_v - w'_v|``, and each fp32 dot product is within ``gamma |x| |w|`` of its exact value in
any summation order, fused or not. Costs 56 MB of memory beside the fp32 head.

On CPUs with AVX512-BF16 (``dot``: the ``bf16_dot`` kernel) the proxy is computed with
``vdpbf16ps`` from the row rounded to bf16 too (``x'``, subnormals flushed): two products a lane
per instruction instead of one, in the layout of specfw's bf16 linears. The radius then gains
``(|x - x'| + gamma |x'|) * |w'_v|`` and an absolute ``2 (K + 2) 2^-126`` (subnormal sums
flushed), and ``cpu_ops.greedy_pick`` selects and recomputes exactly as before: the same bits.
"""

from __future__ import annotations

import torch

from . import huge_pages

UNIT_ROUNDOFF = 2.0**-24


class GreedyHead:
    def __init__(self, ops, lm_head, dot=None):
        """``dot``: the ``bf16_dot`` kernel module, to compute the proxy with (None: ``ops``' bf16
        linear)."""
        self.ops, self.lm_head, self.dot = ops, lm_head, dot
        self.full = lm_head.packed
        self.out_features = lm_head.out_features
        w = lm_head.weight  # [V, K] fp32
        w16 = flush_subnormals(w.bfloat16())
        K = w.shape[1]
        gamma = (K + 2) * UNIT_ROUNDOFF / (1 - (K + 2) * UNIT_ROUNDOFF)
        # w - w16 is exact in fp32 (the bits rounding dropped); each fp32 norm is within K u of its
        # value, and 1e-3 covers that and the sums' rounding many times over
        w16n = w16.float().norm(dim=1)
        bound = (w - w16.float()).norm(dim=1) + gamma * (w.norm(dim=1) + w16n)
        self.bound = bound * (1 + 1e-3)
        self.wbound = w16n * (1 + 1e-3)  # |w'_v|, for the dot proxy's input rounding
        self.proxy = huge_pages.relocate([(dot or ops).pack(w16)])[0]

    @staticmethod
    def eligible(lm_head) -> bool:
        """An fp32 weight on ``cpu_ops`` without bias (a bf16 weight is already the cheap copy)."""
        from .kernel_linear import KernelLinear

        return isinstance(lm_head, KernelLinear) and lm_head.packed.dtype == torch.float32 and lm_head.bias.numel() == 0 and not lm_head._padded

    def current(self) -> bool:
        """Still the head's weight (a relocation or a swap replaces ``packed``), still unpadded."""
        return self.lm_head.packed is self.full and not self.lm_head._padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] normed hidden rows -> [T, V] fp32: the full product's values at every
        possible argmax, -inf elsewhere."""
        x = x.float()
        if self.dot is None:
            return self.ops.greedy_logits(x, self.proxy, self.full, self.bound, self.out_features)
        xb = flush_subnormals(x.bfloat16())
        p = self.dot.linear_f32(xb, self.proxy, self.out_features)
        return self.ops.greedy_pick(x, xb, p, self.full, self.bound, self.wbound, self.out_features)


def flush_subnormals(t: torch.Tensor) -> torch.Tensor:
    """``t`` with subnormal values set to zero (what ``vdpbf16ps`` reads them as)."""
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, bf16's smallest normal too
    return t.masked_fill(t.abs() < tiny, 0)

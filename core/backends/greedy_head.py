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

A bf16 model's head (or an fp32 one holding bf16 values, packed as bf16) can take the int8 copy
below alone (``engine.cpu_greedy_head_proxy=int8``; ``auto`` leaves it whole), for calls of up to
``BF16_HEAD_MAX_ROWS`` rows: its exact product is ``cpu_ops.linear`` on
the packed bf16 weight, whose outputs a bf16 model rounds to bf16, so ``greedy_select_packed`` also
keeps every logit within one bf16 ulp of the maximum (ties are common there) and recomputes a
candidate's block of 16 outputs with that same linear on the row alone (a row's outputs depend on
no other row or block). Its radius also covers what ``vdpbf16ps`` reads as zero: subnormal weights
(in the bound) and inputs (in the row's term).

With ``q8`` (``engine.cpu_greedy_head_proxy``: the ``q8_ops`` build, int8 by default on the
avx512 and avx2 builds) the proxy is ``q8_ops``' linear over 8-bit codes of the head instead: per output
and block of 32 inputs ``w' = d q`` (``d = max|w| / 127`` rounded up to fp16, so the scales take 2
bytes: 30 MB for the demo's head, against 56 MB in bf16), the row quantized to int8 per block of
32 (``x' = q_x dx``), the products summed in integers. By the same argument the radius is
``|x| bound_v + (|x - x'| + gamma |x'|) |w'_v|``, with ``bound_v = |w_v - w'_v| + gamma (|w_v| +
|w'_v|)``: ``|x - x'|`` is computed from the row's own codes (``q8_ops.quantize_rows``, the codes
the linear uses), and ``gamma |x'| |w'_v|`` covers the proxy's fp32 scale steps (one product and
one fma a block, ``2 K / 32 + 1 <= K + 2`` roundings). Beside the bf16 proxy's absolute term it
gains ``K / 32 * 2^-106`` (a block's scale product ``d dx`` flushed to zero, times an integer sum
below ``2^19``). ``cpu_ops.greedy_select`` selects and recomputes: the same bits again, at about 4
candidates a row on MT-bench decode rows (1.3 with bf16).
"""

from __future__ import annotations

import torch

from . import huge_pages

UNIT_ROUNDOFF = 2.0**-24
TINY = torch.finfo(torch.float32).tiny  # 2^-126: below it vdpbf16ps reads a value as zero
# a head on bf16 weights takes the int8 copy for calls of up to this many rows, the full head above:
# the demo's bf16 head from DRAM (Zen 4, avx512 build, vdpbf16ps) with the int8 copy took 0.80x /
# 0.83x / 0.90x / 1.06x the full head's time at 1 / 4 / 8 / 16 rows (7-12 candidates a row: bf16
# outputs tie within an ulp); the bf16 full head streams half the fp32 one's bytes
BF16_HEAD_MAX_ROWS = 8


class GreedyHead:
    def __init__(self, ops, lm_head, dot=None, q8=None, q8_tiles=None):
        """``dot``: the ``bf16_dot`` kernel module, to compute the proxy with (None: ``ops``' bf16
        linear); ``q8``: a ``q8_ops`` build, for the int8 proxy instead (``int8_eligible``);
        ``q8_tiles``: its AMX-INT8 tile build (the same bits), for calls of ``TILE_ROWS`` rows or more."""
        self.ops, self.lm_head, self.dot, self.q8 = ops, lm_head, None if q8 is not None else dot, q8
        self.q8_tiles = q8_tiles if q8 is not None else None
        self.full = lm_head.packed
        self.out_features = lm_head.out_features
        w = lm_head.weight.float()  # [V, K]: the fp32 head, or a bf16 head's values
        self.bf16 = lm_head.packed.dtype == torch.bfloat16
        if q8 is not None:
            self._int8_proxy(w)
            return
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

    def _int8_proxy(self, w: torch.Tensor) -> None:
        from .q8_linear import BLOCK, pack

        V, K = w.shape
        gamma = (K + 2) * UNIT_ROUNDOFF / (1 - (K + 2) * UNIT_ROUNDOFF)
        d = int8_scales(w)
        q = torch.round(w.reshape(V, K // BLOCK, BLOCK) / torch.where(d > 0, d, 1)[..., None]).clamp(-127, 127)
        wq = (q.double() * d.double()[..., None]).reshape(V, K)  # w' exactly (an 8-bit code times an fp16 value)
        wd = w.double()
        bound = (wd - wq).norm(dim=1) + gamma * (wd.norm(dim=1) + wq.norm(dim=1))
        if self.bf16:  # vdpbf16ps reads subnormal weights as zero; |x_sub| |w - w'| for the rows' own (__call__)
            bound = bound + (wd - wq).norm(dim=1) + wd.masked_fill(wd.abs() >= TINY, 0).norm(dim=1)
        self.bound = (bound * (1 + 1e-3)).float()
        self.wbound = (wq.norm(dim=1) * (1 + 1e-3)).float()  # |w'_v|
        self.gamma = gamma
        self.slack = 2.0 * (K + 2) * 2.0**-126 + (K // BLOCK) * 2.0**-106
        packed = pack(q.reshape(V, K).to(torch.int8), d, None, 8)
        assert packed.d.dtype == torch.float16  # int8_scales made them fp16 values
        self.codes, self.scales = huge_pages.relocate([packed.codes, packed.d])
        self.no_m = torch.empty(0, dtype=torch.float16)
        self.no_bias = torch.empty(0)

    @staticmethod
    def int8_eligible(lm_head) -> bool:
        """The int8 proxy needs whole blocks of 32 inputs and scales fp16 can hold."""
        from .q8_linear import BLOCK

        w = lm_head.weight.float()
        return w.shape[1] % BLOCK == 0 and bool(torch.isfinite(int8_scales(w)).all())

    @staticmethod
    def bf16_eligible(lm_head) -> bool:
        """A bf16 weight on ``cpu_ops`` without bias, in either packed layout: it can take the int8
        proxy alone (a bf16 copy would be the head itself), where ``int8_eligible`` too."""
        from .kernel_linear import KernelLinear

        return isinstance(lm_head, KernelLinear) and lm_head.packed.dtype == torch.bfloat16 and lm_head.bias.numel() == 0 and not lm_head._padded

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
        return self.select(x)[0]

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int] | None]:
        """``__call__``'s logits and each row's argmax (numpy's: the first index of the maximum),
        which the selection finds among its candidates: the caller need not scan the [T, V] rows
        for it (~0.3 ms for a tree's 8 rows read back right after the forward, session 66). None
        where the whole head ran."""
        if self.bf16:  # bf16 weights: the exact product is the packed weight's linear() on x as it comes
            if x.shape[0] > BF16_HEAD_MAX_ROWS:
                return self.lm_head(x).float(), None
            x = x.contiguous()
            return self._int8_call(x.float(), x)
        x = x.float()
        if self.q8 is not None:
            return self._int8_call(x.contiguous())
        am = torch.empty(x.shape[0], dtype=torch.long)
        if self.dot is None:
            return self.ops.greedy_logits(x, self.proxy, self.full, self.bound, self.out_features, am), am.tolist()
        xb = flush_subnormals(x.bfloat16())
        p = self.dot.linear_f32(xb, self.proxy, self.out_features)
        return self.ops.greedy_pick(x, xb, p, self.full, self.bound, self.wbound, self.out_features, am), am.tolist()

    def _int8_call(self, x: torch.Tensor, xb: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """``x`` fp32 rows; ``xb`` the rows as a head on bf16 weights takes them (bf16 or fp32)."""
        from .q8_linear import q8_build

        p = q8_build(self.q8, self.q8_tiles, x.shape[0]).linear(x, self.codes, self.scales, self.no_m, 8, self.out_features, self.no_bias)
        q, dx, _ = self.q8.quantize_rows(x)  # the codes the linear multiplied by
        xq = (q.double().view(q.shape[0], dx.shape[1], -1) * dx.double()[..., None]).view_as(x)
        xd = x.double()
        bx = ((xd - xq).norm(dim=1) + self.gamma * xq.norm(dim=1)) * (1 + 1e-12)
        am = torch.empty(x.shape[0], dtype=torch.long)
        if xb is None:
            return self.ops.greedy_select(x, p, self.full, self.bound, self.wbound, bx, self.slack, self.out_features, am), am.tolist()
        bx = bx + xd.masked_fill(xd.abs() >= TINY, 0).norm(dim=1) * (1 + 1e-12)  # inputs vdpbf16ps reads as zero
        return self.ops.greedy_select_packed(xb, x, p, self.full, self.bound, self.wbound, bx, self.slack, self.out_features, am), am.tolist()


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """Per output and block of 32 inputs, ``max|w| / 127`` rounded up to a value fp16 holds (so
    every code ``round(w / d)`` stays within -127..127 and the scales pack as fp16); inf where
    fp16 cannot hold it."""
    from .q8_linear import BLOCK

    V, K = w.shape
    d = w.reshape(V, K // BLOCK, BLOCK).abs().amax(-1) / 127
    h = d.half()
    up = torch.nextafter(h, torch.tensor(float("inf"), dtype=torch.float16))
    return torch.where(h.float() < d, up, h).float()


def flush_subnormals(t: torch.Tensor) -> torch.Tensor:
    """``t`` with subnormal values set to zero (what ``vdpbf16ps`` reads them as)."""
    tiny = torch.finfo(torch.float32).tiny  # 2^-126, bf16's smallest normal too
    return t.masked_fill(t.abs() < tiny, 0)

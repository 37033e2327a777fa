"""``Q8Linear``: a quantized linear with int8 activations on ``kernels/q8_ops.cpp``
(``model.activation_quantization=int8``; see docs/quantization.md).

The weights are any weight-only scheme's codes (``int8``, ``int4``, ``gguf`` Q8_0/Q4_0/Q4_1),
re-laid out for integer dot products: ``w = d * q + m`` per block of 32 inputs of one output.
Each row of activations is quantized to int8 per block of 32 (``dx = max|x| / 127``), the kernel
multiplies codes in integers and scales each block's sum once -- llama.cpp's arithmetic, about
4x less work per weight than dequantizing to fp32, so a one-row step is bound by the bytes of the
codes and a 16-row tree by integer throughput. Outputs differ from the weight-only scheme's (the
activations are rounded), but every row is computed alone in one fixed order: batch invariant
by construction, so greedy speculation stays exact within the scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .quant_linear import QuantWeight

BLOCK = 32  # inputs per activation/weight block
GROUP = 8  # outputs per kernel group
# calls of this many rows or more go to ``tile_ops`` where a linear has them: q8_ops' amx build,
# whose calls from 16 rows run on AMX-INT8 tiles (prompts, large trees: a forward of the demo
# 0.79x at 400 rows, 0.78x at 64, 0.98x at 16); fewer stay on the avx512 build (vpdpbusd), whose one-row code
# is the decode path's and is not rebuilt around the tiles. Every build gives the same bits.
TILE_ROWS = 16


def q8_build(ops, tiles, rows: int):
    """The build (a module, or a linear's address) a call of ``rows`` rows runs on: ``tiles`` (the
    amx build; None or 0 where there is none) from ``TILE_ROWS`` rows, else ``ops``."""
    return tiles if tiles and rows >= TILE_ROWS else ops


@dataclass
class Q8Weight:
    """Codes and scales in ``q8_ops.cpp``'s layout."""

    codes: torch.Tensor  # uint8 [NG, KB, 8, 16] (bits 4) or int8 [NG, KB, 8, 32] (bits 8)
    d: torch.Tensor  # fp32 or fp16 (where lossless) [NG, KB, 8]
    m: torch.Tensor  # like d, or empty
    bits: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))


def supports(in_features: int) -> bool:
    return in_features % BLOCK == 0


def unblock(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A ``QuantWeight`` (``quant_ops`` layout) as per-weight codes [N, K] and per-32 ``d``/``m``
    [N, K/32] with ``w = d * q + m`` (an offset folded into ``m``: ``d (q - o) = d q - o d``)."""
    n, k = qw.out_features, qw.in_features
    c = qw.codes
    if qw.bits == 4:
        c = torch.stack([c & 0x0F, c >> 4], dim=2).reshape(c.shape[0], k, c.shape[2])
    q = c.transpose(1, 2).reshape(-1, k)[:n]

    def rows(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(1, 2).reshape(-1, t.shape[1])[:n]
        return t.repeat_interleave(qw.group // BLOCK, dim=1)

    d = rows(qw.scale)
    m = rows(qw.minv) if qw.minv.numel() else None
    if qw.offset:
        m = (m if m is not None else torch.zeros_like(d)) - qw.offset * d
    return q, d, m


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int) -> Q8Weight:
    """Per-weight codes [N, K] (bits 4: 0..15; bits 8: int8) and ``d``/``m`` [N, K/32] -> ``Q8Weight``:
    per group of 8 outputs and block of 32 inputs, 8 steps of 32 bytes ``[4 o + t]`` = input
    ``4 s + t`` of output ``o`` (4-bit: steps 2p and 2p+1 in one byte's low and high nibble)."""
    n, k = q.shape
    ng, kb = (n + GROUP - 1) // GROUP, k // BLOCK
    if ng * GROUP != n:
        pad = ng * GROUP - n
        q, d = torch.cat([q, q.new_zeros(pad, k)]), torch.cat([d, d.new_zeros(pad, kb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, kb)])
    steps = q.reshape(ng, GROUP, kb, 8, 4).permute(0, 2, 3, 1, 4).reshape(ng, kb, 8, 32)
    if bits == 4:
        s = steps.to(torch.uint8)
        codes = (s[:, :, 0::2] | (s[:, :, 1::2] << 4)).contiguous()
    else:
        codes = steps.to(torch.int8).contiguous()

    # fp16 scales where that changes no value (GGUF's own d and m are fp16): fewer bytes per token
    half = all(t is None or torch.equal(t.float().half().float(), t.float()) for t in (d, m))
    dtype = torch.float16 if half else torch.float32

    def scales(t: torch.Tensor) -> torch.Tensor:  # [N, KB] -> [NG, KB, 8]
        return t.float().to(dtype).reshape(ng, GROUP, kb).permute(0, 2, 1).contiguous()

    return Q8Weight(codes, scales(d), scales(m) if m is not None else torch.empty(0, dtype=dtype), bits, n, k)


def from_quant_weight(qw: QuantWeight) -> Q8Weight:
    q, d, m = unblock(qw)
    return pack(q, d, m, qw.bits)


def codes_by_output(w: Q8Weight) -> torch.Tensor:
    """The codes per output and block, [N, K/32, 32] (4-bit ones unpacked to 0..15, uint8; 8-bit int8)."""
    c = w.codes
    ng, kb = c.shape[0], c.shape[1]
    if w.bits == 4:
        c = torch.stack([c & 0x0F, c >> 4], dim=3).reshape(ng, kb, 8, 32)
    return c.reshape(ng, kb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(ng * GROUP, kb, BLOCK)[: w.out_features]


def scales_by_output(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """``d`` or ``m`` per output and block, [N, K/32] fp32, from their [NG, K/32, 8] layout."""
    ng, kb = t.shape[0], t.shape[1]
    return t.float().permute(0, 2, 1).reshape(ng * GROUP, kb)[:out_features]


def dequantize(w: Q8Weight) -> torch.Tensor:
    """The fp32 weight [N, K] the codes stand for (``d * q`` then ``+ m``)."""
    full = scales_by_output(w.d, w.out_features)[..., None] * codes_by_output(w).float()
    if w.m.numel():
        full = full + scales_by_output(w.m, w.out_features)[..., None]
    return full.reshape(w.out_features, w.in_features)


class Q8Linear(nn.Module):
    computes_fp32 = True  # an fp32 row in, fp32 sums out (sdk.draft_logits skips the dtype round trip)
    tile_ops = None  # a build for calls of TILE_ROWS rows or more (the backend sets it), or None

    def __init__(self, w: Q8Weight, bias: torch.Tensor | None, ops, scheme: str):
        super().__init__()
        self.q8, self.ops, self.scheme = w, ops, scheme
        self.in_features, self.out_features = w.in_features, w.out_features
        self.bias = torch.empty(0) if bias is None else bias.detach().float()

    @classmethod
    def from_quant_weight(cls, qw: QuantWeight, bias: torch.Tensor | None, ops, scheme: str) -> "Q8Linear":
        return cls(from_quant_weight(qw), bias, ops, scheme)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.q8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.q8
        ops = q8_build(self.ops, self.tile_ops, x.numel() // self.in_features)
        if x.dim() == 2 and x.dtype == torch.float32:  # the decode/verify case: no reshapes (~10 us of ops per call)
            return ops.linear(x, w.codes, w.d, w.m, w.bits, self.out_features, self.bias)
        y = ops.linear(x.reshape(-1, self.in_features), w.codes, w.d, w.m, w.bits, self.out_features, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}+a8, {self.q8.nbytes / 2**20:.1f} MiB"

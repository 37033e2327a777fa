"""``W8A8Linear``: int8 weights with one scale per output channel times int8 activations with one
scale per row, on ``kernels/w8a8_ops.cpp`` (``model.quantization=int8`` with
``model.activation_quantization=int8_per_token``: SGLang's ``w8a8_int8`` form; see
docs/quantization.md).

The weight codes are the ``int8`` weight-only scheme's, re-laid out in 1 KB units that are AMX
B tiles as they lie. A row is quantized once over its whole width (``dx = max|x| / 127``), so its
integer sum against an output runs over every input before the one fp32 step
``fma(float(P), dx * d, bias)``: AMX-INT8 tiles take 16 rows per instruction and a tree of 16
rows costs about one row's weight stream (``int8`` + ``int8`` activations rescales every block
of 32 in fp32 instead). Every build rounds alike and computes each row alone: batch invariant by
construction, so greedy speculation stays exact within the scheme.
"""

from __future__ import annotations

import torch

from .q8_linear import Q8Linear, Q8Weight, unblock
from .quant_linear import QuantWeight

OUT, CHUNK = 16, 64  # outputs per block, inputs per chunk of the kernel's layout


def supports(qw: QuantWeight) -> bool:
    """An 8-bit per-channel weight (``quantization=int8``) whose width ``unblock`` reads."""
    return qw.bits == 8 and not qw.minv.numel() and not qw.offset and qw.in_features % 32 == 0


def from_quant_weight(qw: QuantWeight, ops) -> Q8Weight:
    """The codes in ``w8a8_ops``' layout and ``d`` [ceil(N / 16) x 16] (zero padded)."""
    q, d, m = unblock(qw)
    if m is not None or not torch.equal(d, d[:, :1].expand_as(d)):
        raise ValueError("w8a8 linear: needs one scale per output channel (the int8 scheme's)")
    n, k = q.shape
    scale = torch.zeros((n + OUT - 1) // OUT * OUT, dtype=torch.float32)
    scale[:n] = d[:, 0].float()
    return Q8Weight(ops.pack(q.to(torch.int8).contiguous()), scale, torch.empty(0), 8, n, k)


def dequantize(w: Q8Weight) -> torch.Tensor:
    """The fp32 weight [N, K] the codes stand for (``d * c``)."""
    nb, kc = w.codes.shape[:2]
    c = w.codes.view(nb, kc, 16, OUT, 4).permute(0, 3, 1, 2, 4).reshape(nb * OUT, kc * CHUNK)
    return (c.float() * w.d.view(-1, 1))[: w.out_features, : w.in_features]


class W8A8Linear(Q8Linear):
    """A ``Q8Linear`` whose ops are a ``w8a8_ops`` build (the same ``linear`` signature, so the
    one-call decoder layers take it too)."""

    @classmethod
    def from_quant_weight(cls, qw: QuantWeight, bias: torch.Tensor | None, ops, scheme: str = "int8") -> "W8A8Linear":
        return cls(from_quant_weight(qw, ops), bias, ops, scheme)

    @property
    def weight(self) -> torch.Tensor:
        return dequantize(self.q8)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}+a8 per token ({self.ops.isa()}), {self.q8.nbytes / 2**20:.1f} MiB"

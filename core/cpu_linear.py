"""Faster fp32 linear layers for CPU inference.

``nn.Linear`` on CPU calls MKL's sgemm on the ``[N, K]`` weight. Measured on the 2-core
Xeon (AVX-512) machines with the demo model's shapes:

* one row (batch-1 decode, a memory-bound GEMV): ``x @ W^T`` with ``W^T`` stored contiguous
  (``[K, N]``) is 5-25% faster than ``F.linear`` (lm_head 576x49152: 2.3 vs 3.0 ms);
* 2..16 rows (batched decode, tree verification, drafting): MKL's packed GEMM
  (``cblas_sgemm_pack`` format, through ``torch.ops.mkl``) is 1.5-3x faster than
  ``F.linear`` (576x3072 with 8 rows: 0.14 vs 0.37 ms), and one packed copy serves every row
  count;
* more rows (prefill, large batches): plain ``F.linear`` again (packed is slower there:
  whole-model forward of 32 rows 102 vs 84 ms, a 300-row 576x3072 GEMM 16 vs 14 ms).

``FastLinear`` keeps both copies (about 2x the layer's weight memory; MKL's packed buffer is
padded but only its used pages become resident). It is inference-only and used for float32
on CPU when MKL is available; everything else keeps ``nn.Linear``. Results equal
``F.linear`` up to float rounding (a different summation order), so greedy outputs of specfw
and other implementations can differ on exact logit ties.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

PACKED_MAX_ROWS = 16   # above this, plain F.linear is faster on the measured CPUs


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class FastLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", w.t().contiguous(), persistent=False)   # [K, N] for GEMV
        self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), 8), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight (a view of the transposed copy)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        x2 = x.reshape(rows, self.in_features)
        if rows == 1:
            y = x2 @ self.weight_t
            if self.bias is not None:
                y = y + self.bias
        elif rows <= PACKED_MAX_ROWS:
            y = torch.ops.mkl._mkl_linear(x2, self.packed, self.weight, self.bias, rows)
        else:
            y = F.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def use_fast_linears(module: nn.Module) -> int:
    """Swap every fp32 ``nn.Linear`` under ``module`` for a ``FastLinear`` (in place); returns how
    many were swapped. No-op without MKL; bf16/fp16 layers are left alone (oneDNN handles them)."""
    if not mkl_packing_available():
        return 0
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu":
                setattr(parent, name, FastLinear(child))
                swapped += 1
    return swapped

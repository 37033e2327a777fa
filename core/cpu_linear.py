"""Linear layers over torch's CPU libraries (MKL-packed fp32, oneDNN-reordered bf16) and the bf16
dot-product kernel: the ``torch_ops`` backend (``engine.cpu_isa=none``) and the bf16 fallback of
the ``cpu`` backend, which otherwise runs specfw's own kernels (``specfw.kernels``).

``nn.Linear`` on CPU calls MKL's sgemm on the ``[N, K]`` weight. With the demo model's shapes
(figures: docs/benchmarks.md, design figures):

* one row (batch-1 decode, a memory-bound GEMV): ``x @ W^T`` with ``W^T`` stored contiguous
  (``[K, N]``) is faster than ``F.linear``;
* 2..16 rows (batched decode, tree verification, drafting): MKL's packed GEMM
  (``cblas_sgemm_pack`` format, through ``torch.ops.mkl``) is faster than ``F.linear``, and one
  packed copy serves every row count;
* more rows (prefill, large batches): plain ``F.linear`` again (packed is slower there).

``FastLinear`` keeps both copies (about 2x the layer's weight memory; MKL's packed buffer is
padded but only its used pages become resident). It is inference-only and used for float32
on CPU when MKL is available. Results equal ``F.linear`` up to float rounding (a different
summation order), so greedy outputs of specfw and other implementations can differ on exact
logit ties.

``PackedBF16Linear`` is the bfloat16 counterpart: the weight is reordered once into oneDNN's
blocked layout (AMX/AVX-512-BF16 tiles) instead of on every call, as ``F.linear`` does.
It is faster than ``F.linear`` and, on AMX CPUs, flat from 1 to 16 rows, but not batch invariant
by construction (the row-plan probe decides). No extra weight memory (the blocked copy replaces
the plain one).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from .backends.kernel_linear import counted_packed
from .invariance import DEFAULT_TIMED_ROWS, RowPlan, invariant_row_plan

PACKED_MAX_ROWS = 16  # above this, plain F.linear is faster on the measured CPUs


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def _measured_plan(layer, mm, dtype: torch.dtype, kernel: str) -> RowPlan:
    """``layer``'s batch-invariant row plan, measured once per thread count (kept on the layer:
    looked up on every forward)."""
    threads = torch.get_num_threads()
    if layer._row_plan[0] != threads:
        key = (kernel, layer.out_features, layer.bias is not None)
        layer._row_plan = (threads, invariant_row_plan(mm, layer.in_features, dtype, key, layer.timed_rows))
    return layer._row_plan[1]


class FastLinear(nn.Module):
    """``batch_invariant``: every row count goes through the packed GEMM (the 1-row GEMV and
    ``F.linear`` round differently), in calls of at most as many rows as keep a row's bits
    independent of the others on this machine (``invariance.invariant_row_plan``: 64 on the
    Xeons (the cap); 3, or calls padded to 8 rows, on the EPYCs). Costs ~10% on 1-row linears."""

    def __init__(self, linear: nn.Linear, batch_invariant: bool = False):
        super().__init__()
        self.batch_invariant = batch_invariant
        self._row_plan: tuple[int, RowPlan | None] = (0, None)  # (thread count, plan) once measured
        self.timed_rows = DEFAULT_TIMED_ROWS  # row counts the plan is chosen for (invariance.measure_model)
        w = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", w.t().contiguous(), persistent=False)  # [K, N] for GEMV
        self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), 8), persistent=False)
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight (a view of the transposed copy)."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
        x2 = x.reshape(rows, self.in_features)
        if self.batch_invariant:
            y = self.row_plan().run(self._packed_mm, x2)
        elif rows == 1:
            y = x2 @ self.weight_t
            if self.bias is not None:
                y = y + self.bias
        elif rows <= PACKED_MAX_ROWS:
            y = torch.ops.mkl._mkl_linear(x2, self.packed, self.weight, self.bias, rows)
        else:
            y = F.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def _packed_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x2, self.packed, self.weight, self.bias, x2.shape[0])

    def row_plan(self) -> RowPlan:
        return _measured_plan(self, self._packed_mm, torch.float32, "mkl_packed")


def onednn_bf16_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedBF16Linear(nn.Module):
    """``batch_invariant``: run at most as many rows per call as keep a row's bits independent of
    the row count on this machine (``invariance.invariant_row_plan``; measured on the Xeons:
    576x1536 at 150-256 rows rounds some rows differently, up to 129 rows match the 1-row result
    bit for bit, so 64; on the EPYCs 1536->576 rounds differently from 2 rows on, so calls
    padded to 8 rows)."""

    def __init__(self, linear: nn.Linear, batch_invariant: bool = False):
        super().__init__()
        self.batch_invariant = batch_invariant
        self._row_plan: tuple[int, RowPlan | None] = (0, None)  # (thread count, plan) once measured
        self.timed_rows = DEFAULT_TIMED_ROWS  # row counts the plan is chosen for (invariance.measure_model)
        w = linear.weight.detach().contiguous()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)  # opaque oneDNN tensor
        self.bias = None if linear.bias is None else linear.bias.detach()

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight in plain layout (a copy; for tests and inspection only)."""
        return self.packed.to_dense() if self.packed.is_mkldnn else self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        y = self.row_plan().run(self._mm, x2) if self.batch_invariant else self._mm(x2)
        return y.view(*x.shape[:-1], self.out_features)

    def row_plan(self) -> RowPlan:
        return _measured_plan(self, self._mm, torch.bfloat16, "onednn_bf16")

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")


class DotBF16Linear(nn.Module):
    """bfloat16 on CPUs with AMX-BF16 or AVX512-BF16: specfw's own kernel (``kernels.bf16_kernel()``:
    ``bf16_amx.cpp``'s tiles where the CPU has AMX, else ``bf16_dot.cpp``'s ``vdpbf16ps``). Every
    output is reduced in one fixed order whatever the row count, so it is batch invariant by
    construction (the row plan probe confirms it: unpadded calls of up to 64 rows), and at the
    few rows of decoding and tree verification it streams the weight once at close to memory
    speed (figures: docs/benchmarks.md). The packed weight replaces the plain one."""

    packed = counted_packed()  # the one-call decoder layers hold packed weights: a replaced one is seen

    def __init__(self, linear: nn.Linear, batch_invariant: bool = False, kernel=None):
        super().__init__()
        from .kernels import bf16_amx, bf16_kernel

        self.kernel = kernel or bf16_kernel()  # kernel: a compiled module (tests pick each ISA's)
        self.kernel_name = "bf16_amx" if self.kernel is bf16_amx() else "bf16_dot"
        self.batch_invariant = batch_invariant
        self._row_plan: tuple[int, RowPlan | None] = (0, None)
        self.timed_rows = DEFAULT_TIMED_ROWS
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = self.kernel.pack(linear.weight.detach())
        self.bias = torch.empty(0) if linear.bias is None else linear.bias.detach().float()

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight in plain layout (a copy unpacked from the kernel's layout)."""
        nb, kp, _ = self.packed.shape
        w = self.packed.view(nb, kp, 16, 2).permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)
        return w[: self.out_features, : self.in_features].contiguous()

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return self.kernel.linear(x2, self.packed, self.out_features, self.bias)

    def row_plan(self) -> RowPlan:
        return _measured_plan(self, self._mm, torch.bfloat16, self.kernel_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.row_plan().run(self._mm, x2) if self.batch_invariant else self._mm(x2)
        return y.view(*x.shape[:-1], self.out_features)


def bf16_kernel_available() -> bool:
    """Whether bf16 layers get ``DotBF16Linear`` by default here (``kernels.bf16_dot_preferred``)."""
    from .kernels import bf16_dot_preferred

    return bf16_dot_preferred()


def fast_linear_for(linear: nn.Linear, batch_invariant: bool = False, bf16_kernel: bool = True) -> nn.Module | None:
    """The faster CPU replacement for ``linear``, or None where there is none. bf16:
    ``DotBF16Linear`` where specfw's kernel runs and is preferred (AVX512-BF16 without AMX; and
    ``bf16_kernel``), else oneDNN's."""
    w = linear.weight
    if type(linear) is not nn.Linear or w.device.type != "cpu":
        return None
    if w.dtype == torch.float32 and mkl_packing_available():
        return FastLinear(linear, batch_invariant)
    if w.dtype == torch.bfloat16 and bf16_kernel and bf16_kernel_available():
        return DotBF16Linear(linear, batch_invariant)
    if w.dtype == torch.bfloat16 and onednn_bf16_available():
        return PackedBF16Linear(linear, batch_invariant)
    return None


def use_fast_linears(module: nn.Module, batch_invariant: bool = False, bf16_kernel: bool = True) -> int:
    """Swap every CPU ``nn.Linear`` under ``module`` for its faster inference-only replacement
    (fp32: ``FastLinear``; bf16: ``DotBF16Linear`` or ``PackedBF16Linear``), in place; returns
    how many were swapped. Layers with no replacement (other dtypes, other devices, no
    MKL/oneDNN) are left alone."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            fast = fast_linear_for(child, batch_invariant, bf16_kernel) if type(child) is nn.Linear else None
            if fast is not None:
                setattr(parent, name, fast)
                swapped += 1
    return swapped

"""``TorchBackend``: forwards on torch's own ops -- accelerators (CUDA), the ``meta`` device, and
CPUs where specfw's kernels cannot be built or ``engine.cpu_isa=none``.

* CPU: MKL-packed fp32 / oneDNN (or AVX512-BF16 ``bf16_dot``) bf16 linears (``cpu_linear``,
  ``engine.cpu_packed_gemm``, ``engine.cpu_bf16_kernel``), batch invariant under measured row
  plans; fp32 forwards of 5..32 rows padded to a multiple of 8 rows (MKL is slow between them);
* accelerators: ``F.linear``, under measured row plans (``device_linear.InvariantLinear``) when
  batch invariant;
* attention: SDPA plans (``attention.plan_attention``): exact ones run every decode/tree row as a
  one-row query over exactly its visible keys; loose ones group equal query lengths with masks.
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention import attend, plan_attention
from ..cpu_linear import fast_linear_for, use_fast_linears
from ..device_linear import use_invariant_linears
from ..invariance import grouped_attention_is_invariant, measure_model
from .base import Backend, HeadShape


class SdpaPlan:
    """An ``attention.plan_attention`` plan, run layer by layer."""

    def __init__(self, items: list):
        self.items = items

    def __call__(self, q, k_cache, v_cache, scale):
        return attend(q, k_cache, v_cache, self.items, scale)


def sdpa_plan(seqs, device, shape: HeadShape, exact: bool) -> SdpaPlan:
    """Attention through torch's SDPA (one-row queries grouped where that is measured invariant)."""
    grouped = exact and grouped_attention_is_invariant(shape.dtype, shape.heads, shape.kv_heads, shape.head_dim, device)
    return SdpaPlan(plan_attention(seqs, device, exact, grouped))


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, device, batch_invariant: bool, packed_gemm: bool = True, bf16_kernel: bool = True):
        super().__init__(device, batch_invariant)
        self.packed_gemm = packed_gemm and self.device.type == "cpu"
        self.bf16_kernel = bf16_kernel

    def prepare_target(self, model: nn.Module) -> None:
        if self.packed_gemm:
            use_fast_linears(model, self.batch_invariant, self.bf16_kernel)
        elif self.batch_invariant:
            use_invariant_linears(model)
        self._hand_backend(model)

    def prepare_module(self, module: nn.Module) -> nn.Module:
        self._hand_backend(module, self.for_draft_modules())
        if self.packed_gemm:
            use_fast_linears(module, bf16_kernel=self.bf16_kernel)
            if type(module) is nn.Linear:  # a bare layer (e.g. an FR-Spec lm_head)
                module = fast_linear_for(module, bf16_kernel=self.bf16_kernel) or module
        return module

    def native_plan(self, seqs, device, shape: HeadShape, exact: bool) -> SdpaPlan:
        return sdpa_plan(seqs, device, shape, exact)

    def forward_rows(self, T: int, dtype: torch.dtype) -> int:
        """MKL's fp32 GEMM on these CPUs is much slower for some small row counts than for the next
        multiple of 8 (docs/benchmarks.md, design figures), so
        5..32 rows are padded up to a multiple of 8 (packed GEMM rows are row-count invariant)."""
        if not (self.packed_gemm and dtype == torch.float32) or T <= 4 or T > 32 or T % 8 == 0:
            return T
        return (T + 7) // 8 * 8

    def measure(self, model, dtype, timed_rows):
        return measure_model(model, dtype, timed_rows, self.device)

    def describe(self) -> str:
        kind = "MKL/oneDNN" if self.packed_gemm else "torch"
        attention = self.attention_note() or ", SDPA attention"
        return f"torch ops on {self.device} ({kind} linears{attention})"

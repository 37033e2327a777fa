"""``KernelLinear``: a linear layer on specfw's compiled CPU kernel (``kernels/cpu_ops.cpp``).

fp32 or bf16 weights, packed once into blocks of 16 outputs (the packed copy replaces the plain
weight: no extra memory); every output is accumulated over the input in one fixed order whatever
the number of rows, so the layer is batch invariant by construction -- no row plan, no padding
(the invariance probe confirms it at startup: unpadded calls of up to 64 rows; the verdict is
kept on disk per build and CPU, ``invariance.invariant_row_plan(persist=...)``). At the row counts
of decoding the weight streams once at close to memory speed (figures: docs/benchmarks.md,
design figures).

An fp32 weight whose every value is a bfloat16 value (a bf16 checkpoint loaded into an fp32
engine, as the published EAGLE-3 heads are) is packed as bf16: the same values, the same fp32
arithmetic and bits, half the bytes streamed per token. A bf16 model's weight, on a build with
AVX512-BF16 and ``bf16_dot`` asked for, is packed in ``bf16_dot``'s pair layout (``pack_dot``) and
summed on ``vdpbf16ps``: two products a lane per instruction, the bits of ``DotBF16Linear``, and
the one-call decoder layers (``KernelLayers``) take it like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from ..invariance import DEFAULT_TIMED_ROWS, MAX_ROW_BLOCK, RowPlan, invariant_row_plan


def counted_packed() -> property:
    """A linear's ``packed`` weight whose every assignment bumps ``KernelLinear.generation``: what
    collects the packed weights of many layers (the one-call ``KernelLayers``) checks one number,
    not every layer (``KernelLinear``'s and ``DotBF16Linear``'s)."""

    def get(self) -> torch.Tensor:
        return self._packed

    def put(self, value: torch.Tensor) -> None:
        self._packed = value
        KernelLinear.generation += 1

    return property(get, put)


class KernelLinear(nn.Module):
    # bumped whenever any KernelLinear's packed weight or padding verdict changes (or a
    # DotBF16Linear's packed weight): what collects the packed weights of many layers
    # (KernelLayers) checks one number, not every layer
    generation = 0
    packed = counted_packed()

    def __init__(self, linear: nn.Linear, ops, isa: str, batch_invariant: bool = False, bf16_dot: bool = False):
        super().__init__()
        self.ops, self.isa = ops, isa
        self.batch_invariant = batch_invariant
        self.timed_rows = DEFAULT_TIMED_ROWS  # row counts a plan would be timed for (invariance.measure_model)
        self._row_plan: tuple[int, RowPlan | None] = (0, None)
        self._padded = False  # the probe found this kernel row-dependent: run its row plan
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        # a bf16 model's weight on vdpbf16ps where the build has it (bf16_dot: the backend's
        # engine.cpu_bf16_kernel); a bf16-valued fp32 weight keeps fp32 arithmetic (its model's bits)
        dot = bf16_dot and w.dtype == torch.bfloat16 and ops.has_bf16_dot()
        self.packed = ops.pack_dot(w) if dot else ops.pack(_narrowest_lossless(w))
        self.bias = torch.empty(0) if linear.bias is None else linear.bias.detach().float()

    @property
    def _padded(self) -> bool:
        return self._padded_rows

    @_padded.setter
    def _padded(self, value: bool) -> None:
        self._padded_rows = value
        KernelLinear.generation += 1

    @property
    def weight(self) -> torch.Tensor:
        """The ``[N, K]`` weight in plain layout (a copy unpacked from the kernel's layout)."""
        nb, k, lanes = self.packed.shape
        if lanes == 32:  # pack_dot's layout: per block of 16 outputs, k pairs of (w[n, 2p], w[n, 2p + 1])
            return self.packed.view(nb, k, 16, 2).permute(0, 2, 1, 3).reshape(nb * 16, k * 2)[: self.out_features, : self.in_features].contiguous()
        return self.packed.transpose(1, 2).reshape(nb * lanes, k)[: self.out_features].contiguous()

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x2, self.packed, self.out_features, self.bias)

    def row_plan(self) -> RowPlan:
        """The probe's verdict for this kernel (expected: unpadded calls of ``MAX_ROW_BLOCK`` rows)."""
        threads = torch.get_num_threads()
        if self._row_plan[0] != threads:
            key = ("cpu_ops", self.isa, self.out_features, self.bias.numel() > 0, self.packed.shape[-1])  # the layout: pack or pack_dot
            plan = invariant_row_plan(self._mm, self.in_features, self.packed.dtype, key, self.timed_rows, persist=getattr(self.ops, "__file__", None))
            self._row_plan = (threads, plan)
            self._padded = self.batch_invariant and self._row_plan[1] != RowPlan(MAX_ROW_BLOCK)
        return self._row_plan[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._padded:  # only if the probe ever found the kernel row-dependent
            return self._row_plan[1].run(self._mm, x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        if x.dim() == 2:  # decode and verify rows: no reshapes (each torch op is ~2 us of a ~10 us call)
            return self.ops.linear(x, self.packed, self.out_features, self.bias)
        return self.ops.linear(x.reshape(-1, self.in_features), self.packed, self.out_features, self.bias).view(*x.shape[:-1], self.out_features)


def _narrowest_lossless(w: torch.Tensor) -> torch.Tensor:
    """``w`` as bfloat16 when that changes no value (fp32 weights of a bf16 checkpoint), else ``w``."""
    if w.dtype == torch.float32:
        narrow = w.to(torch.bfloat16)
        if torch.equal(narrow.float(), w):
            return narrow
    return w

"""Batch-invariant linear layers on accelerators (CUDA).

A GPU GEMM library picks its kernel by problem shape: one row may go to a GEMV, eight rows to a
tiled GEMM with another reduction order, so a token verified inside a draft tree can round
differently from the same token decoded alone, and greedy speculative output can drift from
plain greedy output. ``InvariantLinear`` runs ``F.linear`` under the same measured
``invariance.RowPlan`` as the CPU layers (``cpu_linear``): calls of at most as many rows as keep
a row's one-row bits, or calls padded to 8 or 16 rows, whichever is fastest for the engine's
typical forwards. Padding costs little there: at these row counts a GPU linear is bound by
reading the weight, not by the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .invariance import DEFAULT_TIMED_ROWS, RowPlan, invariant_row_plan


class InvariantLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.batch_invariant = True
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.timed_rows = DEFAULT_TIMED_ROWS  # row counts the plan is chosen for (invariance.measure_model)
        self._row_plan: tuple[tuple, RowPlan | None] = ((), None)

    def _mm(self, x2: torch.Tensor) -> torch.Tensor:
        return F.linear(x2, self.weight, self.bias)

    def row_plan(self) -> RowPlan:
        key = (self.timed_rows, torch.get_num_threads())
        if self._row_plan[0] != key:
            kernel = ("linear", self.weight.device.type, self.out_features, self.bias is not None)
            self._row_plan = (key, invariant_row_plan(self._mm, self.in_features, self.weight.dtype, kernel, self.timed_rows, self.weight.device))
        return self._row_plan[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        return self.row_plan().run(self._mm, x2).view(*x.shape[:-1], self.out_features)


def use_invariant_linears(module: nn.Module) -> int:
    """Swap every accelerator ``nn.Linear`` under ``module`` (not CPU, not meta) for an
    ``InvariantLinear``; returns how many were swapped. Tied weights stay shared."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type not in ("cpu", "meta"):
                setattr(parent, name, InvariantLinear(child))
                swapped += 1
    return swapped

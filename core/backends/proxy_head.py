"""A draft's lm_head at 4 bits, its best candidates rescored on the 8-bit codes.

A self-draft step (``draft_model_path=target``) on the demo streams ~66 MB of Q4_1 layer codes and
the Q8_0 lm_head's 30 MB for every draft token: a third of its bytes for one argmax. Requantizing
the head to 4 bits alone costs accept length (4.87 -> 4.01 tokens a step, session 47): the argmax
over 49k ids moves with the rounding. ``ProxyHead`` keeps both:

* the **proxy**: the head's weights requantized to 4 bits per block of 32 inputs (``w ~ d q + m``,
  ``d`` and ``m`` in fp16: Q4_1's form, on ``q8_ops``' 4-bit path with int8 activations), ~17 MB;
* the **rescoring**: the proxy's ``candidates`` best ids of each row get their logits recomputed
  in fp32 from the 8-bit codes (the row times those ids' dequantized weights).

Its logits are the proxy's, with the candidates' exact values written in. The argmax is the
8-bit head's whenever it is among the proxy's candidates; the rest of the row only shapes the
draft's probabilities (the scores confidence pruning calibrates). A draft never decides the
output -- the target verifies every token -- so this changes what a step costs and accepts,
never what it emits.
"""

from __future__ import annotations

import torch
from torch import nn

from . import huge_pages
from .q8_linear import BLOCK, Q8Linear, codes_by_output, dequantize, pack, scales_by_output


def requantize_4bit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> 4-bit codes [N, K] (0..15) and fp16-exact ``d``/``m`` [N, K/32] with
    ``w ~ d q + m`` per block of 32 inputs (min and range of the block, Q4_1's scheme)."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    lo, hi = blocks.amin(dim=2), blocks.amax(dim=2)
    m = lo.half().float()
    d = ((hi - m) / 15).half().float()
    # a rounded-down d could push the block's top past 15: the clamp keeps codes in range
    q = torch.where(d[..., None] > 0, torch.round((blocks - m[..., None]) / d.clamp_min(1e-30)[..., None]), torch.zeros_like(blocks))
    return q.clamp_(0, 15).reshape(n, k), d, m


class ProxyHead(nn.Module):
    """An lm_head: 4-bit proxy logits, the ``candidates`` best per row recomputed from ``head``'s
    8-bit codes (see the module docstring)."""

    computes_fp32 = True

    @staticmethod
    def eligible(head) -> bool:
        """An 8-bit ``Q8Linear`` head with symmetric blocks and no bias (the demo's Q8_0 head, a
        ``w8a8_int8`` one), on a ``q8_ops`` build that has ``rescore_best``. Not a ``W8A8Linear``
        (a subclass over ``w8a8_ops``' own code layout)."""
        return type(head) is Q8Linear and head.q8.bits == 8 and not head.q8.m.numel() and not head.bias.numel() and hasattr(head.ops, "rescore_best")

    def __init__(self, head: Q8Linear, candidates: int = 8):
        super().__init__()
        if not self.eligible(head):
            raise ValueError("ProxyHead rescores on an 8-bit Q8Linear head with symmetric blocks (w = d q) and no bias")
        self.in_features, self.out_features, self.candidates = head.in_features, head.out_features, candidates
        w = dequantize(head.q8)  # fp32 [V, K]: the 8-bit head's exact weights
        q, d, m = requantize_4bit(w)
        packed = pack(q, d, m, 4)
        packed.codes, packed.d, packed.m = huge_pages.relocate([packed.codes, packed.d, packed.m])  # streamed every draft token, as the head was
        self.proxy = Q8Linear(packed, None, head.ops, "proxy4")
        self.proxy.tile_ops = head.tile_ops
        # the 8-bit codes row-major for the rescoring's gathers: codes [V, K] int8, scales [V, K/32]
        self.codes, self.scales = codes_by_output(head.q8).contiguous(), scales_by_output(head.q8.d, head.out_features).contiguous()

    @property
    def weight(self) -> torch.Tensor:
        return (self.codes.float() * self.scales[..., None]).reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        logits = self.proxy(rows)
        if rows.shape[0] == 0:
            return logits.view(*x.shape[:-1], self.out_features)
        self.proxy.ops.rescore_best(logits, rows.contiguous(), self.codes, self.scales, self.candidates)
        return logits.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, 4-bit proxy + {self.candidates} candidates rescored on 8-bit codes"

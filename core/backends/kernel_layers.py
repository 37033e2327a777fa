"""``KernelLayers``: every decoder layer of a Llama-style model in one ``cpu_ops.decoder_layers``
call, for forwards over decode, tree and extend rows (no prompt prefill in the batch).

The per-op path (``DecoderLayer._forward_fused``) makes ~13 Python-side calls a layer: five kernel
calls, two norms, rope + KV write, the attention plan, reshapes, the residual add. On the 30-layer
demo target the one call saves 0.5-0.8 ms of a 9-17 ms fp32 forward (1.05-1.06x at 1 to 16 rows),
paid by every plain step, every verify and every forward of a standalone draft model. It runs the
same kernel functions in the same order inside C++, so its outputs have the per-op path's bits
(tests/unit/test_kernel_layers.py checks plain, tree and mixed batches, fp32 and bf16, and the
captured hidden states).

It applies only where the layers run their own forward (not ``engine.torch_compile``'s) and
every layer's four linears are ``KernelLinear`` on the same ``cpu_ops`` build (fp32/bf16 weights:
quantized or AMX/bf16_dot linears keep the per-op path), and checks that again before each
forward (a relocated or re-planned weight is picked up, never a stale one read).
"""

from __future__ import annotations

import torch

from .kernel_attention import KernelAttentionPlan
from .kernel_linear import KernelLinear

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class KernelLayers:
    def __init__(self, ops, layers):
        self.ops, self.layers = ops, list(layers)
        first = self.layers[0]
        self.eps = first.input_layernorm.eps
        self.n_heads, self.n_kv, self.scale = first.n_heads, first.n_kv, first.scale
        self.generation = KernelLinear.generation
        self.weights: list[torch.Tensor] = []
        for layer in self.layers:
            four = qkv, o, gate_up, down = [getattr(layer, name) for name in _LINEARS]
            widths = torch.tensor([lin.out_features for lin in four], dtype=torch.long)
            ln1, ln2 = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            self.weights += [ln1, qkv.packed, qkv.bias, o.packed, ln2, gate_up.packed, down.packed, widths]

    @staticmethod
    def eligible(ops, layers) -> bool:
        """Every layer runs its class's forward (not one replaced per instance, as
        ``engine.torch_compile`` does), has the four projections on ``ops``' ``KernelLinear``,
        unpadded, without a bias beyond qkv's, and one norm epsilon throughout."""
        if any("forward" in layer.__dict__ for layer in layers):
            return False
        eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
        if len(eps) != 1:
            return False
        for layer in layers:
            for name in _LINEARS:
                lin = getattr(layer, name, None)
                if not isinstance(lin, KernelLinear) or lin.ops is not ops or lin._padded:
                    return False
                if name != "qkv_proj" and lin.bias.numel():
                    return False
        return True

    def current(self) -> bool:
        """The weights collected at build time are still the ones the layers run (no packed weight
        replaced, no padding verdict changed since: one counter) and no layer's forward was
        replaced per instance. Swapping a layer's linear module for another after the first
        forward is not supported (backends swap them in ``prepare_target``, before any forward)."""
        return KernelLinear.generation == self.generation and not any("forward" in layer.__dict__ for layer in self.layers)

    @staticmethod
    def accepts(plan, rows: int) -> bool:
        """The forward's attention is the kernel's for every row (no prompt prefill through SDPA)."""
        return type(plan) is KernelAttentionPlan and not plan.prefills and plan.groups > 0 and plan.rows == rows

    def __call__(self, x: torch.Tensor, fb, kv, cos: torch.Tensor, sin: torch.Tensor, capture: tuple[int, ...]):
        """The hidden state after the last layer and ``{layer: hidden state entering it}``."""
        plan = fb.attn_plan
        L = len(self.layers)
        wanted = sorted({i for i in capture if i < L})
        out = self.ops.decoder_layers(
            x, self.weights, kv.k[:L], kv.v[:L], cos, sin, fb.out_slots, self.eps, self.scale, self.n_heads, self.n_kv,
            plan.prefix_ptr, plan.prefix_slots, plan.row_ptr, plan.row_q, plan.extra_ptr, plan.extra_slots, wanted,
        )  # fmt: skip
        return out[0], dict(zip(wanted, out[1:]))

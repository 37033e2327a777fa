"""``KernelLayers``: every decoder layer of a Llama-style model in one ``cpu_ops.decoder_layers``
call, for forwards over decode, tree and extend rows (no prompt prefill in the batch);
``KernelDraftLayer``: an EAGLE-family draft head's layer in one ``cpu_ops.draft_layer`` call,
for its extend passes and beam steps (~4 a draft step; the per-op path made ~12 Python-side calls
each).

The per-op path (``DecoderLayer._forward_fused``) makes ~13 Python-side calls a layer: five kernel
calls, two norms, rope + KV write, the attention plan, reshapes, the residual add. On the 30-layer
demo target the one call saves 0.5-0.8 ms of a 9-17 ms fp32 forward (1.05-1.06x at 1 to 16 rows),
paid by every plain step, every verify and every forward of a standalone draft model. It runs the
same kernel functions in the same order inside C++, so its outputs have the per-op path's bits
(tests/unit/test_kernel_layers.py checks plain, tree and mixed batches, fp32 and bf16, and the
captured hidden states).

It applies only where the layers run their own forward (not ``engine.torch_compile``'s) and
every layer's four linears are ``KernelLinear`` on the same ``cpu_ops`` build (fp32/bf16 weights),
or all ``DotBF16Linear`` on ``bf16_amx``'s AMX tiles (a bf16 model on an AMX CPU), or all
``Q8Linear`` of one ``q8_ops`` build (int8 activations x 4/8-bit codes:
``model.activation_quantization=int8``, a ``w8a8_int8`` draft), or all ``QuantLinear`` of one
``quant_ops`` build in fp32 layers (weight-only codes: ``model.quantization=gguf``, the fp32 bits
from the file's blocks). ``cpu_ops`` calls another build's linear through the address its
``linear_address()`` hands out. A draft head's layer (``KernelDraftLayer``) takes no weight-only
quantized linears. It checks that again before each forward (a relocated or re-planned weight is
picked up, never a stale one read).

On the AMX Xeon (family 6 model 167, session 35) the bf16 demo's per-op path spent ~3.6 ms of a
15.8 ms one-row forward outside its linears and attention: every ``DotBF16Linear`` call's row
plan, reshapes and module call (~15 us each, 121 a forward) and ~13 Python-side ops a layer.
"""

from __future__ import annotations

import torch

from .kernel_attention import KernelAttentionPlan
from .kernel_linear import KernelLinear
from .q8_linear import q8_build

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _kernel_linears(ops, linears) -> bool:
    """Every linear is ``ops``' ``KernelLinear``, unpadded, without a bias beyond the first's (qkv)."""
    for i, lin in enumerate(linears):
        if not isinstance(lin, KernelLinear) or lin.ops is not ops or lin._padded:
            return False
        if i and lin.bias.numel():
            return False
    return True


def _code_linears(linears, norm: torch.Tensor) -> bool:
    """Every linear is a ``Q8Linear`` of one ``q8_ops`` build (fp32 or bf16 layer: the one call
    rounds each linear's fp32 sums to the layer's dtype, as ``Q8Linear.forward`` does)."""
    from .q8_linear import Q8Linear

    if norm.dtype not in (torch.float32, torch.bfloat16) or not all(isinstance(lin, Q8Linear) for lin in linears):
        return False
    return len({id(lin.ops) for lin in linears}) == 1


def _code_weights(linears) -> list[torch.Tensor]:
    """``cpu_ops``' CodeLinears: codes, d, m, bias of each linear, then meta [8] (output widths,
    code widths)."""
    out = []
    for lin in linears:
        out += [lin.q8.codes, lin.q8.d, lin.q8.m, lin.bias]
    return out + [torch.tensor([lin.out_features for lin in linears] + [lin.q8.bits for lin in linears], dtype=torch.long)]


def _quant_linears(linears, norm: torch.Tensor) -> bool:
    """Every linear is a ``QuantLinear`` (weight-only codes: ``model.quantization``) of one
    ``quant_ops`` build, in an fp32 layer (a bf16 layer's per-op path rounds each output)."""
    from .quant_linear import QuantLinear

    if norm.dtype != torch.float32 or not all(type(lin) is QuantLinear for lin in linears):
        return False
    return len({id(lin.ops) for lin in linears}) == 1 and hasattr(linears[0].ops, "linear_address")


def _quant_weights(linears) -> list[torch.Tensor]:
    """``cpu_ops``' QuantLinears: codes, scale, minv, bias of each linear, then meta [20] (output
    widths, code widths, offsets, group sizes, fma_dq flags)."""
    out = []
    for lin in linears:
        out += [lin.qw.codes, lin.qw.scale, lin.qw.minv, lin.bias]
    qws = [lin.qw for lin in linears]
    meta = [lin.out_features for lin in linears] + [q.bits for q in qws] + [q.offset for q in qws] + [q.group for q in qws] + [int(q.fma_dq) for q in qws]
    return out + [torch.tensor(meta, dtype=torch.long)]


def _amx_linears(linears) -> bool:
    """Every linear is a ``DotBF16Linear`` on ``bf16_amx``'s tiles (one build), without a bias
    beyond the first's (qkv), run unpadded: its row plan (measured here if not yet) never pads, as
    it never does for a kernel invariant by construction, so one call over all rows gives each row
    the per-op path's bits."""
    from ..cpu_linear import DotBF16Linear
    from ..kernels import bf16_amx

    if not all(type(lin) is DotBF16Linear for lin in linears):
        return False  # (before bf16_amx(): no other model loads, or builds, the AMX kernel for this check)
    amx = bf16_amx()
    if amx is None or not all(lin.kernel is amx for lin in linears):
        return False
    if any(lin.bias.numel() for lin in linears[1:]):
        return False
    return all(not lin.batch_invariant or not lin.row_plan().pad for lin in linears)


def _packed_weights(linears) -> list[torch.Tensor]:
    """qkv packed, qkv bias, o packed, gate_up packed, down packed, widths [4] (``PackedLinears``
    without the norm between o and gate_up)."""
    qkv, o, gate_up, down = linears
    widths = torch.tensor([lin.out_features for lin in linears], dtype=torch.long)
    return [qkv.packed, qkv.bias, o.packed, gate_up.packed, down.packed, widths]


def _one_call_linears(ops, linears, norm: torch.Tensor) -> bool:
    return _kernel_linears(ops, linears) or _code_linears(linears, norm) or _amx_linears(linears)


def _linear_addresses(linears, norm: torch.Tensor) -> tuple[int, int]:
    """(q8 linear address, packed linear address) the one call runs ``linears`` through; (0, 0):
    ``cpu_ops``' own packed linears."""
    if _code_linears(linears, norm):
        return linears[0].ops.linear_address(), 0
    if _amx_linears(linears):
        return 0, linears[0].kernel.linear_address()
    return 0, 0


class KernelLayers:
    def __init__(self, ops, layers):
        self.ops, self.layers = ops, list(layers)
        first = self.layers[0]
        self.eps = first.input_layernorm.eps
        self.n_heads, self.n_kv, self.scale = first.n_heads, first.n_kv, first.scale
        self.generation = KernelLinear.generation
        first_four = [getattr(first, name) for name in _LINEARS]
        self.q8_linear, self.packed_linear = _linear_addresses(first_four, first.input_layernorm.weight)
        self.quant_linear = first_four[0].ops.linear_address() if _quant_linears(first_four, first.input_layernorm.weight) else 0
        tiles = getattr(first.qkv_proj, "tile_ops", None) if self.q8_linear else None
        self.q8_tile_linear = tiles.linear_address() if tiles is not None else 0  # forwards of TILE_ROWS rows or more
        self.weights: list[torch.Tensor] = []
        for layer in self.layers:
            four = [getattr(layer, name) for name in _LINEARS]
            ln1, ln2 = layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()
            if self.quant_linear:
                self.weights += [ln1, ln2, *_quant_weights(four)]
            elif self.q8_linear:
                self.weights += [ln1, ln2, *_code_weights(four)]
            else:
                qkv, qkv_bias, o, gate_up, down, widths = _packed_weights(four)
                self.weights += [ln1, qkv, qkv_bias, o, ln2, gate_up, down, widths]

    @staticmethod
    def eligible(ops, layers) -> bool:
        """Every layer runs its class's forward (not one replaced per instance, as
        ``engine.torch_compile`` does), has the four projections on ``ops``' ``KernelLinear``,
        unpadded, without a bias beyond qkv's (or all on one ``q8_ops`` build's ``Q8Linear``; or
        all on one ``quant_ops`` build's ``QuantLinear`` in fp32 layers; or all ``DotBF16Linear``
        on AMX tiles), and one norm epsilon throughout."""
        if any("forward" in layer.__dict__ for layer in layers):
            return False
        eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
        if len(eps) != 1:
            return False
        lins = [[getattr(layer, name, None) for name in _LINEARS] for layer in layers]
        if all(_code_linears(four, layer.input_layernorm.weight) for four, layer in zip(lins, layers)):
            return len({id(four[0].ops) for four in lins}) == 1  # one q8 build throughout: the call takes one address
        if all(_quant_linears(four, layer.input_layernorm.weight) for four, layer in zip(lins, layers)):
            return len({id(four[0].ops) for four in lins}) == 1  # one quant_ops build throughout
        if all(_amx_linears(four) for four in lins):
            return True
        return all(_kernel_linears(ops, four) for four in lins)

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
        q8_linear = q8_build(self.q8_linear, self.q8_tile_linear, x.shape[0])
        out = self.ops.decoder_layers(
            x, self.weights, kv.k[:L], kv.v[:L], cos, sin, fb.out_slots, self.eps, self.scale, self.n_heads, self.n_kv,
            plan.prefix_ptr, plan.prefix_slots, plan.row_ptr, plan.row_q, plan.extra_ptr, plan.extra_slots, wanted, q8_linear,
            self.packed_linear, self.quant_linear,
        )  # fmt: skip
        return out[0], dict(zip(wanted, out[1:]))


class KernelDraftLayer:
    """``DraftDecoderLayer``'s fused-projection forward (``_forward_fused``) as one kernel call: the
    same kernel functions in the same order, so the same bits (tests/unit/test_kernel_layers.py)."""

    def __init__(self, ops, layer):
        self.ops, self.layer = ops, layer
        self.eps, self.scale = layer.post_attention_layernorm.eps, layer.scale
        self.generation = KernelLinear.generation
        four = self._linears(layer)
        norm = layer.post_attention_layernorm.weight.detach()
        self.q8_linear, self.packed_linear = _linear_addresses(four, norm)
        if self.q8_linear:
            self.weights = [norm, *_code_weights(four)]
        else:
            qkv, qkv_bias, o, gate_up, down, widths = _packed_weights(four)
            self.weights = [qkv, qkv_bias, o, norm, gate_up, down, widths]

    @staticmethod
    def _linears(layer) -> list:
        return [layer.qkv_fused, layer.self_attn.o_proj, layer.gate_up_fused, layer.mlp.down_proj]

    @staticmethod
    def eligible(ops, layer) -> bool:
        """Fused projections (``fuse_projections``) on ``ops``' unpadded ``KernelLinear`` (or one
        ``q8_ops`` build's ``Q8Linear``; or ``DotBF16Linear`` on AMX tiles), and the layer's
        own forward (not one replaced per instance)."""
        if layer.qkv_fused is None or "forward" in layer.__dict__:
            return False
        return _one_call_linears(ops, KernelDraftLayer._linears(layer), layer.post_attention_layernorm.weight)

    def current(self) -> bool:
        """No packed weight replaced nor padding verdict changed since the weights were collected."""
        return KernelLinear.generation == self.generation and "forward" not in self.layer.__dict__

    accepts = staticmethod(KernelLayers.accepts)

    def __call__(self, attn_in: torch.Tensor, residual: torch.Tensor, fb, kv, rotary) -> torch.Tensor:
        plan = fb.attn_plan
        return self.ops.draft_layer(
            attn_in, residual, self.weights, kv.k[0], kv.v[0], rotary.cos, rotary.sin, fb.positions, fb.out_slots, self.eps, self.scale,
            self.layer.n_heads, self.layer.n_kv, plan.prefix_ptr, plan.prefix_slots, plan.row_ptr, plan.row_q, plan.extra_ptr, plan.extra_slots,
            self.q8_linear, self.packed_linear,
        )  # fmt: skip

"""``CpuBackend``: forwards on specfw's compiled CPU kernels (``kernels/cpu_ops.cpp``), built for
one instruction set (``engine.cpu_isa``: ``auto`` picks avx512 > avx2 > portable from the CPU's
flags; forcing ``avx2`` on an AVX-512 CPU tests and times that path there too).

* linears: ``KernelLinear`` for fp32 and bf16 weights (batch invariant by construction, flat
  from 1 to 16 rows as far as the memory/compute balance of the CPU allows); bf16 weights with
  ``engine.cpu_bf16_kernel`` go to ``DotBF16Linear``: AMX tiles (``bf16_amx.cpp``) where the CPU has
  AMX-BF16, else ``vdpbf16ps`` (``bf16_dot.cpp``) with AVX512-BF16 (also invariant by construction);
* attention: ``KernelAttentionPlan`` for every decode, tree and extend row (one fixed reduction
  order per (row, head), exact for plain and tree rows alike), one causal SDPA call per prompt
  prefill;
* quantized linears (``model.quantization`` for the target, ``speculative.draft_model_quantization``
  for draft modules and draft models): ``QuantLinear`` on ``kernels/quant_ops.cpp``
  (``quant_linear.py``; invariant by construction too);
* with ``model.activation_quantization=int8``, those quantized linears take int8 activations
  instead: ``Q8Linear`` on ``kernels/q8_ops.cpp`` (integer dot products; invariant by construction);
  ``speculative.draft_model_quantization=w8a8_int8`` does so for the draft's linears alone;
* no padded rows, no row plans: nothing depends on what else is in a forward;
* the packed weights of the target (and of each draft module) in one buffer on 2 MB pages
  (``huge_pages``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..cpu_linear import DotBF16Linear, bf16_kernel_available
from ..invariance import measure_linears
from . import huge_pages
from .base import Backend, HeadShape
from .greedy_head import GreedyHead
from .kernel_attention import KernelAttentionPlan
from .kernel_draft_step import KernelDraftStep
from .kernel_layers import KernelDraftLayer, KernelLayers
from .kernel_linear import KernelLinear
from .torch_ops import sdpa_plan
from .proxy_head import ProxyHead
from .q8_linear import TILE_ROWS, Q8Linear, supports as q8_supports
from .w8a8_linear import W8A8Linear, supports as w8a8_supports
from .quant_linear import QuantLinear, quantize, supports


class CpuBackend(Backend):
    name = "cpu"
    one_call_layers = True  # decoder_stack: all layers in one kernel call where they qualify (False: per layer, for A/B runs)
    one_call_drafts = True  # eagle3_draft: an EAGLE-3 head's draft step in one kernel call (False: the Python step, for A/B runs)
    greedy_heads = True  # greedy_head: greedy rows' lm_head through a bf16 copy and exact candidates (engine.cpu_greedy_head)
    greedy_head_proxy = "auto"  # its cheap copy: auto | bf16 | int8 (engine.cpu_greedy_head_proxy)

    def __init__(
        self,
        ops,
        isa: str,
        batch_invariant: bool = True,
        bf16_kernel: bool = True,
        quantization: str = "none",
        draft_quantization: str | None = None,
        activation_quantization: str = "none",
    ):
        super().__init__(torch.device("cpu"), batch_invariant)
        self.ops, self.isa = ops, isa
        self.bf16_kernel = bf16_kernel and bf16_kernel_available()
        self.quantization = quantization
        # draft modules: null = the target's scheme, unquant = none, w8a8_int8 = int8 with int8 activations
        draft = quantization if draft_quantization is None else draft_quantization.replace("unquant", "none")
        self.draft_quantization = "int8" if draft == "w8a8_int8" else draft
        # the drafts' activations: a per-token target's int8 drafts take its per-token kernels too;
        # a draft asked for quantized weights (gguf: blocks of its own, as the standalone self-draft's;
        # int8, int4) runs them with int8 activations, the fast CPU path for codes (weight-only int8
        # made the EAGLE-3 head's draft 1.7x slower than w8a8_int8, session 44; a draft's rounding
        # changes what is accepted, never the output)
        if draft_quantization is None and activation_quantization == "int8_per_token":
            self.draft_activations = "int8_per_token"
        else:
            self.draft_activations = "int8" if draft_quantization not in (None, "none", "unquant") or activation_quantization == "int8" else "none"
        self.qops = None
        if "none" != self.quantization or "none" != self.draft_quantization:
            from ..kernels import quant_ops

            self.qops = quant_ops(isa)
            if self.qops is None:
                raise RuntimeError("model.quantization: the quantized CPU kernels (kernels/quant_ops.cpp) could not be built")
        # draft linears with no GGUF blocks (EAGLE heads, a standalone draft model) follow a gguf
        # target's scheme as int8 when activations are int8: the speed was asked for, and a draft's
        # rounding changes what is accepted, never the output
        self.draft_fallback = "int8" if draft_quantization is None and quantization == "gguf" and activation_quantization == "int8" else None
        self.target_fallback: str | None = None  # the target's own linears without blocks stay unquantized
        self.activation_quantization, self.q8ops, self.q8tiles = activation_quantization, None, None
        if "int8" in (activation_quantization, self.draft_activations):
            from ..kernels import q8_isa, q8_ops

            self.q8ops = q8_ops(isa)
            if self.q8ops is None:
                raise RuntimeError("model.activation_quantization: the int8-activation CPU kernels (kernels/q8_ops.cpp) could not be built")
            # on an AMX-INT8 CPU, calls of TILE_ROWS rows or more (prompts, large trees) on the amx build's tiles
            self.q8tiles = q8_ops("amx") if q8_isa(isa) == "amx" else None
        self.w8a8ops = None
        if "int8_per_token" in (activation_quantization, self.draft_activations):
            from ..kernels import w8a8_isa, w8a8_ops

            self.w8a8ops = w8a8_ops(w8a8_isa(isa))
            if self.w8a8ops is None:
                raise RuntimeError("model.activation_quantization: the per-token int8 CPU kernels (kernels/w8a8_ops.cpp) could not be built")

    def linear_for(
        self, linear: nn.Linear, batch_invariant: bool, scheme: str = "none", fallback: str | None = None, activations: str | None = None
    ) -> nn.Module | None:
        """``fallback``: the scheme of a ``gguf`` linear that has no GGUF blocks (else unquantized);
        ``activations``: what a quantized linear's activations become, ``none``, ``int8`` (per block
        of 32) or ``int8_per_token`` (default: ``model.activation_quantization``)."""
        activations = self.activation_quantization if activations is None else activations
        w = linear.weight
        if type(linear) is not nn.Linear or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return None
        qw = None
        if scheme == "gguf" and not hasattr(linear, "gguf_weight") and fallback:
            scheme = fallback
        if scheme == "gguf" and hasattr(linear, "gguf_weight"):
            qw = linear.gguf_weight
        elif scheme in ("int8", "int4") and supports(linear, scheme):
            qw = quantize(linear.weight, scheme)
        if qw is not None:
            if activations == "int8_per_token" and self.w8a8ops is not None and w8a8_supports(qw):
                return W8A8Linear.from_quant_weight(qw, linear.bias, self.w8a8ops, scheme)
            if activations == "int8" and self.q8ops is not None and q8_supports(qw.in_features):
                q8 = Q8Linear.from_quant_weight(qw, linear.bias, self.q8ops, scheme)
                q8.tile_ops = self.q8tiles
                return q8
            return QuantLinear(qw, linear.bias, self.qops, scheme)
        if w.dtype == torch.bfloat16 and self.bf16_kernel and not self._dot_in_ops():
            return DotBF16Linear(linear, batch_invariant)
        return KernelLinear(linear, self.ops, self.isa, batch_invariant, bf16_dot=self.bf16_kernel)

    def _swap(self, module: nn.Module, batch_invariant: bool, scheme: str = "none", fallback: str | None = None, activations: str | None = None) -> nn.Module:
        if type(module) is nn.Linear:  # a bare layer (e.g. an FR-Spec lm_head)
            return self.linear_for(module, batch_invariant, scheme, fallback, activations) or module
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                fast = self.linear_for(child, batch_invariant, scheme, fallback, activations) if type(child) is nn.Linear else None
                if fast is not None:
                    setattr(parent, name, fast)
        return module

    def prepare_target(self, model: nn.Module) -> None:
        self._swap(model, self.batch_invariant, self.quantization, self.target_fallback)
        self._hand_backend(model)
        _onto_huge_pages(model)

    def prepare_module(self, module: nn.Module) -> nn.Module:
        self._hand_backend(module, self.for_draft_modules())
        module = self._swap(module, False, self.draft_quantization, self.draft_fallback, self.draft_activations)
        _onto_huge_pages(module)
        return module

    def for_drafting(self) -> "CpuBackend":
        """Also a draft model's own runner: its target is quantized with the draft scheme."""
        other = super().for_drafting()
        other.quantization, other.target_fallback = self.draft_quantization, self.draft_fallback
        other.activation_quantization = self.draft_activations
        return other

    def set_linear_prefetch(self, choice: str = "auto") -> bool:
        """``engine.cpu_linear_prefetch``: which row tiles of a multi-tile fp32/bf16-weight linear
        prefetch the next weight blocks (``cpu_ops.set_spread_prefetch``; one setting per kernel
        build, so per process). ``auto``: the build's default on this CPU (``default_spread_prefetch``:
        the first tile alone on Intel, every tile in turn elsewhere). Returns whether they spread
        (AVX2 and portable builds spread fp32 weights' prefetches only: bf16 weights are compute-bound
        there)."""
        from ..kernels import default_spread_prefetch

        spread = choice == "spread" or (choice == "auto" and default_spread_prefetch())
        self.ops.set_spread_prefetch(spread)
        return bool(self.ops.spread_prefetch())

    def fused_ops(self, dtype, intermediate: int):
        return self.ops if dtype in (torch.float32, torch.bfloat16) and intermediate % 16 == 0 else None

    def decoder_stack(self, model):
        # None (the per-layer path) where a layer has a linear of another kind (oneDNN's, or mixed kinds)
        if not self.one_call_layers:
            return None
        return self._per_model(model, "_kernel_layers", lambda: KernelLayers(self.ops, model.layers) if KernelLayers.eligible(self.ops, model.layers) else None)

    def draft_layer(self, layer):
        if not self.one_call_layers:
            return None
        return self._per_model(layer, "_kernel_draft_layer", lambda: KernelDraftLayer(self.ops, layer) if KernelDraftLayer.eligible(self.ops, layer) else None)

    def eagle3_draft(self, layer, embed, norm, lm_head, to_target):
        # the search's top-k is this build's top_logprobs, as the Python search's is (not portable's)
        if self.isa == "portable" or not self.one_call_drafts:
            return None
        one_call = self.draft_layer(layer)

        def build():
            if not KernelDraftStep.eligible(self.ops, one_call, embed, norm, lm_head):
                return None
            return KernelDraftStep(self.ops, one_call, embed, norm, lm_head, to_target)

        return self._per_model(layer, "_kernel_draft_step", build)

    def greedy_head(self, model):
        # 56 MB on the demo target for the bf16 copy of its head, 30 MB for the int8 one
        if not self.greedy_heads:
            return None
        head = model.lm_head

        def build():
            if GreedyHead.bf16_eligible(head):  # a head on bf16 weights: the int8 copy when asked for, else none
                # (auto leaves it off: in the engine the demo's bf16 head call took 1.19-1.27 ms with
                # the copy against ~1.26 ms whole, and end-to-end runs went either way, Zen 4)
                # (the scales are checked only then: unpacking the demo's head for them took ~0.1 s of startup)
                q8 = self._greedy_q8() if self.greedy_head_proxy == "int8" else None
                return GreedyHead(self.ops, head, q8=q8, q8_tiles=self._greedy_q8_tiles(q8)) if q8 is not None and GreedyHead.int8_eligible(head) else None
            if not GreedyHead.eligible(head):
                return None
            q8 = self._greedy_q8()
            if q8 is not None and GreedyHead.int8_eligible(head):
                return GreedyHead(self.ops, head, q8=q8, q8_tiles=self._greedy_q8_tiles(q8))
            return GreedyHead(self.ops, head, self._greedy_dot())

        return self._per_model(model, "_greedy_head", build)

    def proxy_head(self, head):
        return ProxyHead(head) if ProxyHead.eligible(head) else None

    def _greedy_q8(self):
        """``q8_ops`` for an int8 proxy of the greedy head (``engine.cpu_greedy_head_proxy``): with
        ``int8``, this ISA's build; with ``auto``, the avx512 and avx2 builds' (half the bf16 copy's
        bytes: the demo's head call from DRAM 0.71x the bf16 proxy's time at 1-4 rows on the Zen 4's
        avx512 build, 0.77x / 0.90x / 0.59x at 1 / 4 / 8 rows on its forced avx2 build); the
        portable build keeps the bf16 copy. None: the bf16 copy."""
        from ..kernels import q8_ops

        if self.greedy_head_proxy == "bf16" or (self.greedy_head_proxy == "auto" and self.isa not in ("avx512", "avx2")):
            return None
        return q8_ops(self.isa)

    def _greedy_q8_tiles(self, q8):
        """``q8_ops``' AMX-INT8 tile build for the int8 proxy's calls of ``TILE_ROWS`` rows or more
        (the same bits as ``q8``, the avx512 build), where the CPU has AMX-INT8; else None. The demo's
        head proxy (30 MB) at 16 / 32 / 64 rows, AMX Xeon (session 64): see docs/benchmarks.md."""
        from ..kernels import q8_isa, q8_ops

        return q8_ops("amx") if q8_isa(self.isa) == "amx" and q8 is q8_ops(self.isa) else None

    def _greedy_dot(self):
        """``bf16_dot`` for the greedy head's proxy where it runs (AVX512-BF16, the avx512 build,
        ``engine.cpu_bf16_kernel``); a forced AVX2 / portable build keeps that build's own path."""
        from ..kernels import bf16_dot

        return bf16_dot() if self.isa == "avx512" and self.bf16_kernel else None

    def _dot_in_ops(self) -> bool:
        """bf16 linears on this build's own vdpbf16ps path (``KernelLinear`` in ``bf16_dot``'s layout,
        eligible for the one-call layers) rather than ``DotBF16Linear``: the avx512 build with
        AVX512-BF16, where the CPU has no AMX (AMX tiles stay ``bf16_amx``'s)."""
        from ..kernels import bf16_amx

        return self.ops.has_bf16_dot() and bf16_amx() is None

    def _per_model(self, model, key: str, build):
        """What ``build()`` makes for ``model``, kept in its ``__dict__`` under ``key``: built once
        per model and kernel build, rebuilt when its ``current()`` says a weight was replaced."""
        entry = model.__dict__.get(key)
        if entry is not None and entry[0] is self.ops and (entry[1] is None or entry[1].current()):
            return entry[1]
        made = build()
        model.__dict__[key] = (self.ops, made)
        return made

    def top_logprobs(self, logits, k):
        # one kernel call (~9 us for 4 rows of 8,192 on AVX-512) instead of log_softmax + topk +
        # stack (~40 us); the portable build's scalar exp is no faster than torch's
        if self.isa != "portable" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.device.type == "cpu":
            return self.ops.top_logprobs(logits, k)
        return super().top_logprobs(logits, k)

    def native_plan(self, seqs, device, shape: HeadShape, exact: bool):
        if shape.dtype not in (torch.float32, torch.bfloat16):  # float16: the kernel has no path, torch's SDPA does
            return sdpa_plan(seqs, device, shape, exact)
        return KernelAttentionPlan(self.ops, seqs, prefills_in_kernel=self.cache_exact_prefills)

    def measure(self, model, dtype, timed_rows):
        return {"linears": measure_linears(model, timed_rows), "attention": f"cpu_ops {self.isa} (exact by construction)"}

    def describe(self) -> str:
        bf16 = ""
        if self.bf16_kernel:
            from ..kernels import bf16_amx

            bf16 = ", bf16 linears on AMX tiles" if bf16_amx() is not None else ", bf16 linears on vdpbf16ps (AVX512-BF16)"
        if self.ops.amx_attention_on():
            bf16 += ", bf16 attention (head dim 64) on AMX tiles"
        quant = f", weights {self.quantization}" if self.quantization != "none" else ""
        tiles = f", AMX tiles from {TILE_ROWS} rows" if self.q8tiles is not None else ""
        quant += f", int8 activations ({self.q8ops.isa()}{tiles})" if self.activation_quantization == "int8" else ""
        quant += f", int8 activations per token ({self.w8a8ops.isa()})" if self.activation_quantization == "int8_per_token" else ""
        draft = f", draft weights {self.draft_quantization}" if self.draft_quantization != self.quantization else ""
        draft += ", int8 draft activations" if self.draft_activations == "int8" and self.activation_quantization != "int8" else ""
        draft += f", draft weights without GGUF blocks {self.draft_fallback}" if self.draft_fallback else ""
        return f"specfw CPU kernels ({self.isa}{bf16}{quant}{draft}{self.attention_note()})"


def _onto_huge_pages(module: nn.Module) -> None:
    """Every streamed weight moved into one huge-page buffer (``huge_pages``): ``KernelLinear``'s
    and ``DotBF16Linear``'s packed weight, ``Q8Linear``'s (and ``W8A8Linear``'s) codes and scales,
    ``QuantLinear``'s. On the AMX Xeon (THP ``madvise``) 4 KB pages cost the demo's gguf +
    int8-activation linears 1.32x at one row (session 32), its bf16 linears on AMX tiles 1.06x
    (session 35)."""
    kernel = [m for m in module.modules() if isinstance(m, (KernelLinear, DotBF16Linear))]
    codes = [m for m in module.modules() if isinstance(m, Q8Linear)]
    quant = [m for m in module.modules() if isinstance(m, QuantLinear)]
    tensors = [m.packed for m in kernel]
    tensors += [t for m in codes for t in (m.q8.codes, m.q8.d, m.q8.m)]
    tensors += [t for m in quant for t in (m.qw.codes, m.qw.scale, m.qw.minv)]
    moved = iter(huge_pages.relocate(tensors))
    for m in kernel:
        m.packed = next(moved)
    for m in codes:
        m.q8 = replace(m.q8, codes=next(moved), d=next(moved), m=next(moved))
    for m in quant:
        m.qw = replace(m.qw, codes=next(moved), scale=next(moved), minv=next(moved))

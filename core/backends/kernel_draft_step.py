"""``KernelDraftStep``: a greedy draft step of an EAGLE-3-layout head -- the extend pass over each
request's pending pairs, then EAGLE-2's beam search -- in one ``cpu_ops.eagle3_draft`` call.

The Python step (``speculative/feature_drafter.py``, ``speculative/beam.py``) makes ~25 Python-side
ops a head forward (the beams' tree mask, slot lists and ``ForwardBatch``, the attention plan, the
embedding, norms, cat, layer, final norm, lm_head, top-k, then the expansion): on the Zen 4 EPYC
~0.25 ms each next to ~0.4 ms of head kernels, and the auto shape makes 3-5 head forwards a step.
The one call runs the same kernel functions in the Python path's order (so the same logits) and
the same selection (so the same candidates, in the same order; tests/unit/test_kernel_draft_step.py).

The head's layout is EAGLE-3's (``plugins/eagle3/model.py``): attention input
``cat(input_layernorm(embed(t)), hidden_norm(h))``, residual ``h`` (the target's projected
feature in the extend pass, the parent's output hidden in a beam step), the final ``norm`` and an
``lm_head`` over the draft vocabulary, ``to_target`` mapping it to target ids. It applies where
that layer runs in one ``KernelDraftLayer`` call, the lm_head is an unpadded ``KernelLinear`` of the
same ``cpu_ops`` build or a ``Q8Linear`` (``draft_model_quantization=w8a8_int8``: int8 activations,
called by address as the layer's are) and the embedding a plain table in fp32 / bf16; anything
else keeps the Python step. The caller allocates the beam nodes' draft KV slots (``topk * (num_steps - 1)`` a
request) and frees them after the call, as ``beam_search`` frees its own.
"""

from __future__ import annotations

import torch
from torch import nn

from .kernel_layers import KernelDraftLayer
from .kernel_linear import KernelLinear
from .q8_linear import TILE_ROWS, Q8Linear

_NONE = torch.empty(0)
_NO_IDS = torch.empty(0, dtype=torch.long)


class KernelDraftStep:
    def __init__(self, ops, one_call: KernelDraftLayer, embed: nn.Embedding, norm, lm_head: KernelLinear | Q8Linear, to_target: torch.Tensor | None):
        self.ops, self.one_call, self.lm_head = ops, one_call, lm_head
        layer = one_call.layer
        self.embed = embed.weight.detach().contiguous()  # rows read in place by the call
        self.norms = [n.weight.detach() for n in (layer.input_layernorm, layer.hidden_norm, norm)]
        self.norm_eps = [float(n.eps) for n in (layer.input_layernorm, layer.hidden_norm, norm)]
        self.to_target = _NO_IDS if to_target is None else to_target.to(torch.long).contiguous()
        self.generation = KernelLinear.generation
        if type(lm_head) is Q8Linear:  # fp32 rows in, fp32 sums out (sdk.draft_logits' computes_fp32 path)
            w = lm_head.q8
            self.lm = ([w.codes, w.d, w.m, lm_head.bias], w.bits, lm_head.ops.linear_address())
        else:
            self.lm = ([lm_head.packed, lm_head.bias], 0, 0)
        # q8_ops' AMX-INT8 tile builds, for the call's layer / lm_head passes of TILE_ROWS rows or
        # more (a batch's beam steps and extend passes), as Q8Linear.forward and KernelLayers take them
        layer_tiles = getattr(KernelDraftLayer._linears(layer)[0], "tile_ops", None) if one_call.q8_linear else None
        lm_tiles = getattr(lm_head, "tile_ops", None) if type(lm_head) is Q8Linear else None
        self.tiles = (layer_tiles.linear_address() if layer_tiles is not None else 0, lm_tiles.linear_address() if lm_tiles is not None else 0, TILE_ROWS)

    @staticmethod
    def eligible(ops, one_call, embed, norm, lm_head) -> bool:
        """The layer in one call with an EAGLE-3 layout (input and hidden norms), a plain embedding
        table in fp32 / bf16 and an unpadded ``KernelLinear`` lm_head on ``ops`` or a ``Q8Linear``
        one. A ``Q8Linear``'s tile build (AMX-INT8) takes the call's passes of ``TILE_ROWS`` rows or
        more, its ``ops`` build (vpdpbusd) the others: the same bits either way."""
        if not isinstance(one_call, KernelDraftLayer):
            return False
        layer = one_call.layer
        if not all(hasattr(layer, n) for n in ("input_layernorm", "hidden_norm")) or not hasattr(norm, "eps"):
            return False
        if type(embed) is not nn.Embedding or "forward" in embed.__dict__ or embed.weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        if "forward" in lm_head.__dict__:
            return False
        return type(lm_head) is Q8Linear or (type(lm_head) is KernelLinear and lm_head.ops is ops and not lm_head._padded)

    def current(self) -> bool:
        """No packed weight replaced nor padding verdict changed since this was built."""
        return KernelLinear.generation == self.generation and self.one_call.current()

    def __call__(self, committed, roots, beam_slots, kv, rotary, topk: int, num_steps: int, score_floor: float, keep: int | None, extend=None, first=None):
        """(tokens, parents, scores, counts): every request's candidates as ``beam_search`` returns
        them, one request after another. ``committed``: each request's draft KV slots (its pending
        pairs' last, with ``extend``); ``roots``: each root's rope position; ``beam_slots`` [R,
        topk * (num_steps - 1)]: free draft KV slots. ``extend``: (ForwardBatch of the pending
        pairs, their projected features) -- the pass runs inside the call; else ``first``: (logits,
        hidden) at each request's root."""
        layer, oc = self.one_call.layer, self.one_call
        if extend is not None:
            fb, features = extend
            ext = (fb.input_ids, features, fb.positions, fb.out_slots, [s.q_len for s in fb.seqs], _NONE, _NONE)
        else:
            ext = (_NO_IDS, _NONE, _NO_IDS, _NO_IDS, [], first[0].float(), first[1])
        return self.ops.eagle3_draft(
            *ext, committed, roots, beam_slots, self.embed, *self.norms, self.norm_eps,
            oc.weights, kv.k[0], kv.v[0], rotary.cos, rotary.sin, oc.eps, oc.scale, layer.n_heads, layer.n_kv, oc.q8_linear, oc.packed_linear,
            self.lm[0], self.lm_head.out_features, self.lm[1], self.lm[2], self.to_target, topk, num_steps, float(score_floor), keep or 0,
            *self.tiles,
        )  # fmt: skip

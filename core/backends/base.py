"""The backend contract: one object per device kind owns every kernel choice of a forward.

The model, the runner, the KV pool and the plugins never pick kernels or carry kernel flags;
they ask the engine's backend (``ModelRunner.backend``):

* ``prepare_target(model)`` -- swap the target's linears for this device's kernels (batch
  invariant ones when ``batch_invariant``) and hand the model the backend
  (``model.backend``); ``measure(model, dtype, timed_rows)`` then runs the invariance probes
  at startup and returns a summary for the log;
* ``prepare_module(module)`` -- the same for a drafter's modules (draft heads need no batch
  invariance: their numerics change which tokens are proposed, never which are emitted);
  modules that attend and declare a ``backend`` attribute get this backend;
* ``plan_attention(seqs, device, shape, exact)`` -- once per forward: an ``AttentionPlan`` that
  every layer calls as ``plan(q, k_cache, v_cache, scale)``; ``exact`` asks that a row's bits
  never depend on the other rows (tree rows round like the plain decode step of the same token).
  ``attention`` (``model.attention_backend``, resolved) picks a named kernel family
  (``attention_backends``: torch, triton, flashinfer) or ``native`` -- the backend's own
  ``native_plan``; draft modules get ``draft_attention`` (``speculative.draft_attention_backend``);
* ``forward_rows(T, dtype)`` -- how many rows to run a forward of ``T`` tokens with (extra rows
  are padding written to the KV pool's scratch slot; most backends pad nothing).

Backends: ``CpuBackend`` (``backends/cpu.py``: specfw's compiled kernels for one instruction
set) and ``TorchBackend`` (``backends/torch_ops.py``: torch's own ops -- accelerators, and CPUs
where the kernels cannot be built or ``engine.cpu_isa=none``). ``make_backend`` picks one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..forward_batch import SeqSpan


@dataclass(frozen=True)
class HeadShape:
    """What an attention plan needs to know of the layers it serves."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int


class AttentionPlan(Protocol):
    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, D] (rope applied); caches [slots, Hkv, D] already hold the new K/V -> [T, H, D]."""


def torch_top_logprobs(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``Backend.top_logprobs`` on torch's ops (any device)."""
    v, ix = torch.topk(torch.log_softmax(logits.float(), -1), k)
    return torch.stack([v, ix.float()])


class Backend:
    name = "base"

    def __init__(self, device: torch.device, batch_invariant: bool):
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.attention = "native"  # model.attention_backend, resolved (attention_backends.resolve)
        self.draft_attention: str | None = None  # speculative.draft_attention_backend, resolved; None = as attention
        # a prompt's rows get the same bits whether its prefix is in the same forward or came from the
        # prefix cache (set with the cache on and batch_invariant; backends that can honour it do)
        self.cache_exact_prefills = False

    def set_attention(self, target: str | None, draft: str | None = None) -> "Backend":
        from .attention_backends import resolve

        self.attention = resolve(target, self.device)
        self.draft_attention = None if draft is None else resolve(draft, self.device)
        return self

    def prepare_target(self, model: nn.Module) -> None:
        raise NotImplementedError

    def prepare_module(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError

    def plan_attention(self, seqs: list[SeqSpan], device: torch.device, shape: HeadShape, exact: bool) -> AttentionPlan:
        if self.attention != "native":
            from .attention_backends import named_plan

            return named_plan(self.attention, seqs, device, shape, exact)
        return self.native_plan(seqs, device, shape, exact)

    def native_plan(self, seqs: list[SeqSpan], device: torch.device, shape: HeadShape, exact: bool) -> AttentionPlan:
        raise NotImplementedError

    def fused_ops(self, dtype: torch.dtype, intermediate: int):
        """Fused per-row layer glue (``add_rms_norm``, ``rope_write``, ``silu_mul``, as in
        ``kernels/cpu_ops.cpp``) for this dtype and MLP width, or None: the model's torch ops."""
        return None

    def decoder_stack(self, model: nn.Module):
        """A callable that runs all of ``model``'s decoder layers in one call for the forwards it
        ``accepts`` (``KernelLayers``: same bits as the per-layer path), or None: the per-layer path."""
        return None

    def draft_layer(self, layer: nn.Module):
        """A callable that runs a draft head's decoder layer (``DraftDecoderLayer``, fused
        projections) in one call for the forwards it ``accepts`` (``KernelDraftLayer``: same bits
        as the per-op path), or None: the per-op path."""
        return None

    def eagle3_draft(self, layer: nn.Module, embed: nn.Module, norm: nn.Module, lm_head: nn.Module, to_target: torch.Tensor | None):
        """A callable running a greedy draft step of an EAGLE-3-layout head (``layer`` with its
        input and hidden norms, the target's ``embed``, the final ``norm``, ``lm_head`` over the
        draft vocabulary, ``to_target`` its map to target ids) -- the extend pass, then EAGLE-2's
        beam search -- in one call, with the Python step's candidates (``KernelDraftStep``), or
        None: the Python step."""
        return None

    def greedy_head(self, model: nn.Module):
        """An object for ``model``'s lm_head over rows read only for their argmax
        (``ForwardBatch.greedy_only``), or None: the full lm_head. Its ``select(rows)`` returns
        (logits whose argmax and the value there are the full product's, other entries -inf;
        each row's argmax as a list, or None where it did not find them), and calling it returns
        the logits alone (``GreedyHead``)."""
        return None

    def proxy_head(self, head: nn.Module) -> nn.Module | None:
        """A cheaper stand-in for a draft model's lm_head ``head`` (``ProxyHead``: a 4-bit copy, its
        best candidates per row rescored on the head's 8-bit codes), or None where this backend
        has none for it. Only drafts take it: its logits are not the head's."""
        return None

    def top_logprobs(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """Each row's ``k`` best log-softmax values and their ids (as floats: exact below 2^24),
        best first, as one ``[2, rows, k]`` tensor: the draft loop reads it back in one copy."""
        return torch_top_logprobs(logits, k)

    def forward_rows(self, T: int, dtype: torch.dtype) -> int:
        return T

    def measure(self, model: nn.Module, dtype: torch.dtype, timed_rows: tuple[int, ...]) -> dict:
        return {}

    def describe(self) -> str:
        return self.name + self.attention_note()

    def attention_note(self) -> str:
        """``, attention <name>`` where ``model.attention_backend`` named one (and the draft's)."""
        note = f", attention {self.attention}" if self.attention != "native" else ""
        if self.draft_attention not in (None, self.attention):
            note += f", draft attention {self.draft_attention}"
        return note

    def for_drafting(self) -> "Backend":
        """This backend's kernels without batch invariance, attention as ``draft_attention``: for a
        draft model's own runner."""
        other = copy.copy(self)
        other.batch_invariant = False
        other.attention = self.draft_attention or self.attention
        return other

    def for_draft_modules(self) -> "Backend":
        """The backend a drafter's modules attend with (``prepare_module``): this one, or a copy
        with ``draft_attention`` where it differs."""
        if self.draft_attention is None or self.draft_attention == self.attention:
            return self
        other = copy.copy(self)
        other.attention = self.draft_attention
        return other

    def _hand_backend(self, module: nn.Module, backend: "Backend | None" = None) -> None:
        """Modules that attend declare a ``backend`` attribute and get ``backend`` (default this
        one); modules with a ``fuse_projections()`` (draft layers) fuse their projections first, so
        the fused linears get this backend's kernels too."""
        for m in list(module.modules()):
            if hasattr(m, "fuse_projections"):
                m.fuse_projections()
            if hasattr(m, "backend"):
                m.backend = backend or self

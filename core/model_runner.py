"""Model runner: owns the target model and its KV pool on the model's device; turns sequences
into ForwardBatches (built on the host) and runs them on the device."""

from __future__ import annotations

import dataclasses
import logging

import torch

from .backends import Backend, default_backend as plain_or_kernels
from .forward_batch import ForwardBatch, ForwardOutput, SeqSpan
from .kv_cache import KVPool
from .tp.kv import ShardedKVPool

logger = logging.getLogger(__name__)
PLAIN_BATCH_ROWS = 8  # a typical plain decode batch, for choosing batch-invariant row plans


class ModelRunner:
    def __init__(
        self,
        model,
        hf_config,
        num_slots: int,
        dtype: torch.dtype,
        backend: Backend | None = None,
        timed_rows: tuple[int, ...] = (1, PLAIN_BATCH_ROWS),
        tp=None,
        kv: KVPool | None = None,
    ):
        """``backend`` (``specfw.backends``) owns every kernel choice; default: the best for the
        model's device, not batch invariant. ``timed_rows``: the row counts of typical forwards,
        for which a backend that needs row plans (torch's ops) picks the fastest one: one-row
        decode steps and either a batch of concurrent ones (plain decoding) or a draft tree
        (speculative: ``num_draft_tokens``). The runner works on the device the model's weights are on.
        ``tp``: the leader's ``TPGroup`` when the model is a shard (``model.tp_size`` > 1): every
        forward and KV move then runs on every rank (``specfw.tp``). ``kv``: another runner's pool
        to read and write instead of a new one of ``num_slots`` (a draft of the target's own
        architecture on the target's KV: the standalone self-draft); its slots come from that
        pool's allocator."""
        self.device = next(model.parameters()).device
        self.backend = backend or plain_or_kernels(self.device)
        self.backend.prepare_target(model)
        if self.backend.batch_invariant and self.device.type != "meta":
            logger.info(
                "batch invariance on %s with %s (rows per linear call: layers): %s",
                self.device,
                self.backend.describe(),
                self.backend.measure(model, dtype, timed_rows),
            )
        self.model = model
        self.hf_config = hf_config
        layer0 = model.layers[0]
        self.tp = tp
        pool = KVPool if tp is None else ShardedKVPool
        if kv is not None:
            shape = (model.num_layers, layer0.n_kv, layer0.head_dim)
            theirs = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
            if tp is not None or shape != theirs or kv.dtype != dtype:
                raise ValueError(f"a shared KV pool needs one rank, the same layers, KV heads and head dim {theirs} and dtype {kv.dtype}: got {shape}, {dtype}")
            self.kv = kv
        else:
            self.kv = pool(model.num_layers, layer0.n_kv, layer0.head_dim, num_slots, dtype=dtype, device=self.device)
        if tp is not None:
            self.kv.group = tp
        self.vocab_size = hf_config.vocab_size
        self.max_context = model.rotary.cos.shape[0]
        self.graphs = None  # specfw.graphs.GraphedForward once enable_graphs() ran

    def enable_graphs(self, max_rows: int, capture: bool = True) -> None:
        """Decode and verify forwards of up to ``max_rows`` rows from static buffers, replayed
        from CUDA graphs on CUDA (``capture``; captured on first use per row bucket). Needs the
        Triton attention (``model.attention_backend=triton``) and one rank."""
        from .graphs import GraphedForward

        if self.backend.attention != "triton" or self.tp is not None:
            raise ValueError("engine.cuda_graph_max_bs: CUDA graphs need model.attention_backend=triton and model.tp_size=1")
        self.graphs = GraphedForward(self, max_rows, capture)

    @property
    def allocator(self):
        return self.kv.allocator

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """A drafter's module made ready to run beside the target: moved to the runner's device,
        with the backend's kernels (its linears; attention for layers with a ``backend``
        attribute). Draft heads need no batch invariance (their numerics change which tokens are
        proposed, never which are emitted)."""
        return self.backend.prepare_module(module.to(self.device))

    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        if self.graphs is not None and self.graphs.eligible(fb):
            out = self.graphs.run(fb)
            if out is not None:
                return out
        T = fb.num_tokens
        padded = self.backend.forward_rows(T, self.kv.dtype)
        if padded != T:
            fb = _pad(fb, padded, self.kv.scratch_slot)
        if self.tp is None:
            out = self.model(fb.to(self.device), self.kv)
        else:
            with self.tp.running("forward", dataclasses.replace(fb, attn_plan=None)):
                out = self.model(fb.to(self.device), self.kv)
        if padded != T:
            out.hidden = out.hidden[:T]
            out.aux_hidden = [a[:T] for a in out.aux_hidden]
        return out


def _pad(fb: ForwardBatch, rows: int, scratch_slot: int) -> ForwardBatch:
    """Append dummy rows (token 0, position 0, KV written to the scratch slot, no attention, no logits)."""
    n = rows - fb.num_tokens
    pad = torch.zeros(n, dtype=torch.long)
    return ForwardBatch(
        input_ids=torch.cat([fb.input_ids, pad]),
        positions=torch.cat([fb.positions, pad]),
        out_slots=torch.cat([fb.out_slots, torch.full((n,), scratch_slot, dtype=torch.long)]),
        seqs=fb.seqs,
        logits_indices=fb.logits_indices if fb.logits_indices is not None else torch.arange(fb.num_tokens),
        capture_layers=fb.capture_layers,
    )


def build_forward_batch(
    chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
    last_only: bool = False,
    capture_layers: tuple[int, ...] = (),
    greedy_only: bool = False,
) -> ForwardBatch:
    """Assemble a ForwardBatch from per-sequence chunks.

    Each chunk is ``(new_ids, positions, new_slots, prefix_slots, tree_mask)``. With
    ``last_only`` only the last token of every sequence gets logits (prefill); ``greedy_only``:
    see ``ForwardBatch``."""
    ids, pos, slots, seqs, last = [], [], [], [], []
    start = 0
    for new_ids, positions, new_slots, prefix_slots, tree_mask in chunks:
        n = int(new_ids.numel())
        ids.append(new_ids)
        pos.append(positions)
        slots.append(new_slots)
        seqs.append(SeqSpan(q_start=start, q_len=n, kv_slots=torch.cat([prefix_slots, new_slots]), tree_mask=tree_mask))
        start += n
        last.append(start - 1)
    return ForwardBatch(
        input_ids=torch.cat(ids),
        positions=torch.cat(pos),
        out_slots=torch.cat(slots),
        seqs=seqs,
        logits_indices=torch.tensor(last, dtype=torch.long) if last_only else None,
        capture_layers=capture_layers,
        greedy_only=greedy_only,
    )

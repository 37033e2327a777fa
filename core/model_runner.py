"""Model runner: owns the target model and its KV pool on the model's device; turns sequences
into ForwardBatches (built on the host) and runs them on the device."""
from __future__ import annotations

import logging

import torch

from .cpu_linear import fast_linear_for, use_fast_linears
from .device_linear import use_invariant_linears
from .forward_batch import ForwardBatch, ForwardOutput, SeqSpan
from .invariance import measure_model
from .kv_cache import KVPool

logger = logging.getLogger(__name__)
PLAIN_BATCH_ROWS = 8   # a typical plain decode batch, for choosing batch-invariant row plans


class ModelRunner:
    def __init__(self, model, hf_config, num_slots: int, dtype: torch.dtype, packed_gemm: bool = True,
                 batch_invariant: bool = False, timed_rows: tuple[int, ...] = (1, PLAIN_BATCH_ROWS),
                 bf16_kernel: bool = True):
        """``timed_rows``: the row counts of typical forwards, for which batch-invariant linears
        pick the fastest row plan (``invariance``): one-row decode steps and either a batch of
        concurrent ones (plain decoding) or a draft tree (speculative: ``num_draft_tokens``).
        The runner works on the device the model's weights are on. ``bf16_kernel``: bf16 linears
        use specfw's AVX512-BF16 kernel where it runs (``cpu_linear.DotBF16Linear``)."""
        self.device = next(model.parameters()).device
        self.packed_gemm = packed_gemm and self.device.type == "cpu"
        self.bf16_kernel = bf16_kernel
        if self.packed_gemm:
            use_fast_linears(model, batch_invariant, bf16_kernel)
        elif batch_invariant:
            use_invariant_linears(model)
        model.batch_invariant = batch_invariant
        if batch_invariant and self.device.type != "meta":
            logger.info("batch invariance on %s (rows per linear call: layers): %s", self.device,
                        measure_model(model, dtype, timed_rows, self.device))
        self.model = model
        self.hf_config = hf_config
        layer0 = model.layers[0]
        self.kv = KVPool(model.num_layers, layer0.n_kv, layer0.head_dim, num_slots, dtype=dtype, device=self.device)
        self.vocab_size = hf_config.vocab_size
        # see padded_rows (padding rows never changes the real rows: packed GEMM rows are
        # row-count invariant); oneDNN bf16 is flat over small row counts, no padding needed
        self.pad_rows = dtype == torch.float32 and self.device.type == "cpu"
        self.max_context = model.rotary.cos.shape[0]

    @property
    def allocator(self):
        return self.kv.allocator

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """A drafter's module made ready to run beside the target: moved to the runner's device,
        with the CPU's faster linears where the target has them. Draft heads need no batch
        invariance (their numerics change which tokens are proposed, never which are emitted)."""
        module = module.to(self.device)
        if self.packed_gemm:
            use_fast_linears(module, bf16_kernel=self.bf16_kernel)
            if type(module) is torch.nn.Linear:   # a bare layer (e.g. an FR-Spec lm_head)
                module = fast_linear_for(module, bf16_kernel=self.bf16_kernel) or module
        return module

    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        T = fb.num_tokens
        padded = padded_rows(T) if self.pad_rows else T
        if padded == T:
            return self.model(fb.to(self.device), self.kv)
        out = self.model(_pad(fb, padded, self.kv.scratch_slot).to(self.device), self.kv)
        out.hidden = out.hidden[:T]
        out.aux_hidden = [a[:T] for a in out.aux_hidden]
        return out


def padded_rows(T: int) -> int:
    """Row count to run a forward with. MKL's fp32 GEMM on these CPUs is much slower for some small
    row counts than for the next multiple of 8 (measured, 1 thread, 576x3072: M=6 2.2 ms, M=8 1.3 ms,
    M=12 2.4 ms, M=16 1.7 ms), so 5..32 rows are padded up to a multiple of 8."""
    if T <= 4 or T > 32 or T % 8 == 0:
        return T
    return (T + 7) // 8 * 8


def _pad(fb: ForwardBatch, rows: int, scratch_slot: int) -> ForwardBatch:
    """Append dummy rows (token 0, position 0, KV written to the scratch slot, no attention, no logits)."""
    n = rows - fb.num_tokens
    pad = torch.zeros(n, dtype=torch.long)
    return ForwardBatch(
        input_ids=torch.cat([fb.input_ids, pad]), positions=torch.cat([fb.positions, pad]),
        out_slots=torch.cat([fb.out_slots, torch.full((n,), scratch_slot, dtype=torch.long)]), seqs=fb.seqs,
        logits_indices=fb.logits_indices if fb.logits_indices is not None else torch.arange(fb.num_tokens),
        capture_layers=fb.capture_layers)


def build_forward_batch(chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]],
                        last_only: bool = False, capture_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """Assemble a ForwardBatch from per-sequence chunks.

    Each chunk is ``(new_ids, positions, new_slots, prefix_slots, tree_mask)``. With
    ``last_only`` only the last token of every sequence gets logits (prefill)."""
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
        input_ids=torch.cat(ids), positions=torch.cat(pos), out_slots=torch.cat(slots), seqs=seqs,
        logits_indices=torch.tensor(last, dtype=torch.long) if last_only else None,
        capture_layers=capture_layers)

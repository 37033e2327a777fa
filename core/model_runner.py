"""Model runner: owns the target model and its KV pool; turns sequences into ForwardBatches
and runs them."""
from __future__ import annotations

import logging

import torch

from .forward_batch import ForwardBatch, ForwardOutput, SeqSpan
from .kv_cache import KVPool

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, hf_config, num_slots: int, dtype: torch.dtype):
        self.model = model
        self.hf_config = hf_config
        layer0 = model.layers[0]
        self.kv = KVPool(model.num_layers, layer0.n_kv, layer0.head_dim, num_slots, dtype=dtype)
        self.vocab_size = hf_config.vocab_size
        self.max_context = model.rotary.cos.shape[0]

    @property
    def allocator(self):
        return self.kv.allocator

    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        return self.model(fb, self.kv)


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

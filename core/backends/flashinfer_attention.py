"""``model.attention_backend=flashinfer``: FlashInfer's batch prefill kernel over the slot-based
pool, page size 1 (a page = a KV slot, so a request's slot list is its page table), one call per
layer for the whole forward: decode rows, tree rows, prompts and extends alike, each request's
visibility given as a custom mask (prefix all visible; new tokens causal or the tree's ancestor
mask). Needs CUDA and ``pip install 'specfw[gpu]'``.

Not exact in the batch-invariant sense: FlashInfer may split a request's KV differently with
other requests beside it, so a tree node's bits can differ from the plain step's (the Triton
backend is exact by construction). The engine warns at startup where ``engine.batch_invariant``
asks for exactness.
"""

from __future__ import annotations

import logging

import torch

from .base import HeadShape

logger = logging.getLogger(__name__)
WORKSPACE_BYTES = 128 * 1024 * 1024
_wrappers: dict[torch.device, object] = {}


def _wrapper(device: torch.device):
    """One prefill wrapper (and its 128 MB workspace) per device, planned anew every forward."""
    w = _wrappers.get(device)
    if w is None:
        import flashinfer

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        w = _wrappers[device] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    return w


def visibility(seqs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors of the forward: ``qo_indptr``, ``kv_indptr`` (page = slot), ``kv_indices``
    and the flattened custom mask (per request ``[q_len, kv_len]`` row-major, concatenated)."""
    qo, kv, idx, masks = [0], [0], [], []
    for s in seqs:
        n, P = int(s.kv_slots.numel()), s.prefix_len
        qo.append(qo[-1] + s.q_len)
        kv.append(kv[-1] + n)
        idx.append(s.kv_slots)
        m = torch.ones(s.q_len, n, dtype=torch.bool)
        if s.tree_mask is None:
            m[:, P:] = torch.ones(s.q_len, s.q_len, dtype=torch.bool).tril_()
        else:
            w = s.tree_mask.shape[1]
            m[:, n - w :] = s.tree_mask
        masks.append(m.reshape(-1))
    i32 = torch.int32
    return torch.tensor(qo, dtype=i32), torch.tensor(kv, dtype=i32), torch.cat(idx).to(i32), torch.cat(masks)


class FlashInferPlan:
    def __init__(self, seqs, device: torch.device, shape: HeadShape):
        self.device, self.shape = device, shape
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.mask = visibility(seqs)
        self.covered = int(self.qo_indptr[-1])
        self.planned_scale: float | None = None

    def _plan(self, scale: float) -> None:
        d = self.device
        _wrapper(d).plan(
            self.qo_indptr.to(d),
            self.kv_indptr.to(d),
            self.kv_indices.to(d),
            torch.ones(len(self.qo_indptr) - 1, dtype=torch.int32, device=d),  # every last page holds its one slot
            self.shape.heads,
            self.shape.kv_heads,
            self.shape.head_dim,
            1,  # page size
            custom_mask=self.mask.to(d),
            sm_scale=scale,
            q_data_type=self.shape.dtype,
            kv_data_type=self.shape.dtype,
        )
        self.planned_scale = scale

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        if self.planned_scale != scale:  # once per forward: every layer has the same scale
            self._plan(scale)
        out = _wrapper(self.device).run(q[: self.covered].contiguous(), (k_cache.unsqueeze(1), v_cache.unsqueeze(1)))
        if self.covered == q.shape[0]:
            return out
        full = torch.zeros_like(q)
        full[: self.covered] = out
        return full

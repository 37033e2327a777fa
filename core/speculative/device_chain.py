"""A greedy chain draft (``topk=1``) of a feature drafter with its whole loop on the device.

With one beam per request, EAGLE-2's beam search is a chain: depth ``d``'s row is the previous
depth's argmax, fed the head's own output hidden, attending to the request's committed draft KV
and the chain so far. Nothing in that loop needs the host, so under CUDA graphs it is one replay
per step instead of a graph replay, a top-k read back (a device sync) and Python bookkeeping per
depth (``beam.py``; measured on an H200: the host-driven loop was most of an eagle3 step's
overhead over a ~2.2 ms graphed target forward).

Per step, on the host: the chain's draft KV slots are allocated (``depth - 1`` a request), the
rows' key lists loaded as a ``StaticRowLayout`` whose segment per request is its committed slots
followed by its chain slots, with ``seg_len`` the committed length; the loop adds one to each real
row's ``seg_len`` per depth, so depth ``d`` sees the committed prefix, its ancestors and itself.
On the device, per depth: ids (through the draft vocabulary's map), positions and output slots
into the static batch, a head forward, log-softmax and its max. The tokens and their
log-probabilities come back in one copy; the candidates are then exactly what ``beam_search``
with ``topk=1`` returns (the same score floor and ``keep`` cut, applied on the host after the
fact: a chain stops at the first node that beam search would not expand).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..backends.row_layout import RowLayout
from ..forward_batch import ForwardBatch
from ..graphs import StaticRowLayout, _capture, _static_batch, buckets
from .beam import _kth_best
from .types import DraftCandidates

logger = logging.getLogger(__name__)


@dataclass
class _ChainEntry:
    fb: ForwardBatch  # the head's static batch (ids, positions, output slots)
    layout: StaticRowLayout
    first_logits: torch.Tensor  # [R, V_draft]: the extend pass's logits at each request's root
    first_hidden: torch.Tensor  # [R, H]
    ints: torch.Tensor  # int64 [R + (depth - 1) * R + R]: root positions, chain slots per depth, row is real (1/0)
    out: torch.Tensor  # float32 [2, R, depth]: target ids (exact below 2^24), log-probabilities
    graph: object | None = None


class DeviceChain:
    """Chain drafts of up to ``max_requests`` requests from static buffers (one CUDA graph per
    (request bucket, depth) on CUDA; eagerly on the same buffers without ``capture``: the tests).
    ``head``: the drafter's ``head_forward``; ``to_target``: draft-vocabulary index -> target id
    (host tensor, or None)."""

    def __init__(self, head, kv, num_slots: int, hidden: int, to_target, device: torch.device, max_requests: int, capture: bool = True):
        self.head, self.kv, self.num_slots, self.hidden = head, kv, num_slots, hidden
        self.device, self.max_requests = device, max_requests
        self.buckets = buckets(max_requests)
        self.to_target = None if to_target is None else to_target.to(device)
        self.capture = capture and device.type == "cuda"
        self.entries: dict[tuple[int, int], _ChainEntry] = {}
        self.pool = None
        self.replays = 0

    @torch.inference_mode()
    def draft(self, committed: list[torch.Tensor], root_positions: list[int], first_logits, first_hidden, depth: int, score_floor: float, keep: int | None):
        """One chain per request (``committed[i]``: its draft KV slots up to its root, host), or
        None when the batch does not fit (draft with ``beam_search``)."""
        B = len(committed)
        if not 0 < B <= self.max_requests or depth < 1:
            return None
        R = next(b for b in self.buckets if b >= B)
        entry = self.entries.get((R, depth)) or self._make(R, depth, first_logits.shape[1], first_hidden.dtype)
        if entry is None:
            return None
        chain = self.kv.allocator.alloc(B * (depth - 1)).view(B, depth - 1) if depth > 1 else torch.zeros(B, 0, dtype=torch.long)
        try:
            if not self._load(entry, committed, root_positions, chain, first_logits, first_hidden, depth):
                return None
            if entry.graph is not None:
                entry.graph.replay()
            else:
                self._loop(entry, depth)
            self.replays += 1
            out = entry.out[:, :B].cpu()  # the step's one device sync
        finally:
            if depth > 1:
                self.kv.allocator.free(chain.reshape(-1))
        return [_candidates(out[0, i].long().tolist(), out[1, i].tolist(), score_floor, keep) for i in range(B)]

    def _load(self, e: _ChainEntry, committed, root_positions, chain, first_logits, first_hidden, depth: int) -> bool:
        B, R = len(committed), e.fb.input_ids.numel()
        seqs = [np.concatenate([c.numpy(), s.numpy()]) for c, s in zip(committed, chain)]
        lens = np.array([c.numel() for c in committed], np.int32)
        starts = np.cumsum([0] + [s.size for s in seqs[:-1]]).astype(np.int32)
        zeros, slots = np.zeros(B, np.int32), np.concatenate(seqs).astype(np.int32)
        layout = RowLayout(*(torch.from_numpy(a) for a in (np.arange(B, dtype=np.int32), starts, lens, zeros, zeros, slots, np.zeros(1, np.int32))))
        if not e.layout.fits(layout):
            return False
        e.layout.load(layout)
        ints = np.zeros(e.ints.numel(), np.int64)
        ints[:B] = root_positions
        slots = np.full((depth - 1, R), self.kv.scratch_slot, np.int64)
        slots[:, :B] = chain.numpy().T
        ints[R : R * depth] = slots.reshape(-1)
        ints[R * depth : R * depth + B] = 1
        e.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        e.first_logits[:B].copy_(first_logits)
        e.first_hidden[:B].copy_(first_hidden)
        return True

    def _loop(self, e: _ChainEntry, depth: int) -> torch.Tensor:
        """The chain on the device: what a replay runs."""
        R = e.fb.input_ids.numel()
        roots, real = e.ints[:R], e.ints[R * depth :].to(torch.int32)
        logits, hidden, ids = e.first_logits, e.first_hidden, None
        for d in range(depth):
            if d:
                e.fb.input_ids.copy_(ids)
                e.fb.positions.copy_(roots + d)
                e.fb.out_slots.copy_(e.ints[R * d : R * (d + 1)])
                e.layout.seg_len.add_(real)  # one more key: the row's own
                logits, hidden = self.head(e.fb.input_ids, hidden, e.fb, False)
            lp, tok = torch.log_softmax(logits.float(), -1).max(-1)
            ids = tok if self.to_target is None else self.to_target[tok]
            e.out[0, :, d] = ids.float()
            e.out[1, :, d] = lp
        return e.out

    def _make(self, rows: int, depth: int, vocab: int, dtype: torch.dtype) -> _ChainEntry | None:
        fb, layout = _static_batch(rows, self.num_slots, self.kv.scratch_slot, self.device)
        ints = torch.zeros(rows * (depth + 1), dtype=torch.long, device=self.device)
        ints[rows : rows * depth] = self.kv.scratch_slot
        entry = _ChainEntry(
            fb,
            layout,
            torch.zeros(rows, vocab, dtype=torch.float32, device=self.device),
            torch.zeros(rows, self.hidden, dtype=dtype, device=self.device),
            ints,
            torch.zeros(2, rows, depth, dtype=torch.float32, device=self.device),
        )
        if self.capture:
            try:
                entry.graph, _ = _capture(lambda: self._loop(entry, depth), self.pool)
                self.pool = entry.graph.pool()
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                logger.warning("CUDA graph capture of the chain draft (%d requests, depth %d) failed (%s); drafting beam by beam", rows, depth, why)
                self.max_requests = 0
                return None
            logger.info("captured a CUDA graph of the chain draft: %d requests, depth %d", rows, depth)
        self.entries[(rows, depth)] = entry
        return entry


def _candidates(tokens: list[int], logprobs: list[float], score_floor: float, keep: int | None) -> DraftCandidates:
    """A chain's candidates as ``beam_search`` with ``topk=1`` makes them: node ``d`` (parent
    ``d - 1``, score the running sum of log-probabilities) exists while its parent scored at least
    the floor (``score_floor``, and the ``keep``-th best score so far)."""
    toks, parents, scores = [tokens[0]], [-1], [logprobs[0]]
    for d in range(1, len(tokens)):
        if scores[-1] < max(score_floor, _kth_best(scores, keep)):
            break
        toks.append(tokens[d])
        parents.append(d - 1)
        scores.append(scores[-1] + logprobs[d])
    return DraftCandidates(torch.tensor(toks, dtype=torch.long), torch.tensor(parents, dtype=torch.long), torch.tensor(scores, dtype=torch.float32), None)

"""A greedy chain draft (``topk=1``) of a feature drafter, extend pass and loop, on the device.

With one beam per request, EAGLE-2's beam search is a chain: depth ``d``'s row is the previous
depth's argmax, fed the head's own output hidden, attending to the request's committed draft KV
and the chain so far. Nothing in that loop needs the host, so under CUDA graphs it is one replay
per step instead of a graph replay, a top-k read back (a device sync) and Python bookkeeping per
depth (``beam.py``; measured on an H200: the host-driven loop was most of an eagle3 step's
overhead over a ~2.2 ms graphed target forward).

Per step, on the host: the extend pass's rows (each request's pending pairs, up to its root) are
loaded into their own static batch and layout, the chain's draft KV slots are allocated
(``depth - 1`` a request) and the chain rows' key lists loaded as a ``StaticRowLayout`` whose
segment per request is its committed slots (the extend's included) followed by its chain slots,
with ``seg_len`` the committed length; the loop adds one to each real row's ``seg_len`` per
depth, so depth ``d`` sees the committed prefix, its ancestors and itself. On the device: the
extend forward and its last row per request (the root's logits and hidden), then per depth:
ids (through the draft vocabulary's map), positions and output slots into the static batch, a
head forward, log-softmax and its max. The tokens and their
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
from ..graphs import StaticRowLayout, _capture, _load_inputs, _static_batch, buckets
from .beam import _kth_best
from .types import DraftCandidates

logger = logging.getLogger(__name__)


@dataclass
class _ChainEntry:
    extend: ForwardBatch  # the extend pass's static batch
    extend_layout: StaticRowLayout
    features: torch.Tensor  # [E, F]: the extend rows' (projected) target features
    fb: ForwardBatch  # the chain's static batch (ids, positions, output slots)
    layout: StaticRowLayout
    ints: torch.Tensor  # int64 [(depth + 2) * R]: root positions, chain slots per depth, row is real (1/0), its last extend row
    out: torch.Tensor  # float32 [2, R, depth]: target ids (exact below 2^24), log-probabilities
    graph: object | None = None


class DeviceChain:
    """Chain drafts of up to ``max_requests`` requests over extend passes of up to ``max_rows``
    rows from static buffers (one CUDA graph per (extend rows bucket, requests bucket, depth) on
    CUDA; eagerly on the same buffers without ``capture``: the tests). ``head``: the drafter's
    ``head_forward``; ``to_target``: draft-vocabulary index -> target id (host tensor, or None)."""

    def __init__(self, head, kv, num_slots: int, to_target, device: torch.device, max_requests: int, max_rows: int, capture: bool = True):
        self.head, self.kv, self.num_slots = head, kv, num_slots
        self.device, self.max_requests, self.max_rows = device, max_requests, max_rows
        self.buckets, self.row_buckets = buckets(max_requests), buckets(max_rows)
        self.to_target = None if to_target is None else to_target.to(device)
        self.capture = capture and device.type == "cuda"
        self.entries: dict[tuple[int, int, int], _ChainEntry] = {}
        self.pool = None
        self.replays = 0

    @torch.inference_mode()
    def draft(self, extend: ForwardBatch, features, committed: list[torch.Tensor], root_positions: list[int], depth: int, score_floor: float, keep: int | None):
        """The extend pass (``extend``: host batch whose ``logits_indices`` are each request's last
        pair; ``features`` its rows' projected features) and one chain per request
        (``committed[i]``: its draft KV slots up to its root, the extend's included, host), or None
        when the batch does not fit (run the extend and ``beam_search``)."""
        B, E = len(committed), extend.num_tokens
        if not 0 < B <= self.max_requests or not 0 < E <= self.max_rows or depth < 1:
            return None
        R, RE = _bucket(self.buckets, B), _bucket(self.row_buckets, E)
        entry = self.entries.get((RE, R, depth)) or self._make(RE, R, depth, features)
        if entry is None:
            return None
        chain = self.kv.allocator.alloc(B * (depth - 1)).view(B, depth - 1) if depth > 1 else torch.zeros(B, 0, dtype=torch.long)
        try:
            if not self._load(entry, extend, features, committed, root_positions, chain, depth):
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

    @torch.inference_mode()
    def capture_all(self, depth: int, width: int, dtype: torch.dtype) -> int:
        """Every (extend rows bucket, requests bucket) entry of chains of ``depth`` a step can
        meet made now (``GraphedForward.capture_all``): each request extends by 1 to ``depth + 1``
        accepted pairs, so R requests' extend has R to R x (depth + 1) rows. ``width``, ``dtype``:
        the projected features'. Returns how many were made."""
        features, made, fewer = torch.empty(0, width, dtype=dtype, device=self.device), 0, 0
        for requests in self.buckets:  # this bucket serves fewer + 1 .. requests requests
            lo = _bucket(self.row_buckets, fewer + 1)
            hi = _bucket(self.row_buckets, min(self.max_rows, requests * (depth + 1)))
            for rows in (b for b in self.row_buckets if lo <= b <= hi and (b, requests, depth) not in self.entries):
                if not self.max_requests:  # a capture failed: drafting beam by beam from now on
                    return made
                made += self._make(rows, requests, depth, features) is not None
            fewer = requests
        return made

    def _load(self, e: _ChainEntry, extend: ForwardBatch, features, committed, root_positions, chain, depth: int) -> bool:
        B, R, E = len(committed), e.fb.input_ids.numel(), extend.num_tokens
        extend_layout = RowLayout.build(extend.seqs)
        seqs = [np.concatenate([c.numpy(), s.numpy()]) for c, s in zip(committed, chain)]
        lens = np.array([c.numel() for c in committed], np.int32)
        starts = np.cumsum([0] + [s.size for s in seqs[:-1]]).astype(np.int32)
        zeros, slots = np.zeros(B, np.int32), np.concatenate(seqs).astype(np.int32)
        layout = RowLayout(*(torch.from_numpy(a) for a in (np.arange(B, dtype=np.int32), starts, lens, zeros, zeros, slots, np.zeros(1, np.int32))))
        if not (e.layout.fits(layout) and e.extend_layout.fits(extend_layout)):
            return False
        _load_inputs(e.extend, extend, self.kv.scratch_slot)
        e.extend_layout.load(extend_layout)
        e.features[:E].copy_(features)
        e.features[E:].zero_()
        e.layout.load(layout)
        ints = np.zeros(e.ints.numel(), np.int64)
        ints[:B] = root_positions
        slots = np.full((depth - 1, R), self.kv.scratch_slot, np.int64)
        slots[:, :B] = chain.numpy().T
        ints[R : R * depth] = slots.reshape(-1)
        ints[R * depth : R * depth + B] = 1
        ints[R * (depth + 1) : R * (depth + 1) + B] = extend.logits_indices.numpy()
        e.ints.copy_(torch.from_numpy(ints), non_blocking=True)
        return True

    def _loop(self, e: _ChainEntry, depth: int) -> torch.Tensor:
        """The chain on the device: what a replay runs."""
        R = e.fb.input_ids.numel()
        roots, real, last = e.ints[:R], e.ints[R * depth : R * (depth + 1)].to(torch.int32), e.ints[R * (depth + 1) :]
        logits, hidden = self.head(e.extend.input_ids, e.features, e.extend, False)  # the extend pass: every pending pair
        logits, hidden, ids = logits.index_select(0, last), hidden.index_select(0, last), None  # at each request's root
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

    def _make(self, extend_rows: int, rows: int, depth: int, features: torch.Tensor) -> _ChainEntry | None:
        extend, extend_layout = _static_batch(extend_rows, self.num_slots, self.kv.scratch_slot, self.device)
        fb, layout = _static_batch(rows, self.num_slots, self.kv.scratch_slot, self.device)
        ints = torch.zeros(rows * (depth + 2), dtype=torch.long, device=self.device)
        ints[rows : rows * depth] = self.kv.scratch_slot
        entry = _ChainEntry(
            extend,
            extend_layout,
            torch.zeros(extend_rows, features.shape[1], dtype=features.dtype, device=self.device),
            fb,
            layout,
            ints,
            torch.zeros(2, rows, depth, dtype=torch.float32, device=self.device),
        )
        if self.capture:
            try:
                entry.graph, _ = _capture(lambda: self._loop(entry, depth), self.pool)
                self.pool = entry.graph.pool()
            except Exception as e:
                what = f"{extend_rows} extend rows, {rows} requests, depth {depth}"
                logger.warning("CUDA graph capture of the chain draft (%s) failed (%s: %s); drafting beam by beam", what, type(e).__name__, e)
                self.max_requests = 0
                return None
            logger.info("captured a CUDA graph of the chain draft: %d extend rows, %d requests, depth %d", extend_rows, rows, depth)
        self.entries[(extend_rows, rows, depth)] = entry
        return entry


def _bucket(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


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

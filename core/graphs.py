"""CUDA graphs for decode and verify forwards (``engine.cuda_graph_max_bs``, SGLang's name).

A 135M-parameter model on a GPU is launch-bound: a forward is hundreds of small kernels. A graph
replays them in one launch, but only with fixed shapes and fixed buffers, so a graphed forward is
a *static* forward:

* its rows are padded to a bucket (1, 2, 4, 8, then multiples of 8 up to the largest forward
  allowed: ``cuda_graph_max_bs`` requests x the rows one request verifies); a padding row reads
  token 0 at position 0, writes its K/V to the pool's scratch slot and attends to that slot only;
* its ids, positions and KV output slots are device buffers the inputs are copied into;
* its attention is the Triton kernel (``model.attention_backend=triton``) reading per-row key
  lists (``RowLayout``) from device buffers sized for the whole KV pool (``StaticRowLayout``),
  so the kernel's grid is fixed and its loops read their bounds from memory;
* its outputs are cloned out of the graph's buffers (the drafters keep hidden states).

Only forwards whose every row needs logits are graphed (decode and verify steps); prompt
prefills run eagerly. With ``capture=False`` the static forward runs eagerly on the same buffers:
the tests check the padding, the buffers and the copies that way on a CPU (Triton's interpreter).
A capture that fails turns graphs off with a warning; decoding goes on eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .backends.row_layout import RowLayout, aligned
from .forward_batch import ForwardBatch, ForwardOutput

logger = logging.getLogger(__name__)


def buckets(max_rows: int) -> list[int]:
    """Row counts captured: 1, 2, 4, 8, then every multiple of 8 up to ``max_rows`` (and ``max_rows``)."""
    out = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(out))


class StaticRowLayout:
    """``RowLayout``'s tensors as fixed device buffers of ``rows`` rows; the last entry of
    ``slots`` is the pool's scratch slot, which padding rows attend to. The seven arrays are views
    of one int32 buffer (``slots`` last), so loading a forward's layout is one host-to-device copy
    of the buffer's used prefix."""

    def __init__(self, rows: int, slot_capacity: int, ext_capacity: int, scratch_slot: int, device: torch.device):
        self.rows, self.slot_capacity, self.ext_capacity = rows, slot_capacity, max(ext_capacity, 1)
        R, E = aligned(rows), aligned(self.ext_capacity)
        self.offsets = [0, R, 2 * R, 3 * R, 4 * R, 5 * R, 5 * R + E]  # row_q, seg_start, seg_len, ext_start, ext_len, ext_slots, slots
        self.buffer = torch.zeros(5 * R + E + slot_capacity + 1, dtype=torch.int32, device=device)
        views = [self.buffer[o : o + n] for o, n in zip(self.offsets, [rows] * 5 + [self.ext_capacity, slot_capacity + 1])]
        self.row_q, self.seg_start, self.seg_len, self.ext_start, self.ext_len, self.ext_slots, self.slots = views
        self.host = np.zeros(5 * R + E, dtype=np.int32)  # the part before ``slots``, padding rows preset
        self.host[:rows] = np.arange(rows)
        self.host[R : R + rows] = slot_capacity
        self.host[2 * R : 2 * R + rows] = 1
        self.buffer[: self.host.size].copy_(torch.from_numpy(self.host))
        self.slots[-1] = scratch_slot

    def fits(self, layout: RowLayout) -> bool:
        return layout.rows <= self.rows and layout.slots.numel() <= self.slot_capacity and layout.ext_slots.numel() <= self.ext_capacity

    def load(self, layout: RowLayout) -> None:
        """Copy a forward's host layout in (one copy); rows past it become padding rows."""
        T, o = layout.rows, self.offsets
        h = self.host.copy()
        for off, t in zip(o[:5], (layout.row_q, layout.seg_start, layout.seg_len, layout.ext_start, layout.ext_len)):
            h[off : off + T] = t.numpy()
        h[o[5] : o[5] + layout.ext_slots.numel()] = layout.ext_slots.numpy()
        flat = np.concatenate([h, layout.slots.numpy()])
        self.buffer[: flat.size].copy_(torch.from_numpy(flat), non_blocking=True)


class StaticTritonPlan:
    """The attention plan of a static forward: the Triton kernel over a ``StaticRowLayout``."""

    def __init__(self, layout: StaticRowLayout):
        self.layout = layout

    def __call__(self, q, k_cache, v_cache, scale):
        from .triton.attention import row_attention

        return row_attention(q.contiguous(), k_cache, v_cache, torch.empty_like(q), scale, self.layout)


@dataclass
class _Entry:
    fb: ForwardBatch  # static inputs (device buffers) + the static attention plan
    layout: StaticRowLayout
    graph: object | None = None  # torch.cuda.CUDAGraph, or None: run eagerly on the buffers
    out: object | None = None  # the graph's output buffers (a ForwardOutput; a head's (logits, hidden))
    features: torch.Tensor | None = None  # a draft head's input features (GraphedHead)


def _into(buffers: ForwardOutput | None, out: ForwardOutput) -> ForwardOutput:
    if buffers is None:
        return out
    buffers.logits.copy_(out.logits)
    buffers.hidden.copy_(out.hidden)
    for b, a in zip(buffers.aux_hidden, out.aux_hidden):
        b.copy_(a)
    return buffers


def _static_batch(rows: int, num_slots: int, scratch: int, dev: torch.device, capture_layers: tuple[int, ...] = ()) -> tuple[ForwardBatch, StaticRowLayout]:
    """A static forward's input buffers and attention layout for ``rows`` rows over a pool of ``num_slots``."""
    layout = StaticRowLayout(rows, num_slots + rows, rows * min(rows, 64), scratch, dev)
    inputs = torch.zeros(3 * rows, dtype=torch.long, device=dev)  # ids, positions, output slots: one copy in (_load_inputs)
    inputs[2 * rows :] = scratch
    sfb = ForwardBatch(
        input_ids=inputs[:rows],
        positions=inputs[rows : 2 * rows],
        out_slots=inputs[2 * rows :],
        seqs=[],
        logits_indices=None,
        capture_layers=capture_layers,
        attn_plan=StaticTritonPlan(layout),
    )
    return sfb, layout


def _load_inputs(sfb: ForwardBatch, fb: ForwardBatch, scratch: int) -> None:
    """``fb``'s ids, positions and output slots (host tensors: the forward was built on the host)
    into the static buffers (views of one int64 buffer: one copy); the rest become padding rows
    (token 0, position 0, the scratch slot)."""
    T, R = fb.num_tokens, sfb.input_ids.numel()
    host = np.zeros(3 * R, dtype=np.int64)
    host[2 * R + T :] = scratch
    for i, src in enumerate((fb.input_ids, fb.positions, fb.out_slots)):
        host[i * R : i * R + T] = src.cpu().numpy()
    _inputs_buffer(sfb).copy_(torch.from_numpy(host), non_blocking=True)


def _inputs_buffer(sfb: ForwardBatch) -> torch.Tensor:
    """The int64 buffer ``_static_batch`` made ``sfb``'s ids, positions and output slots views of."""
    R = sfb.input_ids.numel()
    assert sfb.input_ids.storage_offset() == 0 and sfb.out_slots.storage_offset() == 2 * R
    return sfb.input_ids.as_strided((3 * R,), (1,))


def _capture(call, pool):
    """``call()`` warmed up on a side stream (lazy row plans, Triton's compile), then captured:
    (graph, its output buffers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = call()
    return graph, out


class GraphedForward:
    """Static (and, on CUDA, graph-replayed) forwards of up to ``max_rows`` rows for a runner."""

    def __init__(self, runner, max_rows: int, capture: bool = True):
        self.runner, self.max_rows = runner, max_rows
        self.buckets = buckets(max_rows)
        self.capture = capture and runner.device.type == "cuda"
        self.entries: dict[tuple[int, tuple[int, ...]], _Entry] = {}
        self.pool = None
        self.replays = 0  # forwards served from static buffers (tests, logs)

    def eligible(self, fb: ForwardBatch) -> bool:
        return fb.logits_indices is None and 0 < fb.num_tokens <= self.max_rows

    @torch.inference_mode()
    def capture_all(self, capture_layers: tuple[int, ...] = ()) -> int:
        """Every row bucket's entry made now (captured on CUDA), as SGLang captures its graphs at
        startup: a capture met while serving costs its kernels' compiles and three forwards
        inside a request's step. Returns how many were made."""
        made = 0
        for rows in self.buckets:
            if self.runner.graphs is not self:  # a capture failed: eager from now on
                break
            if (rows, capture_layers) not in self.entries:
                made += self._make(rows, capture_layers) is not None
        return made

    @torch.inference_mode()
    def run(self, fb: ForwardBatch) -> ForwardOutput | None:
        """The forward from a static entry, or None when it does not fit one (run it eagerly)."""
        T = fb.num_tokens
        R = next(b for b in self.buckets if b >= T)
        layout = RowLayout.build(fb.seqs)
        entry = self.entries.get((R, fb.capture_layers)) or self._make(R, fb.capture_layers)
        if entry is None or not entry.layout.fits(layout):
            return None
        _load_inputs(entry.fb, fb, self.runner.kv.scratch_slot)
        entry.layout.load(layout)
        if entry.graph is not None:
            entry.graph.replay()
        else:  # as a replay would: the outputs land in the entry's own buffers
            entry.out = _into(entry.out, self.runner.model(entry.fb, self.runner.kv))
        out = entry.out
        self.replays += 1
        return ForwardOutput(logits=out.logits[:T].clone(), hidden=out.hidden[:T].clone(), aux_hidden=[a[:T].clone() for a in out.aux_hidden])

    def _make(self, rows: int, capture_layers: tuple[int, ...]) -> _Entry | None:
        r = self.runner
        sfb, layout = _static_batch(rows, r.allocator.num_slots, r.kv.scratch_slot, r.device, capture_layers)
        entry = _Entry(sfb, layout)
        if self.capture:
            try:
                entry.graph, entry.out = _capture(lambda: r.model(sfb, r.kv), self.pool)
                self.pool = entry.graph.pool()
            except Exception as e:  # a model or kernel that cannot be captured: eager from now on
                logger.warning("CUDA graph capture of %d rows failed (%s: %s); decoding eagerly", rows, type(e).__name__, e)
                self.runner.graphs = None
                return None
            logger.info("captured a CUDA graph of %d rows", rows)
        self.entries[(rows, capture_layers)] = entry
        return entry


def graph_rows(engine_cfg, device: torch.device, backend, tree_shape, tp_size: int = 1) -> int:
    """The largest forward to graph (0: none): ``cuda_graph_max_bs`` requests (null = auto:
    min(max_running_requests, 32)) x the rows one request verifies (``num_draft_tokens``, 1 for
    plain decoding); on CUDA with the Triton attention and one rank only, else 0 (logged where
    graphs were asked for and cannot be had)."""
    asked = getattr(engine_cfg, "cuda_graph_max_bs", None)
    if getattr(engine_cfg, "disable_cuda_graph", False) or asked == 0 or device.type != "cuda":
        return 0
    why = None
    if backend.attention != "triton":
        why = f"model.attention_backend resolved to {backend.attention}, graphs need triton"
    elif tp_size > 1:
        why = "model.tp_size > 1"
    if why:
        if asked:
            logger.warning("engine.cuda_graph_max_bs=%s: no CUDA graphs (%s)", asked, why)
        return 0
    bs = asked or min(engine_cfg.max_running_requests, 32)
    return bs * (tree_shape.num_draft_tokens if tree_shape else 1)


class GraphedHead:
    """A feature drafter's head forwards -- the beam steps and the extend pass over the pairs a
    step accepted -- from static buffers, replayed from CUDA graphs on CUDA: the draft loop's
    per-depth forward and the extend are as launch-bound as the target's (measured on an H200,
    bf16 demo model, batch 1: the eager extend 1.3 ms of a 6.4 ms eagle3 step). Same buckets and
    padding as ``GraphedForward``, on the drafter's own KV pool; the
    head's attention must be the Triton kernel (``speculative.draft_attention_backend`` or the
    target's). ``head`` is the drafter's ``head_forward(tokens, features, fb, from_target)``."""

    def __init__(self, head, kv, num_slots: int, hidden_size: int, device: torch.device, max_rows: int, capture: bool = True):
        self.head, self.kv, self.num_slots, self.hidden, self.device = head, kv, num_slots, hidden_size, device
        self.max_rows, self.buckets = max_rows, buckets(max_rows)
        self.capture = capture and device.type == "cuda"
        self.entries: dict[int, _Entry] = {}
        self.pool = None
        self.replays = 0

    @torch.inference_mode()
    def run(self, fb: ForwardBatch, features: torch.Tensor):
        """(logits, hidden) of a head forward, or None when it does not fit (run it eagerly).
        Beam steps want every row's logits; an extend pass (``fb.logits_indices`` set: the last
        pair of each request) gets those rows' logits, from a graph that computed them all."""
        T = fb.num_tokens
        if not 0 < T <= self.max_rows:
            return None
        R = next(b for b in self.buckets if b >= T)
        layout = RowLayout.build(fb.seqs)
        entry = self.entries.get(R) or self._make(R, features.dtype)
        if entry is None or not entry.layout.fits(layout):
            return None
        _load_inputs(entry.fb, fb, self.kv.scratch_slot)
        entry.features[:T].copy_(features)
        entry.features[T:].zero_()
        entry.layout.load(layout)
        if entry.graph is not None:
            entry.graph.replay()
        else:  # as a replay would: the outputs land in the entry's own buffers
            out = self.head(entry.fb.input_ids, entry.features, entry.fb, False)
            if entry.out is None:
                entry.out = out
            else:
                for b, o in zip(entry.out, out):
                    b.copy_(o)
        self.replays += 1
        logits, hidden = entry.out
        if fb.logits_indices is not None:
            return logits.index_select(0, fb.logits_indices.to(logits.device)), hidden[:T].clone()
        return logits[:T].clone(), hidden[:T].clone()

    @torch.inference_mode()
    def capture_all(self, dtype: torch.dtype) -> int:
        """Every row bucket's head forward made now (``GraphedForward.capture_all``); ``dtype``:
        the features'. Returns how many were made."""
        made = 0
        for rows in self.buckets:
            if self.max_rows and rows not in self.entries:
                made += self._make(rows, dtype) is not None
        return made

    def _make(self, rows: int, dtype: torch.dtype) -> _Entry | None:
        sfb, layout = _static_batch(rows, self.num_slots, self.kv.scratch_slot, self.device)
        entry = _Entry(sfb, layout, features=torch.zeros(rows, self.hidden, dtype=dtype, device=self.device))
        if self.capture:
            try:
                entry.graph, entry.out = _capture(lambda: self.head(sfb.input_ids, entry.features, sfb, False), self.pool)
                self.pool = entry.graph.pool()
            except Exception as e:
                logger.warning("CUDA graph capture of the draft head (%d rows) failed (%s: %s); drafting eagerly", rows, type(e).__name__, e)
                self.max_rows = 0
                return None
        self.entries[rows] = entry
        return entry

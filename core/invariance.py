"""Which CPU kernel calls keep a row's bits independent of the other rows in the call, measured
once per process and shape.

Batch-invariant decoding (``engine.batch_invariant``) needs every token row of a forward to come
out exactly as it would in a lone one-row decode step. Whether a GEMM or an SDPA call delivers
that is a property of the machine, not of the code: measured with torch 2.13,

* Xeon (AMX): MKL's packed sgemm and oneDNN bf16 give a row its one-row bits for any row count
  up to 129; fp32 and bf16 SDPA over a batch of one-row queries matches lone calls;
* EPYC (AVX-512-BF16, no AMX): MKL's packed sgemm switches kernels at 4 rows, oneDNN bf16
  1536->576 at 8-10 rows; fp32 SDPA matches lone calls only with ``MKL_CBWR`` set
  (``specfw/__init__``).

So nothing is assumed: ``invariant_row_plan`` finds how a linear must split its rows,
and ``grouped_attention_is_invariant`` whether one-row queries may share an SDPA call. A verdict
that is pure bit equality (no timing chose it) for a kernel build named by ``persist`` (specfw's
compiled kernels: the build's file, whose name carries its source hash) is kept on disk per CPU
and thread count (``<cache>/row_plans.json``), so later processes on the machine skip that probe
(a write drops the entries of builds no longer on disk: rebuilt or removed kernels). Random
inputs suffice, given enough of them: a kernel's reduction order does not depend on the data,
but in bf16 a different fp32 summation order changes the rounded output only near a rounding
boundary (measured: 1 of 4,608 outputs of the 1536->576 layer at 8 rows), so each row count is
checked on about 2^18 outputs.
"""

from __future__ import annotations

import ast
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

MAX_ROW_BLOCK = 64
PROBE_OUTPUTS = 1 << 18  # outputs compared per row count (bf16 outputs hide most fp32 reordering)
DEFAULT_TIMED_ROWS = (1, 8)  # row counts plans are timed for unless the runner says (engine: 1 + tree size)
_plans: dict[tuple, "RowPlan"] = {}
_attention: dict[tuple, bool] = {}


@dataclass(frozen=True)
class RowPlan:
    """How a batch-invariant linear runs its rows: calls of at most ``block`` rows, or, with
    ``pad``, calls of exactly ``block`` rows (zero rows appended), so every row meets one kernel."""

    block: int
    pad: bool = False

    def run(self, mm: Callable[[torch.Tensor], torch.Tensor], x2: torch.Tensor) -> torch.Tensor:
        rows = x2.shape[0]
        if self.pad and rows % self.block:
            x2 = torch.cat([x2, x2.new_zeros(self.block - rows % self.block, x2.shape[1])])
        if x2.shape[0] <= self.block:
            return mm(x2)[:rows]
        return torch.cat([mm(part) for part in x2.split(self.block)])[:rows]


def invariant_row_plan(
    mm: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    dtype: torch.dtype,
    key: tuple,
    timed_rows: tuple[int, ...] = DEFAULT_TIMED_ROWS,
    device: torch.device = torch.device("cpu"),
    persist: str | None = None,
) -> RowPlan:
    """The fastest ``RowPlan`` under which ``mm`` gives every row the bits it gets at that plan's
    one-row call. ``key`` names the kernel and shape (the thread count is added: work splits
    follow it). First choice: unpadded calls of up to ``block`` rows, the largest block
    (<= ``MAX_ROW_BLOCK``) for which every row count keeps one-row bits. Where that block is
    small (EPYC: 3 rows fp32, 1 row for bf16 1536->576), calls padded to 8 or 16 rows are
    tried too, and the plan with the least time summed over ``timed_rows`` wins (the engine
    passes (1, 8) for plain decoding, one request or a batch of them, and (1, num_draft_tokens)
    for speculative decoding, whose verify forwards carry a draft tree). ``device``: where
    ``mm`` runs (probe inputs are made there; GPU plans are measured the same way). ``persist``:
    the identity of ``mm``'s compiled code (CPU only); its bit-equality verdicts are kept on disk."""
    device = torch.device(device)
    key = (*key, in_features, dtype, timed_rows, torch.get_num_threads(), str(device), persist)
    if key not in _plans:
        disk_key = _disk_key(persist, key) if persist and device.type == "cpu" else None
        plan = _saved_plans().get(disk_key) if disk_key else None
        if plan is None:
            with torch.inference_mode():
                plan = _probe(mm, in_features, dtype, timed_rows, device)
            if disk_key and (plan.block >= max(timed_rows) and not plan.pad):  # no timing chose it: the same on every run
                _save_plan(disk_key, plan)
        _plans[key] = plan
    return _plans[key]


def plans_file() -> Path:
    from .demo_model import cache_dir

    return cache_dir() / "row_plans.json"


def _disk_key(persist: str, key: tuple) -> str:
    from .machine import cpu_description

    return repr((persist, cpu_description(), *(str(k) for k in key)))


def _saved_plans() -> dict[str, RowPlan]:
    try:
        raw = json.loads(plans_file().read_text())
        return {k: RowPlan(int(v["block"]), bool(v["pad"])) for k, v in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # none yet, or unreadable: probe again (and rewrite it)


def _build_exists(disk_key: str) -> bool:
    """The kernel build an entry is for (its key's first element, a file path) is still on disk."""
    try:
        build = ast.literal_eval(disk_key)[0]
    except (ValueError, SyntaxError, TypeError, IndexError, MemoryError, RecursionError):
        return False
    return isinstance(build, str) and os.path.isfile(build)


def _save_plan(disk_key: str, plan: RowPlan) -> None:
    """Add one verdict and drop those of builds no longer on disk (a rebuilt kernel's old
    ``.so``, a test's temporary build); written whole to a temporary file and renamed (a
    concurrent writer's entries may be lost, never half-written: a lost one is probed again)."""
    path = plans_file()
    saved = {k: {"block": v.block, "pad": v.pad} for k, v in _saved_plans().items() if _build_exists(k)}
    saved[disk_key] = {"block": plan.block, "pad": plan.pad}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the probe next time


def _probe(mm, in_features: int, dtype: torch.dtype, timed_rows: tuple[int, ...], device: torch.device = torch.device("cpu")) -> RowPlan:
    g = torch.Generator().manual_seed(0)
    out_features = mm(torch.zeros(1, in_features, dtype=dtype, device=device)).shape[-1]
    rows = -(-max(MAX_ROW_BLOCK, -(-PROBE_OUTPUTS // out_features)) // 16) * 16
    x = torch.randn(rows, in_features, generator=g).to(device=device, dtype=dtype)
    alone = torch.cat([mm(x[r : r + 1]) for r in range(rows)])
    block = next((m - 1 for m in range(2, MAX_ROW_BLOCK + 1) if not torch.equal(torch.cat([mm(part) for part in x.split(m)]), alone)), MAX_ROW_BLOCK)
    plans = [RowPlan(block)]
    if block < max(timed_rows):
        for b in (8, 16):
            pad = x.new_zeros(b - 1, in_features)
            alone_b = torch.cat([mm(torch.cat([x[r : r + 1], pad]))[:1] for r in range(rows)])
            if torch.equal(torch.cat([mm(part) for part in x.split(b)]), alone_b):
                plans.append(RowPlan(b, pad=True))
    if len(plans) == 1:
        return plans[0]
    return min(plans, key=lambda p: sum(_seconds(p, mm, x[:r]) for r in timed_rows))


def _seconds(plan: RowPlan, mm, x: torch.Tensor, reps: int = 5) -> float:
    from .device import synchronize

    plan.run(mm, x)
    synchronize(x.device)
    t = time.perf_counter()
    for _ in range(reps):
        plan.run(mm, x)
    synchronize(x.device)
    return (time.perf_counter() - t) / reps


def grouped_attention_is_invariant(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, device: torch.device = torch.device("cpu")) -> bool:
    """Whether one-row queries over equally many keys may share one SDPA call (the batch-invariant
    attention plan's groups) and still get the bits of lone decode rows. On a device without
    data (``meta``) nothing can be measured: no (one call per row is invariant everywhere)."""
    from .attention import attend, plan_attention
    from .forward_batch import SeqSpan

    device = torch.device(device)
    if device.type == "meta":
        return False
    key = (dtype, heads, kv_heads, head_dim, torch.get_num_threads(), str(device))
    if key not in _attention:
        g = torch.Generator().manual_seed(0)
        rows, ok = 32, True
        for kv_len in (37, 300, 520):
            k = torch.randn(rows * kv_len, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
            v = torch.randn(rows * kv_len, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype)
            q = torch.randn(rows, heads, head_dim, generator=g).to(device=device, dtype=dtype)
            spans = [SeqSpan(q_start=i, q_len=1, kv_slots=torch.arange(i * kv_len, (i + 1) * kv_len)) for i in range(rows)]
            with torch.inference_mode():
                together = attend(q, k, v, plan_attention(spans, q.device, True, group_rows=True), head_dim**-0.5)
                for i, s in enumerate(spans):
                    alone = attend(q[i : i + 1], k, v, plan_attention([SeqSpan(0, 1, s.kv_slots)], q.device, True), head_dim**-0.5)
                    ok = ok and torch.equal(together[i], alone[0])
        _attention[key] = ok
    return _attention[key]


def measure_linears(model: torch.nn.Module, timed_rows: tuple[int, ...] = DEFAULT_TIMED_ROWS) -> dict:
    """Every batch-invariant linear's row plan under ``model``, measured now: ``{plan: count}``
    (e.g. ``{"64": 211}``: unpadded calls of up to 64 rows for every layer)."""
    plans: dict[str, int] = {}
    for m in model.modules():
        if getattr(m, "batch_invariant", False) and hasattr(m, "row_plan"):
            m.timed_rows = timed_rows
            p = m.row_plan()
            name = f"{'padded ' if p.pad else ''}{p.block}"
            plans[name] = plans.get(name, 0) + 1
    return plans


def measure_model(
    model: torch.nn.Module, dtype: torch.dtype, timed_rows: tuple[int, ...] = DEFAULT_TIMED_ROWS, device: torch.device = torch.device("cpu")
) -> dict:
    """Run every probe a batch-invariant forward of ``model`` on torch's ops will need, now (at
    startup, not in the first request): each swapped linear's row plan, grouped attention, the
    one-row attention dtype. Returns a summary for the log:
    ``{"linears": {plan: count}, "grouped_attention": bool, ...}``."""
    from .attention import _upcast_one_row_queries

    plans = measure_linears(model, timed_rows)
    layer = model.layers[0]
    grouped = grouped_attention_is_invariant(dtype, layer.n_heads, layer.n_kv, layer.head_dim, device)
    upcast = _upcast_one_row_queries(dtype, layer.n_heads, layer.n_kv, layer.head_dim, torch.device(device))
    return {"linears": plans, "grouped_attention": grouped, "one_row_attention_in_fp32": upcast}

"""One JSON record per run (``records.jsonl`` in the run directory) and the summary table."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchRecord:
    label: str  # the job's overrides ("plain" for the reference), or why it was skipped
    algorithm: str  # none = plain decoding
    settings: dict  # the speculative keys as given (null = auto) and the resolved tree shape
    target: str  # "in-process" or the server's URL
    dataset: str
    prompts: list[int]  # [start, count]
    max_new_tokens: int
    batch_size: int = 1
    phase: str = "bench"  # bench | tune (grid point on the tuning prompts) | holdout (tuned/auto/plain on held-out prompts)
    tok_s: float | None = None
    output_tokens: int = 0
    seconds: float = 0.0
    speedup: float | None = None  # tok/s over plain decoding's at the same batch size, same prompts
    accept_length: float | None = None  # (accepted draft tokens + verifies) / verifies
    per_position: list[float] = field(default_factory=list)  # acceptance rate per draft depth
    ttft_ms: dict = field(default_factory=dict)  # p50 / p90 / p99
    itl_ms: dict = field(default_factory=dict)
    peak_mem_mb: float | None = None
    equal_plain: str | None = None  # "n/m" requests whose greedy output equals plain's (in-process)
    skipped: str | None = None  # the note when the job's shape is impossible
    machine: str = ""
    config: dict = field(default_factory=dict)  # the composed config


def skipped(label: str, algorithm: str, settings: dict, target: str, ps, max_new_tokens: int, note: str, phase: str = "bench") -> BenchRecord:
    """The record of a job (or grid point) skipped because of ``note``."""
    return BenchRecord(label, algorithm, settings, target, ps.dataset, [int(ps.start), int(ps.num_prompts)], int(max_new_tokens), phase=phase, skipped=note)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    v = sorted(values)

    def q(p):
        return round(1000 * v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))], 2)

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99)}


def append(path: Path, record: BenchRecord) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(asdict(record)) + "\n")


def load(path: Path) -> list[BenchRecord]:
    if not path.exists():
        return []
    return [BenchRecord(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def _f(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def table(records: list[BenchRecord]) -> str:
    """One labelled row per record: run, batch size, tokens/s, speedup, accept length, TTFT and
    ITL p50, peak memory, greedy equality; skipped jobs with their note."""
    width = max([len(r.label) for r in records] + [20])
    head = f"{'run':<{width}} {'phase':<7} {'bs':>3} {'tok/s':>8} {'speedup':>8} {'acc len':>7} {'ttft p50':>9} {'itl p50':>8} {'peak MB':>8} {'== plain':>9}"
    lines = [head, "-" * len(head)]
    for r in records:
        if r.skipped:
            lines.append(f"{r.label:<{width}} skipped: {r.skipped}")
            continue
        lines.append(
            f"{r.label:<{width}} {r.phase:<7} {r.batch_size:>3} {_f(r.tok_s, '8.2f'):>8} {_f(r.speedup, '7.2f') + ('x' if r.speedup else ''):>8} "
            f"{_f(r.accept_length, '7.2f'):>7} {_f(r.ttft_ms.get('p50'), '7.1f') + 'ms':>9} {_f(r.itl_ms.get('p50'), '6.1f') + 'ms':>8} "
            f"{_f(r.peak_mem_mb, '8.0f'):>8} {r.equal_plain or '-':>9}"
        )
    return "\n".join(lines)


def holdout_comparison(records: list[BenchRecord]) -> str:
    """Per algorithm and batch size, tuned vs auto defaults (and plain) on the held-out prompts."""
    held = [r for r in records if r.phase == "holdout" and not r.skipped and r.tok_s]
    lines = []
    for algo in dict.fromkeys(r.algorithm for r in held if r.algorithm != "none"):
        for bs in sorted({r.batch_size for r in held}):
            plain = next((r for r in held if r.algorithm == "none" and r.batch_size == bs), None)
            autos = [r for r in held if r.algorithm == algo and r.batch_size == bs and "tuned" not in r.label]
            tuneds = [r for r in held if r.algorithm == algo and r.batch_size == bs and "tuned" in r.label] or autos
            if not autos or plain is None:
                continue
            same = " (tuned = auto defaults)" if tuneds is autos else f" [{tuneds[0].label.split('tuned ', 1)[-1]}]"
            auto, tuned = statistics.median(r.tok_s for r in autos), statistics.median(r.tok_s for r in tuneds)
            ratio = statistics.median(t.tok_s / a.tok_s for a, t in zip(autos, tuneds))
            rounds = ""
            if len(autos) > 1:  # tune.holdout_rounds: the median of each round's ratio (adjacent runs)
                each = ", ".join(f"{t.tok_s / a.tok_s:.3f}" for a, t in zip(autos, tuneds))
                rounds = f" (median of {len(autos)} alternated rounds: {each})"
            lines.append(
                f"held-out {algo} batch {bs}: tuned {tuned:.2f} tok/s vs auto {auto:.2f} = {ratio:.3f}x{rounds}; "
                f"vs plain {plain.tok_s:.2f}: tuned {tuned / plain.tok_s:.2f}x, auto {auto / plain.tok_s:.2f}x{same}"
            )
    return "\n".join(lines)

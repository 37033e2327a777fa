"""``specfw tune``: for the configured model, machine and algorithm, measure a small grid of tree
settings per batch-size bucket on the tuning prompts, write the best of each bucket to the
tuned-defaults file (``core/tuned.py``), then measure tuned vs auto defaults vs plain decoding on
held-out prompts, in the same run."""

from __future__ import annotations

import copy
import itertools
import time
from pathlib import Path

from tqdm import tqdm

from . import records as rec
from .run import _Tok, current_run_dir, measure, plain_reference, skip_note, summarize, to_record, with_concurrency

TREE_KEYS = ("num_steps", "topk", "num_draft_tokens")
OPTIONAL_KEYS = ("draft_assist", "draft_model_quantization")  # grid keys a point carries only when the grid varies them or sets them
SHARED_KEYS = (*TREE_KEYS, "adaptive_draft", *OPTIONAL_KEYS)  # every algorithm's grid keys, each with its own tune.<key> list


def with_settings(cfg, point: dict):
    """A copy of ``cfg`` whose speculative tree keys are ``point`` (empty: the auto defaults;
    ``draft_assist``, ``draft_model_quantization`` and the algorithm's own keys stay as
    configured unless the point sets them)."""
    c = copy.deepcopy(cfg)
    for k in (*TREE_KEYS, "adaptive_draft"):
        c.speculative[k] = point.get(k, "auto" if k == "adaptive_draft" else None)
    for k, v in point.items():  # the optional and the algorithm's own keys
        if k not in (*TREE_KEYS, "adaptive_draft"):
            c.speculative[k] = v
    return c


def algorithm_keys(cfg) -> dict[str, list[str]]:
    """The grid's values for the algorithm's own keys: its ``tune_grid`` (e.g. ngram's
    ``match_type``), each key replaced or joined by ``tune.keys``. Raises ``ConfigError`` naming
    ``tune.keys.<key>`` for a key the algorithm's config does not have (or one with its own
    ``tune.`` list) or an empty list."""
    import dataclasses

    from ..config import ConfigError
    from ..plugins import plugin_manager

    algo = plugin_manager().algorithms[str(cfg.speculative.algorithm)]
    own = {f.name for f in dataclasses.fields(algo.config_class)} - {*SHARED_KEYS, "algorithm"}
    keys = {k: [str(v) for v in vs] for k, vs in getattr(algo.config_class, "tune_grid", {}).items()}
    for k, vs in (cfg.tune.get("keys") or {}).items():
        if k not in own:
            raise ConfigError(
                f"tune.keys.{k}",
                f"is not a key of speculative={algo.name} that tune varies; its keys: {sorted(own)} "
                "(tree keys, adaptive_draft, draft_assist and draft_model_quantization have their own tune.<key> lists)",
            )
        if not len(vs):
            raise ConfigError(f"tune.keys.{k}", "must list at least one value")
        keys[k] = [None if v is None else str(v) for v in vs]
    return keys


def grid(cfg) -> tuple[list[dict], list[tuple[dict, str]]]:
    """The auto point ({}, unless ``tune.include_auto=false``) and the grid's runnable points;
    the skipped ones with their note.
    Keys the algorithm does not use (its ``unused_keys``, e.g. ngram's num_steps/topk) are left out."""
    from ..plugins import plugin_manager

    t = cfg.tune
    algo = plugin_manager().algorithms[str(cfg.speculative.algorithm)]
    keys = [k for k in TREE_KEYS if k not in getattr(algo.config_class, "unused_keys", ())]
    modes = [str(v).lower() for v in t.adaptive_draft]
    optional = {k: list(t.get(k, [None])) for k in OPTIONAL_KEYS}
    own = algorithm_keys(cfg)
    points, skipped = ([{}] if t.include_auto else []), []
    n = len(keys)
    for combo in itertools.product(*[list(t[k]) for k in keys], modes, *optional.values(), *own.values()):
        point = dict(zip(keys, (int(v) for v in combo[:n])), adaptive_draft=combo[n])
        for k, v in zip(optional, combo[n + 1 : n + 1 + len(optional)]):
            if v is not None or len(optional[k]) > 1:
                point[k] = None if v is None else str(v)
        point.update(zip(own, combo[n + 1 + len(optional) :]))
        note = skip_note(with_settings(cfg, point))
        if note:
            skipped.append((point, note))
        elif point not in points:
            points.append(point)
    return points, skipped


def describe(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "auto defaults"


def tune_task(cfg) -> None:
    from .. import tuned
    from ..config import validate
    from ..sampling import SamplingParams
    from .config import validate_tune
    from .prompts import load_prompts, token_ids

    validate_tune(cfg)
    validate(cfg)
    t = cfg.tune
    sizes = [int(b) for b in t.batch_sizes]
    with_concurrency(cfg, sizes)
    run_dir, in_sweep = current_run_dir(t, "tune")
    algo = str(cfg.speculative.algorithm)
    params = SamplingParams(max_new_tokens=t.max_new_tokens, temperature=0)
    tok = _Tok.for_model(cfg)
    tune_ids = token_ids(tok, load_prompts(t.prompts, "tune.prompts"))
    hold_ids = token_ids(tok, load_prompts(t.holdout, "tune.holdout")) if t.holdout.num_prompts else []
    points, skipped = grid(cfg)
    for point, note in skipped:
        print(f"[tune] {algo}: skipped {describe(point)}: {note}", flush=True)
        rec.append(run_dir / "records.jsonl", rec.skipped(f"{algo} {describe(point)}", algo, point, "in-process", t.prompts, t.max_new_tokens, note, "tune"))

    def record(ps, phase):
        def make(c, shape, label, bs, res, plain):
            return to_record(c, shape, label, bs, res, plain, target="in-process", ps=ps, max_new_tokens=t.max_new_tokens, greedy=True, phase=phase)

        return make

    plain = plain_reference(cfg, run_dir, tune_ids, params, sizes, record(t.prompts, "tune"))
    t0 = time.perf_counter()
    measured: dict[int, list[tuple[dict, float]]] = {b: [] for b in sizes}
    for point in tqdm(points, desc=f"tune {algo}: grid", unit="point"):
        c = with_settings(cfg, point)
        for bs in sizes:
            res, shape = measure(c, tune_ids, params, bs, f"{describe(point)} bs={bs}")
            measured[bs].append((point, res.tok_s))
            rec.append(run_dir / "records.jsonl", record(t.prompts, "tune")(c, shape, f"{algo} {describe(point)}", bs, res, plain[bs]))
    minutes = (time.perf_counter() - t0) / 60
    best = {}
    for bs in sizes:
        point, tok_s = max(measured[bs], key=lambda m: m[1])
        auto = next((s for p, s in measured[bs] if not p), None)
        best[bs] = point
        entry = tuned.TunedEntry(
            num_steps=point.get("num_steps"),
            topk=point.get("topk"),
            num_draft_tokens=point.get("num_draft_tokens"),
            adaptive_draft=point.get("adaptive_draft", "auto"),
            draft_assist=point.get("draft_assist", cfg.speculative.get("draft_assist")),
            draft_model_quantization=point.get("draft_model_quantization", cfg.speculative.get("draft_model_quantization")),
            keys={k: v for k, v in point.items() if k not in SHARED_KEYS},
            tok_s=round(tok_s, 3),
            auto_tok_s=round(auto, 3) if auto is not None else None,
            measured=dict(
                dataset=t.prompts.dataset,
                prompts=[int(t.prompts.start), int(t.prompts.num_prompts)],
                max_new_tokens=int(t.max_new_tokens),
                grid_points=len(points),
                minutes=round(minutes, 2),
                date=time.strftime("%Y-%m-%d"),
            ),
        )
        path = tuned.write_entry(cfg, algo, bs, entry)
        auto_text = "-" if auto is None else f"{auto:.2f}"
        print(f"[tune] {algo} batch {bs}: best {describe(point)} {tok_s:.2f} tok/s (auto {auto_text}); written to {path}", flush=True)
    if hold_ids:
        if not any(best.values()):
            print(f"[tune] {algo}: the auto defaults won every bucket; held-out: auto vs plain", flush=True)
        holdout(cfg, run_dir, algo, hold_ids, params, sizes, best, record(t.holdout, "holdout"), int(t.get("holdout_rounds", 1)))
    if not in_sweep:
        summarize(run_dir)


def holdout(cfg, run_dir: Path, algo: str, ids, params, sizes, best: dict, make_record, rounds: int = 1) -> None:
    """Plain, auto and tuned on the held-out prompts (tuned once per distinct best point); with
    ``rounds`` > 1, auto and tuned alternate that many times (A B A B ...), each run recorded
    (``records.holdout_comparison`` takes the median of the rounds' ratios)."""
    plain = plain_reference(cfg, run_dir, ids, params, sizes, make_record)
    points = [{}] + [dict(p) for p in dict.fromkeys(map(lambda p: tuple(p.items()), best.values())) if p]
    for r in range(rounds):
        for point in points:
            c = with_settings(cfg, point)
            for bs in sizes:
                if point and best[bs] != point:
                    continue
                label = f"{algo} {'tuned ' if point else ''}{describe(point)}"
                res, shape = measure(c, ids, params, bs, f"held-out {label} bs={bs}" + (f" round {r + 1}/{rounds}" if rounds > 1 else ""))
                rec.append(run_dir / "records.jsonl", make_record(c, shape, label, bs, res, plain[bs]))

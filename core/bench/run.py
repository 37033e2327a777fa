"""``specfw bench``: one job = one composed config, measured at every ``bench.batch_sizes``
level; a ``-m`` sweep's jobs share one run directory (``SweepCallback``), the plain reference
(measured once per process, model and prompt set) and the summary printed at the end."""

from __future__ import annotations

import copy
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from hydra.experimental.callback import Callback

from . import records as rec
from .drive import RunResult, run_engine
from .records import BenchRecord

SHAPE_KEYS = ("num_steps", "topk", "num_draft_tokens")


@dataclass
class Sweep:
    dir: Path
    multirun: bool


_SWEEP: Sweep | None = None  # set for the length of a -m sweep (Hydra's basic launcher runs jobs in this process)
_PLAIN: dict = {}  # (run dir, model/engine config, prompts, params, batch size) -> RunResult


def new_run_dir(out_dir: str, name: str | None, prefix: str) -> Path:
    path = Path(out_dir) / (name or f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
    path.mkdir(parents=True, exist_ok=True)
    return path


class SweepCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/bench.yaml, conf/tune.yaml): one run directory
    for all jobs of a sweep, the summary once they all ran."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _SWEEP
        opts, prefix = _options(config)
        _SWEEP = Sweep(new_run_dir(opts.out_dir, opts.name, prefix), multirun=True)

    def on_multirun_end(self, config, **kwargs) -> None:
        global _SWEEP
        if _SWEEP is not None:
            summarize(_SWEEP.dir)
        _SWEEP = None


def _options(config):
    return (config.bench, "bench") if "bench" in config else (config.tune, "tune")


def current_run_dir(opts, prefix: str) -> tuple[Path, bool]:
    """The sweep's directory (and True) inside a -m sweep, else a new one for this run."""
    if _SWEEP is not None:
        return _SWEEP.dir, True
    return new_run_dir(opts.out_dir, opts.name, prefix), False


def job_label(cfg) -> str:
    """The job's overrides other than bench.* / tune.* / model.path (``speculative=<algo>`` when none)."""
    from hydra.core.hydra_config import HydraConfig

    task = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    own = [o for o in task if not o.lstrip("+~").startswith(("bench.", "tune.", "hydra.", "model.path="))]  # the summary's header names the model
    return " ".join(own) or f"speculative={cfg.speculative.get('algorithm', 'none')}"


def skip_note(cfg) -> str | None:
    """Why this job's tree shape cannot run (then it is skipped, as SGLang's bench_speculative.py
    skips impossible shapes): a shape rule fails, or a given ``num_draft_tokens`` would have to be
    adjusted (a chain of ``num_steps`` takes ``num_steps + 1``; a tree at most ``topk + (num_steps
    - 1) * topk^2 + 1``). None when it runs."""
    from ..config import ConfigError, speculative_config

    if str(cfg.speculative.get("algorithm", "none")) == "none":
        return None
    shape_log = logging.getLogger("specfw.speculative.config")
    level, shape_log.level = shape_log.level, logging.ERROR  # adjustments are reported here as skips, not warnings
    try:
        spec = speculative_config(cfg)
        spec.validate()
        shape = spec.resolve_shape("")
    except ConfigError as e:
        return str(e)
    finally:
        shape_log.level = level
    given = {k: cfg.speculative.get(k) for k in SHAPE_KEYS}
    if given["num_draft_tokens"] is not None and shape.num_draft_tokens != given["num_draft_tokens"]:
        if shape.topk == 1:
            why = f"a chain of num_steps={shape.num_steps} takes num_draft_tokens={shape.num_steps + 1}"
        else:
            why = f"num_steps={shape.num_steps}, topk={shape.topk} offer at most {shape.num_draft_tokens} (topk + (num_steps - 1) * topk^2 + 1)"
        return f"speculative.num_draft_tokens={given['num_draft_tokens']} is impossible: {why}"
    return None


def settings_of(cfg, shape=None) -> dict:
    """The speculative keys as given (None = auto) and, when known, the resolved tree shape."""
    out = {k: cfg.speculative.get(k) for k in (*SHAPE_KEYS, "adaptive_draft") if k in cfg.speculative}
    if shape is not None:
        out["shape"] = [shape.num_steps, shape.topk, shape.num_draft_tokens]
    return out


def plain_config(cfg):
    from omegaconf import OmegaConf, open_dict

    from ..config import SpeculativeConfig

    plain = copy.deepcopy(cfg)
    with open_dict(plain):
        plain.speculative = OmegaConf.structured(SpeculativeConfig(algorithm="none"))
    return plain


def with_concurrency(cfg, batch_sizes) -> None:
    """The engine must admit the largest concurrency level."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.engine.max_running_requests = max(int(cfg.engine.max_running_requests), *[int(b) for b in batch_sizes])


def measure(cfg, ids, params, batch_size: int, desc: str) -> tuple[RunResult, object]:
    """``ids`` through a fresh engine for ``cfg`` at ``batch_size`` (result, resolved tree shape).
    Fresh per run: drafter state that outlives requests (ngram's trie) would otherwise carry one
    run's outputs into the next run over the same prompts. The warm-up prompt is not in any set."""
    from ..engine import Engine
    from ..sampling import SamplingParams

    engine = Engine(cfg)
    try:
        engine.generate([engine.tokenizer("Warm-up: count to three.")["input_ids"]], SamplingParams(max_new_tokens=4, temperature=0))
        return run_engine(engine, ids, params, batch_size, desc), engine.tree_shape
    finally:
        engine.close()  # a TP engine's other ranks end here (the next run starts its own)
        del engine
        gc.collect()


def plain_reference(cfg, run_dir: Path, ids, params, batch_sizes, make_record, beside: str | None = None) -> dict[int, RunResult]:
    """Plain decoding of ``ids`` at each batch size, measured once per run directory and setup
    (a sweep's jobs share it); a new measurement is recorded as a ``plain`` record. ``beside`` (a
    job's label, ``bench.plain_each_job``): measured again right before that job, recorded as
    ``plain (beside <label>)``."""
    from omegaconf import OmegaConf

    setup = OmegaConf.to_yaml(OmegaConf.create({"model": OmegaConf.to_container(cfg.model), "engine": OmegaConf.to_container(cfg.engine)}))
    key = (str(run_dir), setup, tuple(map(tuple, ids)), repr(params), beside)
    cached = _PLAIN.setdefault(key, {})
    pcfg = plain_config(cfg)
    for b in batch_sizes:
        if b not in cached:
            cached[b], _ = measure(pcfg, ids, params, b, f"plain bs={b}")
            rec.append(run_dir / "records.jsonl", make_record(pcfg, None, "plain" if beside is None else f"plain (beside {beside})", b, cached[b], None))
    return cached


def to_record(cfg, shape, label, batch_size, res: RunResult, plain: RunResult | None, *, target, ps, max_new_tokens, greedy, phase="bench") -> BenchRecord:
    """``shape``: the engine's resolved tree shape (None: plain, or a server's)."""
    from omegaconf import OmegaConf

    from ..machine import cpu_description

    equal = None
    if plain is not None and greedy:
        equal = f"{sum(a == b for a, b in zip(res.outputs, plain.outputs))}/{len(res.outputs)}"
    return BenchRecord(
        label=label,
        algorithm=str(cfg.speculative.get("algorithm", "none")),
        settings=settings_of(cfg, shape),
        target=target,
        dataset=ps.dataset,
        prompts=[int(ps.start), int(ps.num_prompts)],
        max_new_tokens=int(max_new_tokens),
        batch_size=int(batch_size),
        phase=phase,
        tok_s=round(res.tok_s, 3),
        output_tokens=res.output_tokens,
        seconds=round(res.seconds, 3),
        speedup=round(res.tok_s / plain.tok_s, 4) if plain is not None and plain.tok_s else None,
        accept_length=round(res.accept_length, 4) if res.accept_length else None,
        per_position=res.per_position,
        ttft_ms=rec.percentiles(res.ttft),
        itl_ms=rec.percentiles(res.itl),
        peak_mem_mb=round(res.peak_mem_mb, 1) if res.peak_mem_mb else None,
        equal_plain=equal,
        machine=cpu_description(),
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    )


def bench_task(cfg) -> None:
    from ..config import validate
    from .config import validate_bench

    validate_bench(cfg)
    b = cfg.bench
    run_dir, in_sweep = current_run_dir(b, "bench")
    label, sizes = job_label(cfg), [int(x) for x in b.batch_sizes]
    if b.url:  # the server's own settings are not in this config
        label = f"{b.url} {label}" if label != "speculative=none" else str(b.url)
    print(f"[bench] {label}", flush=True)
    common = dict(target=b.url or "in-process", ps=b.prompts, max_new_tokens=b.max_new_tokens, greedy=b.temperature == 0)
    note = skip_note(cfg)
    if note:
        print(f"[bench] skipped: {note}", flush=True)
        algo = str(cfg.speculative.get("algorithm"))
        rec.append(run_dir / "records.jsonl", rec.skipped(label, algo, settings_of(cfg), common["target"], b.prompts, b.max_new_tokens, note))
    else:
        validate(cfg)
        (run_url if b.url else run_in_process)(cfg, run_dir, label, sizes, common)
    if not in_sweep:
        summarize(run_dir)


def run_in_process(cfg, run_dir: Path, label: str, sizes: list[int], common: dict) -> None:
    """Plain reference (shared by a sweep), then this job's engine at every concurrency level."""
    from ..sampling import SamplingParams
    from .prompts import load_prompts, token_ids

    b = cfg.bench
    with_concurrency(cfg, sizes)
    params = SamplingParams(max_new_tokens=b.max_new_tokens, temperature=b.temperature, ignore_eos=b.ignore_eos, seed=0 if b.temperature else None)
    ids = token_ids(_Tok.for_model(cfg), load_prompts(b.prompts))
    spec = str(cfg.speculative.get("algorithm", "none")) != "none"

    def make_record(c, shape, lab, bs, res, plain):
        return to_record(c, shape, lab, bs, res, plain, **common)

    beside = label if spec and b.get("plain_each_job", False) else None
    plain = plain_reference(cfg, run_dir, ids, params, sizes, make_record, beside) if b.compare_plain or not spec else {}
    for bs in sizes if spec else []:
        res, shape = measure(cfg, ids, params, bs, f"{label} bs={bs}")
        rec.append(run_dir / "records.jsonl", make_record(cfg, shape, label, bs, res, plain.get(bs)))


class _Tok:
    """The tokenizer side of an engine (what ``prompts.token_ids`` uses), loaded as the engine
    loads it, so prompts are tokenized once, before any model is built."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def for_model(cls, cfg) -> "_Tok":
        from transformers import AutoTokenizer

        from ..model_loader import resolve_model_path

        tok = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model.path, cfg.model.revision))
        tok.model_input_names = ["input_ids", "attention_mask"]
        return cls(tok)

    def tokenize_chat(self, messages):
        from ..engine import Engine

        return Engine.tokenize_chat(self, messages)


def run_url(cfg, run_dir: Path, label: str, sizes: list[int], common: dict) -> None:
    from .client import run_server
    from .prompts import load_prompts

    b = cfg.bench
    prompts = load_prompts(b.prompts)
    for bs in sizes:
        res = run_server(b.url, prompts, b.max_new_tokens, b.temperature, b.ignore_eos, bs, api_key=b.api_key, model=b.served_model, desc=f"{b.url} bs={bs}")
        rec.append(run_dir / "records.jsonl", to_record(cfg, None, label, bs, res, None, **common))


def summarize(run_dir: Path) -> None:
    """Print the run's table (and write it to summary.txt) and draw summary.png."""
    from .plot import plot_holdout, plot_summary

    records = rec.load(run_dir / "records.jsonl")
    if not records:
        return
    measured = [r for r in records if not r.skipped]
    head = ""
    if measured:
        r0 = measured[0]
        head = (
            f"model {r0.config.get('model', {}).get('path') or 'demo'} ({r0.config.get('model', {}).get('dtype')}); "
            f"{r0.dataset} prompts {r0.prompts[0] + 1}-{r0.prompts[0] + r0.prompts[1]}, {r0.max_new_tokens} new tokens, target {r0.target}\n"
            f"machine: {r0.machine}\n"
        )
    text = head + rec.table(records)
    comparison = rec.holdout_comparison(records)
    if comparison:
        text += "\n\n" + comparison
    print("\n" + text, flush=True)
    (run_dir / "summary.txt").write_text(text + "\n")
    png = plot_summary(records, run_dir / "summary.png", head.strip())
    held = next((r for r in measured if r.phase == "holdout"), None)
    held_head = head
    if held is not None:  # the held-out prompts, not the tuning ones
        first, last = held.prompts[0] + 1, held.prompts[0] + held.prompts[1]
        held_head = head.replace(f"{r0.dataset} prompts {r0.prompts[0] + 1}-{r0.prompts[0] + r0.prompts[1]}", f"{held.dataset} prompts {first}-{last}", 1)
    if plot_holdout(records, run_dir / "holdout.png", "held-out prompts: plain, auto defaults, tuned\n" + held_head.strip()):
        print(f"[bench] tuned vs auto on the held-out prompts: {run_dir / 'holdout.png'}", flush=True)
    print(
        f"[bench] records: {run_dir / 'records.jsonl'}; table: {run_dir / 'summary.txt'}" + (f"; plot: {png}" if png else " (no plot: matplotlib missing)"),
        flush=True,
    )

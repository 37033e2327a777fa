"""Schemas of ``specfw bench`` and ``specfw tune`` (field comments are the config reference)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import ConfigError, SpecfwConfig

DATASETS = ("mtbench", "humaneval", "sharegpt", "jsonl")


@dataclass
class PromptSet:
    dataset: str = "mtbench"              # mtbench (first turns, chat) | humaneval (raw completion) | sharegpt (first user turns) | jsonl (path: {"messages": [...]}, {"prompt": ...}, {"question": ...} as GSM8K's test.jsonl, or strings)
    path: Optional[str] = None            # the JSONL file of dataset=jsonl
    start: int = 0                        # index of the first prompt (0-based: MT-bench questions 41-80 are start=40 num_prompts=40)
    num_prompts: int = 16                 # prompts taken from start on


@dataclass
class BenchOptions:
    prompts: PromptSet = field(default_factory=PromptSet)
    max_new_tokens: int = 64              # tokens per request (fewer when the model stops, unless ignore_eos)
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # concurrency levels: requests kept in flight (closed loop)
    url: Optional[str] = None             # an OpenAI-compatible server (http://host:port) instead of the in-process engine; specfw's /metrics adds accept length
    api_key: Optional[str] = None         # bearer key for url (null: env SPECFW_API_KEY / OPENAI_API_KEY if set)
    served_model: Optional[str] = None    # model name sent to url; null = the first of its /v1/models
    compare_plain: bool = True            # in-process: also decode without speculation (speedup, and whether greedy output equals plain)
    plain_each_job: bool = False          # in-process: measure plain again right before every speculative job of a sweep (speedups against an adjacent run: for machines whose speed drifts during a sweep, e.g. shared VMs)
    temperature: float = 0.0              # 0 = greedy
    ignore_eos: bool = False              # generate exactly max_new_tokens
    out_dir: str = "bench_results"        # records (records.jsonl), summary and plot go to out_dir/<run name>/
    name: Optional[str] = None            # run directory name; null = bench-<date-time>


@dataclass
class BenchConfig(SpecfwConfig):
    bench: BenchOptions = field(default_factory=BenchOptions)


@dataclass
class TuneOptions:
    prompts: PromptSet = field(default_factory=lambda: PromptSet(num_prompts=40))  # the prompts the grid is measured on
    holdout: PromptSet = field(default_factory=lambda: PromptSet(start=40, num_prompts=40))  # tuned vs auto vs plain measured here (num_prompts=0: skip)
    holdout_rounds: int = 1               # held-out: auto and tuned measured alternately this many times; the margin is the median of the rounds' tuned/auto ratios (a machine whose speed drifts needs 3+)
    max_new_tokens: int = 64              # tokens per request
    batch_sizes: list[int] = field(default_factory=lambda: [1])  # batch-size buckets: a best setting per concurrency level
    num_steps: list[int] = field(default_factory=lambda: [3, 5])  # grid values (dropped for an algorithm that does not use the key)
    topk: list[int] = field(default_factory=lambda: [1, 4])  # grid values
    num_draft_tokens: list[int] = field(default_factory=lambda: [4, 8])  # grid values
    adaptive_draft: list[str] = field(default_factory=lambda: ["true", "false"])  # grid values (auto | true | false)
    draft_assist: list[Optional[str]] = field(default_factory=lambda: [None])  # grid values of speculative.draft_assist (e.g. [null,ngram]; a value the algorithm cannot take is skipped with a note)
    draft_model_quantization: list[Optional[str]] = field(default_factory=lambda: [None])  # grid values of speculative.draft_model_quantization (e.g. [null,w8a8_int8]; an algorithm without a draft model skips the non-null ones with a note)
    keys: dict[str, list[Any]] = field(default_factory=dict)  # grid values of the algorithm's own speculative keys, over its defaults (ngram: match_type [BFS, PROB]); a new key takes Hydra's +: +tune.keys.match_type=[PROB]
    include_auto: bool = True             # the auto defaults are a grid point too (tuned never loses to them on the tuning prompts)
    out_dir: str = "bench_results"        # records, summary and plot go to out_dir/<run name>/
    name: Optional[str] = None            # run directory name; null = tune-<date-time>


@dataclass
class TuneConfig(SpecfwConfig):
    tune: TuneOptions = field(default_factory=TuneOptions)


def check_prompt_set(ps, key: str) -> None:
    if ps.dataset not in DATASETS:
        raise ConfigError(f"{key}.dataset", f"'{ps.dataset}' is not one of {list(DATASETS)}")
    if ps.dataset == "jsonl" and not ps.path:
        raise ConfigError(f"{key}.path", "dataset=jsonl needs the path of a JSONL file")
    if ps.start < 0:
        raise ConfigError(f"{key}.start", f"must be >= 0, got {ps.start}")
    if ps.num_prompts < 0:
        raise ConfigError(f"{key}.num_prompts", f"must be >= 0, got {ps.num_prompts}")


def check_batch_sizes(sizes, key: str) -> None:
    if not sizes or any(int(b) < 1 for b in sizes):
        raise ConfigError(key, f"must be a non-empty list of positive integers, got {list(sizes)}")


def validate_bench(cfg) -> None:
    b = cfg.bench
    check_prompt_set(b.prompts, "bench.prompts")
    if b.prompts.num_prompts < 1:
        raise ConfigError("bench.prompts.num_prompts", f"must be >= 1, got {b.prompts.num_prompts}")
    check_batch_sizes(b.batch_sizes, "bench.batch_sizes")
    if b.max_new_tokens < 1:
        raise ConfigError("bench.max_new_tokens", f"must be >= 1, got {b.max_new_tokens}")
    if b.url and not str(b.url).startswith(("http://", "https://")):
        raise ConfigError("bench.url", f"must start with http:// or https://, got '{b.url}'")
    if not 0 <= b.temperature <= 2:
        raise ConfigError("bench.temperature", f"must be in [0, 2], got {b.temperature}")


def validate_tune(cfg) -> None:
    from .. import tuned  # noqa: F401  (the module serve reads; imported here so a broken one fails tune first)

    t = cfg.tune
    check_prompt_set(t.prompts, "tune.prompts")
    check_prompt_set(t.holdout, "tune.holdout")
    if t.prompts.num_prompts < 1:
        raise ConfigError("tune.prompts.num_prompts", f"must be >= 1, got {t.prompts.num_prompts}")
    check_batch_sizes(t.batch_sizes, "tune.batch_sizes")
    if t.max_new_tokens < 1:
        raise ConfigError("tune.max_new_tokens", f"must be >= 1, got {t.max_new_tokens}")
    if t.get("holdout_rounds", 1) < 1:
        raise ConfigError("tune.holdout_rounds", f"must be >= 1, got {t.holdout_rounds}")
    for v in t.adaptive_draft:
        if str(v).lower() not in ("auto", "true", "false"):
            raise ConfigError("tune.adaptive_draft", f"'{v}' is not one of ['auto', 'true', 'false']")
    if str(cfg.speculative.get("algorithm", "none")) == "none":
        from ..plugins import plugin_manager

        names = sorted(a.name for a in plugin_manager().describe())
        raise ConfigError("speculative", f"specfw tune needs an algorithm to tune: speculative=<one of {names}>")
    from .tune import algorithm_keys

    algorithm_keys(cfg)  # tune.keys: the algorithm's own keys, each with values

"""`specfw bench` and `specfw tune` on the tiny random model: a sweep's records, table and plot,
the skip rule, the URL mode against a live `specfw serve`, and the tune -> serve round trip."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server_helpers import CliProcess, free_port

SPECFW = [str(Path(sys.executable).parent / "specfw")]


def specfw(args: list[str], tmp_path: Path, timeout: float = 240) -> str:
    r = subprocess.run(SPECFW + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]


def compose(command: str, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_module
    from specfw.config_store import register_configs

    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        return hydra_compose(command, overrides=overrides)


def test_sweep_writes_records_table_and_plot(tiny_model_dir, tmp_path):
    """Two ngram tree sizes (and one impossible size, skipped with a note), at 1 and 2 requests in flight."""
    out = specfw(
        [
            "bench",
            "-m",
            "speculative=ngram",
            "speculative.num_draft_tokens=4,8,1",
            "speculative.adaptive_draft=false",  # draft every step: accept length is defined for every run
            f"model.path={tiny_model_dir}",
            "bench.prompts.num_prompts=3",
            "bench.max_new_tokens=12",
            "bench.batch_sizes=[1,2]",
            f"bench.out_dir={tmp_path}",
            "bench.name=sweep",
        ],
        tmp_path,
    )
    run_dir = tmp_path / "sweep"
    recs = records(run_dir)
    plain = [r for r in recs if r["algorithm"] == "none"]
    spec = [r for r in recs if r["algorithm"] == "ngram" and not r["skipped"]]
    skipped = [r for r in recs if r["skipped"]]
    assert [r["batch_size"] for r in plain] == [1, 2]  # measured once, shared by the sweep's jobs
    assert sorted((r["settings"]["num_draft_tokens"], r["batch_size"]) for r in spec) == [(4, 1), (4, 2), (8, 1), (8, 2)]
    for r in spec:
        assert r["tok_s"] > 0 and 0 < r["output_tokens"] <= 36
        assert r["equal_plain"] == "3/3"  # greedy speculative == plain greedy
        assert r["accept_length"] >= 1 and r["per_position"] and r["speedup"] > 0
        assert set(r["ttft_ms"]) == {"p50", "p90", "p99"} and r["itl_ms"]["p50"] > 0 and r["peak_mem_mb"] > 0
        assert "Xeon" in r["machine"] or "cpus" in r["machine"]
    assert len(skipped) == 1 and "num_draft_tokens" in skipped[0]["skipped"] and ">= 2" in skipped[0]["skipped"]
    table = (run_dir / "summary.txt").read_text()
    assert "speculative.num_draft_tokens=8" in table and "skipped: speculative.num_draft_tokens" in table
    assert table in out  # printed once, at the end of the sweep
    assert (run_dir / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_each_job_measures_plain_beside_every_job(tiny_model_dir, tmp_path):
    """bench.plain_each_job=true: each speculative job gets its own adjacent plain run, and its
    speedup is against that one (for machines whose speed drifts during a sweep)."""
    specfw(
        ["bench", "-m", "speculative=ngram", "speculative.num_draft_tokens=4,8", f"model.path={tiny_model_dir}", "bench.plain_each_job=true"]
        + ["bench.prompts.num_prompts=2", "bench.max_new_tokens=8", f"bench.out_dir={tmp_path}", "bench.name=each"],
        tmp_path,
    )
    recs = records(tmp_path / "each")
    plain = [r for r in recs if r["algorithm"] == "none"]
    spec = [r for r in recs if r["algorithm"] == "ngram"]
    assert [r["label"] for r in plain] == [f"plain (beside {s['label']})" for s in spec] and len(spec) == 2
    for p, s in zip(plain, spec):
        assert s["speedup"] == pytest.approx(s["tok_s"] / p["tok_s"], rel=1e-3) and s["equal_plain"] == "2/2"


@pytest.mark.parametrize(
    "shape, note",
    [
        (["speculative.num_steps=3", "speculative.topk=4", "speculative.num_draft_tokens=8"], None),
        (["speculative.num_steps=3", "speculative.topk=1", "speculative.num_draft_tokens=6"], "a chain of num_steps=3 takes num_draft_tokens=4"),
        (["speculative.num_steps=2", "speculative.topk=2", "speculative.num_draft_tokens=8"], "offer at most 7"),
        (["speculative.num_steps=3", "speculative.topk=4"], "set num_steps, topk and num_draft_tokens all three or none"),
        ([], None),
    ],
)
def test_skip_rule(shape, note):
    from specfw.bench.run import skip_note

    got = skip_note(compose("bench", ["speculative=eagle3", *shape]))
    assert got is None if note is None else note in got


def test_bench_config_errors_name_the_key():
    from specfw.bench.config import validate_bench, validate_tune
    from specfw.config import ConfigError

    with pytest.raises(ConfigError, match=r"bench.prompts.dataset: 'gsm9k' is not one of \['mtbench', 'humaneval', 'sharegpt', 'jsonl'\]"):
        validate_bench(compose("bench", ["bench.prompts.dataset=gsm9k"]))
    with pytest.raises(ConfigError, match=r"bench.batch_sizes"):
        validate_bench(compose("bench", ["bench.batch_sizes=[0]"]))
    with pytest.raises(ConfigError, match=r"speculative: specfw tune needs an algorithm.*eagle3"):
        validate_tune(compose("tune", []))


def test_tuned_defaults_only_without_given_tree_keys(tmp_path):
    from specfw import tuned

    base = ["speculative=eagle3", f"tuned.dir={tmp_path}"]
    cfg = compose("serve", base)
    tuned.write_entry(cfg, "eagle3", 1, tuned.TunedEntry(num_steps=3, topk=1, num_draft_tokens=4, adaptive_draft="false", tok_s=2.0, auto_tok_s=1.0))
    tuned.write_entry(cfg, "eagle3", 4, tuned.TunedEntry(num_steps=5, topk=4, num_draft_tokens=8, adaptive_draft="true", tok_s=2.0, auto_tok_s=1.0))
    assert "bucket 1" in tuned.apply_tuned(cfg) and (cfg.speculative.num_steps, cfg.speculative.adaptive_draft) == (3, "false")
    cfg = compose("serve", base + ["tuned.batch_size=6"])
    assert "bucket 4" in tuned.apply_tuned(cfg) and cfg.speculative.num_draft_tokens == 8
    for given in (["speculative.topk=1"], ["speculative.adaptive_draft=false"], ["tuned.use=false"], ["speculative=ngram"]):
        cfg = compose("serve", base + given)
        assert tuned.apply_tuned(cfg) is None, given
    assert cfg.speculative.num_draft_tokens is None


def test_tune_grid_takes_the_draft_assist_and_serve_applies_it(tmp_path):
    from specfw import tuned
    from specfw.bench.tune import grid

    overrides = ["tune.num_steps=[3]", "tune.topk=[1]", "tune.num_draft_tokens=[4]", "tune.adaptive_draft=[false]", "tune.draft_assist=[null,ngram]"]
    points, skipped = grid(compose("tune", ["speculative=eagle3", *overrides]))
    chain = dict(num_steps=3, topk=1, num_draft_tokens=4, adaptive_draft="false")
    assert points == [{}, dict(chain, draft_assist=None), dict(chain, draft_assist="ngram")]
    assert not skipped
    points, skipped = grid(compose("tune", ["speculative=ngram", *overrides]))
    plain_assist = dict(num_draft_tokens=4, adaptive_draft="false", draft_assist=None)
    assert points == [{}, dict(plain_assist, match_type="BFS"), dict(plain_assist, match_type="PROB")]  # ngram's own match_type grid
    assert len(skipped) == 2 and all("is the algorithm itself" in note for _, note in skipped)  # ngram cannot assist itself

    base = ["speculative=eagle3", f"tuned.dir={tmp_path}"]
    cfg = compose("serve", base)
    tuned.write_entry(cfg, "eagle3", 1, tuned.TunedEntry(num_steps=5, topk=4, num_draft_tokens=8, adaptive_draft="true", draft_assist="ngram", tok_s=2.0))
    assert "draft_assist=ngram" in tuned.apply_tuned(cfg) and cfg.speculative.draft_assist == "ngram"
    cfg = compose("serve", base + ["speculative.draft_assist=ngram"])
    assert tuned.apply_tuned(cfg) is None and cfg.speculative.num_steps is None  # the assist given: the tuned entry is not used


def test_tune_grid_takes_the_draft_quantization_and_serve_applies_it(tmp_path):
    """``tune.draft_model_quantization=[null,w8a8_int8]`` is a grid dimension like the draft
    assist; an algorithm without a draft model skips the quantized point with a note naming the
    key; ``specfw serve`` applies a tuned entry's draft quantization, and not when it is given."""
    from specfw import tuned
    from specfw.bench.tune import grid, with_settings

    overrides = [
        "tune.num_steps=[3]",
        "tune.topk=[1]",
        "tune.num_draft_tokens=[4]",
        "tune.adaptive_draft=[false]",
        "tune.draft_model_quantization=[null,w8a8_int8]",
    ]
    points, skipped = grid(compose("tune", ["speculative=eagle3", *overrides]))
    chain = dict(num_steps=3, topk=1, num_draft_tokens=4, adaptive_draft="false")
    assert points == [{}, dict(chain, draft_model_quantization=None), dict(chain, draft_model_quantization="w8a8_int8")]
    assert not skipped
    assert with_settings(compose("tune", ["speculative=eagle3"]), points[2]).speculative.draft_model_quantization == "w8a8_int8"
    points, skipped = grid(compose("tune", ["speculative=ngram", *overrides]))
    unquant = dict(num_draft_tokens=4, adaptive_draft="false", draft_model_quantization=None)
    assert points == [{}, dict(unquant, match_type="BFS"), dict(unquant, match_type="PROB")]
    assert len(skipped) == 2 and all("speculative.draft_model_quantization" in note for _, note in skipped)

    base = ["speculative=eagle3", f"tuned.dir={tmp_path}"]
    cfg = compose("serve", base)
    tuned.write_entry(
        cfg, "eagle3", 1, tuned.TunedEntry(num_steps=5, topk=4, num_draft_tokens=8, adaptive_draft="true", draft_model_quantization="w8a8_int8", tok_s=2.0)
    )
    assert "draft_model_quantization=w8a8_int8" in tuned.apply_tuned(cfg) and cfg.speculative.draft_model_quantization == "w8a8_int8"
    cfg = compose("serve", base + ["speculative.draft_model_quantization=unquant"])
    assert tuned.apply_tuned(cfg) is None and cfg.speculative.draft_model_quantization == "unquant"


def test_tune_grid_takes_the_algorithms_own_keys_and_serve_applies_them(tmp_path):
    """An algorithm's ``tune_grid`` (ngram: ``match_type`` BFS and PROB) is a grid dimension by
    default; ``tune.keys`` replaces its values; a key the algorithm has not is a config error naming
    ``tune.keys.<key>``; ``specfw serve`` applies a tuned entry's own keys, and none of the entry
    when one of them is given."""
    from specfw import tuned
    from specfw.bench.config import validate_tune
    from specfw.bench.tune import grid, with_settings
    from specfw.config import ConfigError

    shape = ["tune.num_draft_tokens=[4]", "tune.adaptive_draft=[false]"]
    points, skipped = grid(compose("tune", ["speculative=ngram", *shape]))
    tree = dict(num_draft_tokens=4, adaptive_draft="false")
    assert points == [{}, dict(tree, match_type="BFS"), dict(tree, match_type="PROB")] and not skipped
    assert str(getattr(with_settings(compose("tune", ["speculative=ngram"]), points[2]).speculative.match_type, "value", None)) == "PROB"
    points, _ = grid(compose("tune", ["speculative=ngram", *shape, "+tune.keys.match_type=[PROB]", "+tune.keys.max_bfs_breadth=[4,10]"]))
    assert points[1:] == [dict(tree, match_type="PROB", max_bfs_breadth="4"), dict(tree, match_type="PROB", max_bfs_breadth="10")]
    points, _ = grid(compose("tune", ["speculative=eagle3", "tune.num_steps=[3]", "tune.topk=[1]", *shape]))
    assert points == [{}, dict(num_steps=3, topk=1, num_draft_tokens=4, adaptive_draft="false")]  # eagle3 has no tune_grid
    for bad, says in (
        ("+tune.keys.match_type=[PROB]", "tune.keys.match_type: is not a key of speculative=eagle3"),
        ("+tune.keys.num_steps=[3]", "tune.keys.num_steps"),
        ("+tune.keys.match_type=[]", "must list at least one value"),
    ):
        algo = "eagle3" if "eagle3" in says else "ngram"
        with pytest.raises(ConfigError, match=re.escape(says)):
            validate_tune(compose("tune", [f"speculative={algo}", bad]))

    base = ["speculative=ngram", f"tuned.dir={tmp_path}"]
    cfg = compose("serve", base)
    entry = tuned.TunedEntry(num_steps=None, topk=None, num_draft_tokens=8, adaptive_draft="auto", keys={"match_type": "PROB"}, tok_s=2.0)
    tuned.write_entry(cfg, "ngram", 1, entry)
    assert "num_draft_tokens=8, adaptive_draft=auto, match_type=PROB" in tuned.apply_tuned(cfg)
    assert (cfg.speculative.num_draft_tokens, str(cfg.speculative.match_type.value)) == (8, "PROB")
    cfg = compose("serve", base + ["speculative.match_type=PROB"])  # (no Hydra run here: a key counts as given when off its default)
    assert tuned.apply_tuned(cfg) is None and cfg.speculative.num_draft_tokens is None  # an own key given: the entry is not used


@pytest.fixture(scope="module")
def tuned_server(tiny_model_dir, tmp_path_factory):
    """`specfw tune` (ngram, one grid point, no auto point so the entry is known) then `specfw
    serve` with the same tuned.dir and no tree keys."""
    tmp = tmp_path_factory.mktemp("tune")
    out = specfw(
        [
            "tune",
            "speculative=ngram",
            f"model.path={tiny_model_dir}",
            "tune.prompts.num_prompts=2",
            "tune.holdout.start=2",
            "tune.holdout.num_prompts=2",
            "tune.max_new_tokens=8",
            "tune.num_draft_tokens=[5]",
            "tune.adaptive_draft=[false]",
            "+tune.keys.match_type=[PROB]",  # ngram's own key: one value, so one grid point
            "tune.include_auto=false",
            "tune.holdout_rounds=2",
            f"tune.out_dir={tmp}",
            "tune.name=t",
            f"tuned.dir={tmp / 'tuned'}",
        ],
        tmp,
    )
    port = free_port()
    args = ["serve", f"model.path={tiny_model_dir}", "speculative=ngram", f"server.port={port}", f"tuned.dir={tmp / 'tuned'}", "engine.max_total_tokens=4096"]
    with CliProcess(args, tmp / "serve.log") as server:
        url = f"http://127.0.0.1:{port}"
        assert server.healthy(url), server.output()
        yield dict(url=url, server=server, tmp=tmp, tune_out=out)


def test_tune_then_serve_uses_tuned_defaults(tuned_server):
    import httpx2

    tmp = tuned_server["tmp"]
    (path,) = (tmp / "tuned").rglob("*.json")
    entry = json.loads(path.read_text())["algorithms"]["ngram"]["buckets"]["1"]
    assert (entry["num_draft_tokens"], entry["adaptive_draft"], entry["keys"]) == (5, "false", {"match_type": "PROB"}) and entry["tok_s"] > 0
    recs = records(tmp / "t")
    assert {r["phase"] for r in recs} == {"tune", "holdout"}
    held = [r for r in recs if r["phase"] == "holdout" and r["algorithm"] == "ngram"]
    assert ["tuned" in r["label"] for r in held] == [False, True, False, True]  # tune.holdout_rounds=2: auto and tuned alternated
    assert "held-out ngram batch 1: tuned" in tuned_server["tune_out"] and "median of 2 alternated rounds" in tuned_server["tune_out"]
    applied = "tuned defaults applied for speculative=ngram (batch-size bucket 1): num_draft_tokens=5, adaptive_draft=false, match_type=PROB"
    assert applied in tuned_server["server"].output()
    spec = httpx2.get(tuned_server["url"] + "/get_server_info", timeout=10).json()["config"]["speculative"]
    assert (spec["num_draft_tokens"], str(spec["adaptive_draft"]), spec["match_type"]) == (5, "false", "PROB")


def test_url_mode_against_live_server(tuned_server, tmp_path):
    url = tuned_server["url"]
    overrides = ["bench.prompts.num_prompts=3", "bench.max_new_tokens=8", "bench.batch_sizes=[1,3]", f"bench.out_dir={tmp_path}", "bench.name=u"]
    specfw(["bench", f"bench.url={url}", *overrides], tmp_path)
    recs = records(tmp_path / "u")
    assert [r["batch_size"] for r in recs] == [1, 3] and all(r["target"] == url for r in recs)
    for r in recs:
        assert r["tok_s"] > 0 and 0 < r["output_tokens"] <= 24 and r["ttft_ms"]["p50"] > 0
        assert r["accept_length"] and r["accept_length"] >= 1  # from specfw's /metrics
        assert r["equal_plain"] is None and r["peak_mem_mb"] is None


def test_jsonl_prompt_sets(tmp_path):
    """Messages, prompts, GSM8K-style questions and strings; start/num_prompts select; too few is an error naming the key."""
    from specfw.bench.config import PromptSet
    from specfw.bench.prompts import load_prompts
    from specfw.config import ConfigError

    lines = [{"messages": [{"role": "user", "content": "a"}]}, {"prompt": "b"}, {"question": "c", "answer": "#### 3"}, "d"]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    got = load_prompts(PromptSet(dataset="jsonl", path=str(path), start=1, num_prompts=3))
    assert [p.messages[-1]["content"] for p in got] == ["b", "c", "d"]
    with pytest.raises(ConfigError, match="bench.prompts.num_prompts: jsonl has 3 prompts from start=1 on, fewer than 4"):
        load_prompts(PromptSet(dataset="jsonl", path=str(path), start=1, num_prompts=4))

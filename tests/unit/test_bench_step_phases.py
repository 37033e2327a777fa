"""benchmarks/bench_step_phases.py: the phases a decode step is split into, on a tiny model."""

import sys
from pathlib import Path

from conftest import make_cfg

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_step_phases import Phases  # noqa: E402


def test_phases_split_decode_steps_and_leave_output_unchanged(tiny_model_dir, monkeypatch):
    from specfw import graphs
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager
    from specfw.sampling import SamplingParams
    from specfw.speculative import feature_drafter

    # install() patches module attributes for the run it measures; undo them after the test
    monkeypatch.setattr(feature_drafter.FeatureDrafter, "_extend", feature_drafter.FeatureDrafter._extend)
    monkeypatch.setattr(feature_drafter, "beam_search", feature_drafter.beam_search)
    monkeypatch.setattr(graphs, "_load_inputs", graphs._load_inputs)
    monkeypatch.setattr(graphs.RowLayout, "build", graphs.RowLayout.build)
    monkeypatch.setattr(graphs.StaticRowLayout, "load", graphs.StaticRowLayout.load)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    spec = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram", adaptive_draft="false")
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=spec)) as eng:
        ref = eng.generate([prompt], params)[0].token_ids
        phases = Phases(sync=False)
        phases.install(eng)
        assert eng.generate([prompt], params)[0].token_ids == ref
    steps = phases.calls["engine step"]
    assert 0 < steps < 12 and phases.calls["worker decode"] == steps  # prefill steps are not counted
    assert phases.calls["draft (hook)"] == steps and phases.calls["target forward"] == steps
    rows = {label.strip(): ms for label, ms, _ in phases.table()}
    kids = ("draft (hook)", "build tree (hook)", "target forward", "verify (hook)", "on_accept (hook)", "observe (hook)", "(rest of worker decode)")
    assert abs(sum(rows[k] for k in kids) - rows["worker decode"]) < 1e-6  # the children and the rest add up to the parent
    assert rows["worker decode"] <= rows["engine step"] and all(rows[k] >= 0 for k in kids[:-1])


def test_bounds_say_what_limits_a_speculative_row():
    from bench_step_phases import bounds

    # plain: 10 ms a token and a step; speculative: 20 ms steps, 5 ms of them drafting, 3 tokens each
    line = bounds(plain_mpt=10.0, plain_step=10.0, step=20.0, draft=5.0, tokens=3.0, bar=1.8)
    assert "decode speedup over plain 1.50x" in line and "with a free draft 2.00x" in line
    assert "draft 50% of a plain step" in line and "1.8x needs 3.60 tokens per step" in line and "(2.70 with a free draft)" in line


def test_row_keys_are_literals_where_they_parse():
    from bench_step_phases import _key_value

    assert _key_value("num_draft_tokens=16") == ("num_draft_tokens", 16)
    assert _key_value("confidence_pruning=False") == ("confidence_pruning", False)
    assert _key_value("draft_assist=ngram") == ("draft_assist", "ngram")
    assert _key_value("token_map=/tmp/m.pt") == ("token_map", "/tmp/m.pt")


def test_quantized_rows_run_the_quantized_linears():
    """``--quantization`` / ``--activations`` reach the engine: a tiny model's linears in int8 with
    int8 activations, plain and ngram, the same tokens."""
    import subprocess

    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/bench_step_phases.py"), "--device", "cpu", "--model", "tiny", "--quantization", "int8",
         "--activations", "int8", "--algos", "plain,ngram", "--prompts", "1", "--new-tokens", "6"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "quantization int8, activations int8" in r.stdout
    assert "plain: target linears Q8Linear x " in r.stdout and "ngram: target linears Q8Linear x " in r.stdout
    assert "== plain: 1/1" in r.stdout


def test_policy_line_counts_the_budgets_choices_of_the_run():
    from bench_step_phases import policy_line
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True, fixed_batches=frozenset({1}))
    policy.plan(4)  # before the measured run: not counted
    before = dict(policy.budget.chosen)
    for _ in range(6):
        policy.plan(4)
        policy.plan(1)  # a fixed batch size: the budget is not asked
    chosen = {s: n - before.get(s, 0) for s, n in policy.budget.chosen.items()}
    assert sum(chosen.values()) == 6
    line = policy_line(policy, chosen)
    assert line.startswith("draft policy choices by tree size: {1: ") and line.endswith("; fixed tree at batch sizes [1]")
    assert "2: " in line and "8: " in line


def test_budget_lines_show_what_the_budgets_choices_rest_on():
    from bench_step_phases import budget_lines
    from specfw.speculative.config import TreeShape
    from specfw.speculative.policy import DraftPolicy

    policy = DraftPolicy(TreeShape(5, 4, 8), adaptive=True)
    policy.budget.observe(1, 1, 0.020, None)  # a plain step: 1 token in 20 ms
    policy.budget.observe(1, 8, 0.025, {1: 1, 2: 2, 8: 3})  # a whole-tree step: 3 tokens in 25 ms
    policy.pruning.kept_nodes, policy.pruning.pruned_nodes = 3, 1
    text = budget_lines(policy)
    assert "budget at 1 in flight: 1: 1.00 tok / 20.00 ms = 50.0 tok/s; 8: 3.00 tok / 25.00 ms = 120.0 tok/s" in text
    assert "2: " not in text.split("budget at 1 in flight:")[1].split("\n")[0]  # size 2 was never timed: no rate
    assert text.endswith("confidence pruning kept 3 of 4 drafted nodes (75%)")
    assert budget_lines(DraftPolicy(TreeShape(5, 4, 8), adaptive=True)) == ""  # nothing learned yet

"""Tensor parallelism (model.tp_size, specfw.tp): two ranks over gloo on this CPU, spawned by the
engine or by torchrun. The speculative contract under TP is in test_spec_invariant.py."""

import subprocess
import sys

import pytest

from conftest import make_cfg
from server_helpers import free_port
from specfw.config import ConfigError
from specfw.sampling import SamplingParams

PROMPTS = ["Count to ten.", "Name a color.", [5, 6, 7, 8, 5, 6, 7, 8], [1000, 20, 1000, 20, 1000, 7]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)


def _run(model_dir, tp_size, **kw):
    from specfw.engine import Engine

    with Engine(make_cfg(model_path=str(model_dir), model_tp_size=tp_size, max_total_tokens=4096, max_running_requests=4, **kw)) as eng:
        reqs = [eng.add_request(eng.make_request(p, GREEDY)) for p in PROMPTS]
        logprobs = {r.rid: [] for r in reqs}
        while eng.has_work:
            for o in eng.step():
                logprobs[o.rid] += [t.logprob for t in o.logprobs]
        outs = [(list(r.output_ids), logprobs[r.rid]) for r in reqs]
        procs = list(eng.tp.processes) if eng.tp else []
        assert eng.scheduler.kv_in_use == 0
    return outs, procs


def test_two_ranks_compute_the_one_rank_model(tiny_model_dir):
    """Same tokens, log-probabilities equal up to the reordered sums (o_proj and down_proj add two
    partial sums; the embedding and the logits are exact)."""
    one, _ = _run(tiny_model_dir, 1)
    two, procs = _run(tiny_model_dir, 2)  # tp_backend=auto: shared-memory all-gathers here
    gloo, _ = _run(tiny_model_dir, 2, model_tp_backend="gloo")
    assert len(procs) == 1
    assert gloo == two  # same sums in the same order, whatever carries the bytes
    for (ta, la), (tb, lb) in zip(one, two):
        assert ta == tb
        assert len(la) == len(ta) and la == pytest.approx(lb, abs=1e-4)
    # close() stopped the other rank
    assert all(p.poll() is not None for p in procs)


def test_bf16_int4_and_w8a8_shards_run(tiny_model_dir):
    """bf16 weights (bf16 kernels on the shards), int4 groups cut at shard boundaries, and int8
    weights with int8 activations per token (each rank scales its own slice of a row-parallel
    linear's input: documented numerics of their own)."""
    w8a8 = {"model_quantization": "int8", "model_activation_quantization": "int8_per_token"}
    for kw in ({"model_dtype": "bfloat16"}, {"model_quantization": "int4"}, w8a8):
        one, _ = _run(tiny_model_dir, 1, **kw)
        two, _ = _run(tiny_model_dir, 2, **kw)
        agree = sum(a[0] == b[0] for a, b in zip(one, two))
        assert agree >= len(PROMPTS) - 1, kw  # bits may differ (partial sums), tokens rarely


def test_a_model_that_cannot_be_split_fails_naming_the_key(tiny_model_dir):
    from specfw.engine import Engine

    with pytest.raises(ConfigError, match="model.tp_size.*key-value heads"):
        Engine(make_cfg(model_path=str(tiny_model_dir), model_tp_size=4, max_total_tokens=4096))  # 2 KV heads
    with pytest.raises(ConfigError, match="model.tp_size"):
        from specfw.config import validate

        validate(make_cfg(model_tp_size=0))
    with pytest.raises(ConfigError, match="model.tp_backend"):
        from specfw.config import validate

        validate(make_cfg(model_tp_backend="mpi"))


def _rank_processes() -> list[int]:
    """Pids of this process's children running ``python -m specfw.tp``."""
    import os
    from pathlib import Path

    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "stat").read_text().split()[3] == str(os.getpid()) and b"specfw.tp" in (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except (OSError, IndexError):
            pass
    return pids


def test_a_leader_that_fails_to_load_leaves_no_rank_behind(tiny_model_dir, monkeypatch):
    """The ranks start before the leader loads its weights (they load at the same time): when the
    leader's load fails, its error is raised and the ranks, which loaded and wait for "init", are
    stopped (without that they would wait for ever)."""
    import specfw.engine as engine

    def unreadable(cfg, device):
        raise OSError("weights unreadable")

    monkeypatch.setattr(engine, "load_target", unreadable)  # this process only: the ranks load as usual
    with pytest.raises(OSError, match="weights unreadable"):
        engine.Engine(make_cfg(model_path=str(tiny_model_dir), model_tp_size=2, max_total_tokens=4096))
    assert _rank_processes() == []


def test_a_leader_that_fails_after_the_ranks_set_up_leaves_no_rank_behind(tiny_model_dir):
    """A failure later in the leader's start (here its worker: the ranks have their KV pools and
    wait for the first forward) stops the ranks too."""
    from specfw.engine import Engine

    def broken_worker(engine):
        raise RuntimeError("worker failed")

    with pytest.raises(RuntimeError, match="worker failed"):
        Engine(make_cfg(model_path=str(tiny_model_dir), model_tp_size=2, max_total_tokens=4096), worker_factory=broken_worker)
    assert _rank_processes() == []


def test_torchrun_launches_the_ranks(tiny_model_dir):
    """``torchrun --nproc-per-node 2 -m specfw.cli generate model.tp_size=2``: rank 0 generates,
    rank 1 follows; the text equals the one-rank engine's."""
    from specfw.engine import Engine

    prompt = "Name a color."
    args = [f"model.path={tiny_model_dir}", f"prompt={prompt}", "max_new_tokens=10", "engine.max_total_tokens=4096", "engine.num_threads=1"]
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096)) as eng:
        chat = eng.tokenize_chat([{"role": "user", "content": prompt}])
        expected = eng.generate([chat], SamplingParams(max_new_tokens=10, temperature=0))[0].text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "specfw.cli", "generate"]
    done = subprocess.run(cmd + args + ["model.tp_size=2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected and done.stdout == expected + "\n", (expected, done.stdout)


def test_demo_model_gguf_int8_activations_eagle3_over_two_ranks():
    """The demo target (9 heads, 3 KV heads: 2 + 1 per rank) with the GGUF file's Q4_1 blocks cut
    at shard boundaries and int8 activations; the demo EAGLE-3 draft on rank 0 == plain, both TP=2."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    kw = dict(model_tp_size=2, model_quantization="gguf", model_activation_quantization="int8", max_running_requests=2, max_total_tokens=4096)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    spec = plugin_manager().algorithms["eagle3"].config_class(algorithm="eagle3")
    with Engine(make_cfg(**kw)) as eng:
        prompts = [eng.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
        plain = [o.token_ids for o in eng.generate(prompts, params)]
    with Engine(make_cfg(**kw, speculative=spec)) as eng:
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == plain
        assert eng.stats.accepted_draft_tokens > 0


def test_w8a8_ngram_over_two_ranks_equals_plain_over_two_ranks(tiny_model_dir):
    """int8 activations per token under TP=2: greedy ngram speculation gives TP=2 plain decoding's
    tokens (the speculative contract within this setup's own numerics)."""
    from specfw.plugins import plugin_manager

    kw = {"model_quantization": "int8", "model_activation_quantization": "int8_per_token"}
    from specfw.engine import Engine

    plain, _ = _run(tiny_model_dir, 2, **kw)
    ngram = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram", adaptive_draft="false")
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with Engine(make_cfg(model_path=str(tiny_model_dir), model_tp_size=2, max_total_tokens=4096, max_running_requests=4, speculative=ngram, **kw)) as eng:
        spec = [o.token_ids for o in eng.generate(PROMPTS, params)]
        assert eng.stats.accepted_draft_tokens > 0  # the repeating prompts' n-grams were drafted and taken
    assert spec == [t for t, _ in plain]

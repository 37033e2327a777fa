"""The GPU serving path on CUDA (issue 23): skipped without a CUDA device; ``scripts/gpu_check.sh``
runs these with the Triton/FlashInfer unit tests and the GPU benchmark in one command."""

import pytest
import torch

from conftest import make_cfg
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it on a GPU)")
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999]]


def _engine(tiny_model_dir, attention, graphs=0, spec=None, dtype="bfloat16"):
    from specfw.engine import Engine

    return Engine(
        make_cfg(
            model_path=str(tiny_model_dir), model_device="cuda", model_dtype=dtype, model_attention_backend=attention,
            cuda_graph_max_bs=graphs, max_running_requests=3, max_total_tokens=4096, speculative=spec,
        )
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_attention_with_cuda_graphs_keeps_greedy_speculative_equal_to_plain(dtype, tiny_model_dir, tiny_eagle_drafts):
    with _engine(tiny_model_dir, "triton", dtype=dtype) as eng:
        ref = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    with _engine(tiny_model_dir, "triton", graphs=3, dtype=dtype) as eng:
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ref
        assert eng.runner.graphs.replays > 0 and all(e.graph is not None for e in eng.runner.graphs.entries.values())
    algos = plugin_manager().algorithms
    for spec in (
        algos["eagle3"].config_class(
            algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1], num_steps=3, topk=2, num_draft_tokens=6
        ),
        algos["eagle3"].config_class(algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1], num_steps=3, topk=1),
        algos["ngram"].config_class(algorithm="ngram"),
    ):
        with _engine(tiny_model_dir, "triton", graphs=3, spec=spec, dtype=dtype) as eng:
            graphs, chain = eng.runner.graphs, getattr(eng.worker.runtime, "chain", None)
            startup = (set(graphs.entries), set(chain.entries) if chain else set())  # captured before any request
            layers = eng.worker.ctx.capture_layers  # (startup's verify timing may have made entries of other taps too)
            assert all((b, layers) in graphs.entries for b in graphs.buckets) and all(e.graph is not None for e in graphs.entries.values())
            assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == ref, f"{spec.algorithm}: batch 1"
            assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ref, f"{spec.algorithm}: batch 3"
            assert eng.runner.graphs.replays > 0 and eng.stats.verify_forwards > 0
            if spec.algorithm == "eagle3" and spec.topk == 1:  # the whole draft loop captured: a graph per (requests bucket, depth)
                chain = eng.worker.runtime.chain
                assert chain.replays > 0 and chain.entries and all(e.graph is not None for e in chain.entries.values())
                assert startup[1] <= set(chain.entries) and startup[1], "the chain's graphs are captured at startup"


@pytest.mark.parametrize("attention", ["torch", "flashinfer"])
def test_other_attention_backends_decode_on_cuda(attention, tiny_model_dir):
    """torch (SDPA plans) and FlashInfer decode the same greedy text as the Triton kernel here
    (a random model's logits are far from ties); FlashInfer makes no exactness promise."""
    if attention == "flashinfer":
        pytest.importorskip("flashinfer")
    with _engine(tiny_model_dir, "triton") as eng:
        ref = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    with _engine(tiny_model_dir, attention) as eng:
        got = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    assert sum(a == b for a, b in zip(got, ref)) >= 2


def test_a_gpu_backend_without_cuda_is_refused_by_name(tiny_model_dir, monkeypatch):
    """(Runs on the GPU machine too: a CPU model with triton and no interpreter is refused.)"""
    from specfw.config import ConfigError
    from specfw.engine import Engine

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="model.attention_backend"):
        Engine(make_cfg(model_path=str(tiny_model_dir), model_device="cpu", model_attention_backend="triton"))


@pytest.mark.parametrize("algo", ["plain", "eagle3-chain", "ngram"])
def test_prefix_cache_hits_on_cuda_give_the_tokens_of_a_fresh_prefill(algo, tiny_model_dir, tiny_eagle_drafts):
    """The prefix cache (on by default) under the Triton attention and CUDA graphs: follow-ups,
    siblings and repeats that hit give the tokens of a fresh prefill, and nothing leaks."""
    from test_prefix_cache import _check_idle, _conversation, _fresh

    algos = plugin_manager().algorithms
    spec = {
        "plain": None,
        "eagle3-chain": algos["eagle3"].config_class(
            algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1], num_steps=3, topk=1
        ),
        "ngram": algos["ngram"].config_class(algorithm="ngram"),
    }[algo]
    with _engine(tiny_model_dir, "triton", graphs=3, spec=spec) as eng:
        ref = _fresh(eng)
        got, metas = _conversation(eng)
        assert got == ref
        assert all(m["cached_tokens"] > 0 for m in metas[3:]) and 0 < eng.scheduler.cache_hit_rate < 1
        assert eng.runner.graphs.replays > 0
        _check_idle(eng)

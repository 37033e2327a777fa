"""The contract of the field: greedy speculative output == plain greedy output, token for token,
for every installed algorithm, several tree shapes, batch 1 and batch 4."""

import pytest
import torch

from conftest import make_cfg
from specfw.config import ConfigError
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=32, temperature=0, ignore_eos=True)
# topk 1/2/4 and num_steps 1..5 are all covered
# (3, 4, 16) and (2, 2, 8) are SGLang's documented shapes (the latter adjusted to 7 nodes)
TREE_SHAPES = [
    dict(num_steps=1, topk=1),
    dict(num_steps=5, topk=1),
    dict(num_steps=2, topk=2, num_draft_tokens=8),
    dict(num_steps=4, topk=2, num_draft_tokens=8),
    dict(num_steps=3, topk=4, num_draft_tokens=16),
]
DTYPES = ["float32", "bfloat16"]
NGRAM_SHAPES = [
    dict(num_draft_tokens=2),
    dict(num_draft_tokens=4, max_bfs_breadth=1),
    dict(num_draft_tokens=8, max_bfs_breadth=4, min_bfs_breadth=2),
    dict(),
    dict(num_draft_tokens=6, match_type="PROB"),
]


@pytest.fixture(scope="module")
def prompts(tiny_spec_prompts):
    return tiny_spec_prompts


@pytest.fixture(scope="module")
def plain_references(tiny_model_dir, prompts):
    from specfw.engine import Engine

    out = {}
    for dtype in DTYPES:
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype=dtype, max_total_tokens=4096))
        out[dtype] = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    return out


def _configs(name, tiny_draft_dir, eagle_drafts):
    algo = plugin_manager().algorithms[name]
    extra = {"draft_model_path": str(tiny_draft_dir)} if name == "standalone" else {}
    if name in eagle_drafts:
        extra = {"draft_model_path": str(eagle_drafts[name])}
        if name == "eagle3":
            extra["aux_layers"] = [0, 1, 1]
    shapes = NGRAM_SHAPES if name == "ngram" else TREE_SHAPES
    out = []
    for shape in shapes:
        cfg = algo.config_class(algorithm=name, **extra, **shape)
        try:
            cfg.validate()
            cfg.resolve_shape("LlamaForCausalLM")
        except ConfigError:
            continue  # this algorithm does not take that shape
        out.append(cfg)
    return out or [algo.config_class(algorithm=name, **extra)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(plugin_manager().algorithms))
def test_greedy_speculative_equals_plain(name, dtype, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, plain_references):
    """bfloat16 holds the contract exactly too: engine.batch_invariant (the default) makes a tree
    node's numerics those of the decode step that would produce the same token."""
    from specfw.engine import Engine

    plain_reference = plain_references[dtype]
    accepted = 0
    for spec in _configs(name, tiny_draft_dir, tiny_eagle_drafts):
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype=dtype, max_total_tokens=4096, max_running_requests=4, speculative=spec))
        single = [eng.generate([p], GREEDY)[0].token_ids for p in prompts]
        batched = [o.token_ids for o in eng.generate(prompts, GREEDY)]  # 6 requests, 4 running at a time
        assert single == plain_reference, f"{name} {spec}: batch 1 diverged"
        assert batched == plain_reference, f"{name} {spec}: batch 4 diverged"
        assert eng.scheduler.kv_in_use == 0
        assert eng.stats.verify_forwards > 0
        accepted += eng.stats.accepted_draft_tokens
    assert accepted > 0, "no draft token was ever accepted: the invariant was not exercised"


def test_every_algorithm_is_exercised():
    assert {"eagle", "eagle3", "mtp", "ngram", "standalone"} <= set(plugin_manager().algorithms)


@pytest.mark.model
def test_demo_model_real_case(demo_engine, tmp_path):
    """ngram on HumanEval prompts and standalone (4-layer truncated draft) on MT-bench, demo model fp32."""
    from specfw.datasets import humaneval_prompts, mtbench_first_turns
    from specfw.engine import Engine
    from specfw_plugins.ngram.config import NgramConfig
    from specfw_plugins.standalone.config import StandaloneConfig
    from specfw_plugins.standalone.make_draft import truncate_model

    params = SamplingParams(max_new_tokens=40, temperature=0)
    code = humaneval_prompts(3)
    chat = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref_code = [o.token_ids for o in demo_engine.generate(code, params)]
    ref_chat = [o.token_ids for o in demo_engine.generate(chat, params)]
    draft = truncate_model(demo_engine.model_path, tmp_path / "draft", layers=4)
    for spec, prompts, ref in [
        (NgramConfig(algorithm="ngram"), code, ref_code),
        (StandaloneConfig(algorithm="standalone", draft_model_path=str(draft), num_steps=3, topk=2, num_draft_tokens=6), chat, ref_chat),
    ]:
        eng = Engine(make_cfg(max_total_tokens=4096, max_running_requests=4, speculative=spec))
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref


@pytest.mark.model
def test_demo_model_bf16_eagle3_batch_invariant():
    """bf16 on the demo model with its EAGLE-3 draft: spec batch 1 and batch 4 and plain batch 4
    all equal plain batch 1. (Measured without engine.batch_invariant: eagle3 diverged on all 4
    of these prompts and plain batch 4 on 2.)"""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw_plugins.eagle3.config import Eagle3Config

    params = SamplingParams(max_new_tokens=48, temperature=0)
    plain = Engine(make_cfg(model_dtype="bfloat16", max_total_tokens=4096, max_running_requests=4))
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(4)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in plain.generate(prompts, params)] == ref
    eng = Engine(make_cfg(model_dtype="bfloat16", max_total_tokens=4096, max_running_requests=4, speculative=Eagle3Config(algorithm="eagle3")))
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("name", sorted(plugin_manager().algorithms))
def test_greedy_speculative_equals_plain_quantized(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts):
    """Within a weight scheme (model.quantization=int4, draft modules int4 too): one tree shape
    per algorithm, batch 1 and 4, == plain greedy of the same scheme (docs/quantization.md)."""
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), model_quantization="int4", max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    ref = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    spec = _configs(name, tiny_draft_dir, tiny_eagle_drafts)[-1]
    eng = Engine(make_cfg(**kw, speculative=spec))
    assert [eng.generate([p], GREEDY)[0].token_ids for p in prompts] == ref, f"{name} {spec}: batch 1 diverged"
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == ref, f"{name} {spec}: batch 4 diverged"
    assert eng.stats.verify_forwards > 0


TP = dict(model_tp_size=2, max_total_tokens=4096, max_running_requests=4)


@pytest.fixture(scope="module")
def tp_plain_reference(tiny_model_dir, prompts):
    from specfw.engine import Engine

    with Engine(make_cfg(model_path=str(tiny_model_dir), **TP)) as eng:
        return [o.token_ids for o in eng.generate(prompts, GREEDY)]


def _algorithms(slow: tuple[str, ...]) -> list:
    """Every registered algorithm, those in ``slow`` marked slow (out of the default run; ``-m slow``
    runs them): for kernel- and rank-level variants whose path another algorithm of the default run
    already takes."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in sorted(plugin_manager().algorithms)]


# eagle's head calls the target's vocabulary-parallel embedding and lm_head as mtp's does: mtp covers it
@pytest.mark.parametrize("name", _algorithms(slow=("eagle",)))
def test_greedy_speculative_equals_plain_tensor_parallel(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, tp_plain_reference):
    """Under model.tp_size=2 (two ranks over gloo): the drafter runs on rank 0 beside the sharded
    target (EAGLE/MTP heads call the target's vocabulary-parallel embedding and lm_head on both
    ranks); one tree shape per algorithm, batch 1 and 4 == plain greedy with the same two ranks."""
    from specfw.engine import Engine

    spec = _configs(name, tiny_draft_dir, tiny_eagle_drafts)[-1]
    with Engine(make_cfg(model_path=str(tiny_model_dir), **TP, speculative=spec)) as eng:
        assert [eng.generate([p], GREEDY)[0].token_ids for p in prompts] == tp_plain_reference, f"{name} {spec}: batch 1 diverged"
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == tp_plain_reference, f"{name} {spec}: batch 4 diverged"
        assert eng.stats.verify_forwards > 0 and eng.scheduler.kv_in_use == 0


# ---- the overlap scheduler (engine.overlap_schedule, SGLang's SpecV2: topk=1 chains) -------------
@pytest.mark.parametrize("name", ["none", "eagle", "eagle3", "mtp", "standalone"])
def test_greedy_overlap_schedule_equals_plain(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, plain_references):
    """Step N computing while step N-1's outputs are made changes no token: batch 1 and 4 == plain
    greedy without overlap, for plain decoding and every chain-drafting algorithm."""
    from specfw.engine import Engine
    from specfw.speculative.config import SpecAlgoConfig

    spec = None
    if name != "none":
        spec = next(c for c in _configs(name, tiny_draft_dir, tiny_eagle_drafts) if c.topk == 1 and (c.num_steps or 0) > 1)
        assert isinstance(spec, SpecAlgoConfig)
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=4, overlap_schedule=True, speculative=spec)) as eng:
        assert eng.overlap is not None
        assert [eng.generate([p], GREEDY)[0].token_ids for p in prompts] == plain_references["float32"], f"{name}: batch 1 diverged"
        assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == plain_references["float32"], f"{name}: batch 4 diverged"
        assert eng.scheduler.kv_in_use == 0 and not eng.has_work
        if spec is not None:
            assert eng.stats.accepted_draft_tokens > 0


# ---- model.attention_backend=triton (Triton's interpreter on a CPU; CUDA where there is one) -------
# (the interpreter is slow: batch 1 runs the first prompt, batch 2 both)
TRITON_GREEDY = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def triton_plain_reference(tiny_model_dir, prompts):
    from specfw.engine import Engine
    from specfw import triton as tr

    if not tr.available("cpu"):
        pytest.skip(tr.unavailable_reason("cpu"))
    eng = Engine(make_cfg(model_path=str(tiny_model_dir), model_attention_backend="triton", max_total_tokens=2048, max_running_requests=2))
    assert "attention triton" in eng.backend.describe()
    return [o.token_ids for o in eng.generate(prompts[:2], TRITON_GREEDY)]


# eagle and mtp attend through eagle3's FeatureDrafter path (as in the static-graph test below)
@pytest.mark.parametrize("name", _algorithms(slow=("eagle", "mtp")))
def test_greedy_speculative_equals_plain_triton_attention(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, triton_plain_reference):
    """Every forward's attention (target and draft) on specfw's Triton kernel: greedy speculative
    == plain greedy with the same kernel, batch 1 and 2, a tree shape with topk > 1 where the
    algorithm takes one (the kernel is exact by construction, like the CPU kernel)."""
    from specfw.engine import Engine

    cands = _configs(name, tiny_draft_dir, tiny_eagle_drafts)
    spec = next((c for c in cands if (c.topk or 1) > 1 and (c.num_draft_tokens or 99) <= 8), cands[-1])
    with Engine(
        make_cfg(model_path=str(tiny_model_dir), model_attention_backend="triton", max_total_tokens=2048, max_running_requests=2, speculative=spec)
    ) as eng:
        assert eng.generate(prompts[:1], TRITON_GREEDY)[0].token_ids == triton_plain_reference[0], f"{name} {spec}: batch 1 diverged"
        assert [o.token_ids for o in eng.generate(prompts[:2], TRITON_GREEDY)] == triton_plain_reference, f"{name} {spec}: batch 2 diverged"
        assert eng.stats.verify_forwards > 0


def test_draft_attention_backend_overrides_only_the_drafter(tiny_model_dir, tiny_eagle_drafts, prompts, plain_references):
    """speculative.draft_attention_backend=triton: the EAGLE-3 head attends on the Triton kernel,
    the target keeps the CPU kernel; output == plain greedy (the draft only proposes)."""
    from specfw.engine import Engine
    from specfw import triton as tr

    if not tr.available("cpu"):
        pytest.skip(tr.unavailable_reason("cpu"))
    spec = _configs("eagle3", None, tiny_eagle_drafts)[0]
    spec.draft_attention_backend = "triton"
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, max_running_requests=2, speculative=spec)) as eng:
        layer = eng.worker.runtime.head.midlayer
        assert eng.backend.attention == "native" and "draft attention triton" in eng.backend.describe()
        got = [o.token_ids for o in eng.generate(prompts[:2], GREEDY)]
        assert got == plain_references["float32"][:2]
        assert eng.stats.accepted_draft_tokens > 0
        assert layer.backend.attention == "triton"


# ---- static (CUDA-graph) forwards and torch.compile ------------------------------------------
@pytest.mark.parametrize("name", ["none", "eagle3", "ngram"])  # eagle and mtp share eagle3's FeatureDrafter path
def test_static_graph_forwards_equal_eager_forwards(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, triton_plain_reference):
    """What a CUDA graph replays -- rows padded to a bucket, inputs and the Triton kernel's key
    lists copied into fixed buffers, outputs cloned out -- run eagerly on a CPU (capture needs
    CUDA): plain and speculative greedy output == the eager Triton reference, batch 1 and 2."""
    from specfw.engine import Engine

    spec = None if name == "none" else _configs(name, tiny_draft_dir, tiny_eagle_drafts)[-1]
    with Engine(
        make_cfg(model_path=str(tiny_model_dir), model_attention_backend="triton", max_total_tokens=2048, max_running_requests=2, speculative=spec)
    ) as eng:
        assert eng.runner.graphs is None  # no CUDA: no graphs unless asked for
        rows = 2 * (eng.tree_shape.num_draft_tokens if eng.tree_shape else 1)
        eng.runner.enable_graphs(max_rows=rows, capture=False)
        drafter = getattr(eng.worker, "runtime", None)
        head_graphs = hasattr(drafter, "enable_graphs") and drafter.enable_graphs(rows, capture=False)  # the EAGLE family's beam steps
        checked = []
        if head_graphs:  # every static head forward's logits and hidden == the eager head forward's, bit for bit
            static_run = drafter.graphs.run

            def run_and_check(fb, features):
                out = static_run(fb, features)
                if out is not None:
                    ref = drafter.head_forward(fb.input_ids, features, fb, False)
                    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
                    checked.append(fb.logits_indices is not None)  # an extend pass (logits at each request's last pair) or a beam step
                return out

            drafter.graphs.run = run_and_check
        assert eng.generate(prompts[:1], TRITON_GREEDY)[0].token_ids == triton_plain_reference[0], f"{name}: batch 1 diverged"
        assert [o.token_ids for o in eng.generate(prompts[:2], TRITON_GREEDY)] == triton_plain_reference, f"{name}: batch 2 diverged"
        assert eng.runner.graphs.replays > 0 and len(eng.runner.graphs.entries) >= 2  # several row buckets served
        assert head_graphs == (name == "eagle3")
        if head_graphs:
            assert drafter.graphs.replays > 0 and len(checked) == drafter.graphs.replays
            assert any(checked) and not all(checked)  # extend passes and beam steps both served from static buffers


@pytest.mark.parametrize("name", ["eagle3", "eagle"])
def test_device_chain_drafts_what_beam_search_drafts(name, tiny_model_dir, tiny_draft_dir, tiny_eagle_drafts, prompts, triton_plain_reference):
    """topk=1 under graphs: the extend pass and the whole draft loop from static buffers
    (``DeviceChain``, run eagerly here: capture needs CUDA) propose, for every request of every
    step, the tokens, parents and scores beam search proposes from the same extend output (eagle3's draft vocabulary mapped on
    the device, eagle's full one), including the score-floor cut; greedy output == plain, batch
    1 and 2."""
    from specfw.engine import Engine
    from specfw.speculative.device_chain import _candidates

    spec = plugin_manager().algorithms[name].config_class(algorithm=name, draft_model_path=str(tiny_eagle_drafts[name]), num_steps=4, topk=1)
    if name == "eagle3":
        spec.aux_layers = [0, 1, 1]
    with Engine(
        make_cfg(model_path=str(tiny_model_dir), model_attention_backend="triton", max_total_tokens=2048, max_running_requests=2, speculative=spec)
    ) as eng:
        eng.runner.enable_graphs(max_rows=2 * eng.tree_shape.num_draft_tokens, capture=False)
        drafter = eng.worker.runtime
        assert drafter.enable_graphs(2 * eng.tree_shape.num_draft_tokens, capture=False) and drafter.chain is not None
        # batch 2 warms up on its own tree (a drafted step of 2 requests is what this compares), not
        # from batch 1's tables, where this random draft may have made plain steps the best
        eng.worker.policy.budget.seed_new_batch_sizes = False
        # what the engine captures at startup on CUDA (static buffers only here): every shape a step meets
        made = eng.worker.capture_graphs()
        startup = (set(eng.runner.graphs.entries), set(drafter.chain.entries))
        assert made == len(startup[0]) + len(drafter.graphs.entries) + len(startup[1]) and len(startup[0]) == len(eng.runner.graphs.buckets)
        compared = []
        chain_draft = drafter._chain

        def chain_and_check(reqs, extend, features, plan):
            got = chain_draft(reqs, extend, features, plan)
            logits, hidden, fb = drafter._run_extend(extend, features)  # the same extend again: the same KV written
            ref = drafter._beams(reqs, logits, hidden[fb.logits_indices], plan)
            for g, r in zip(got, ref):
                assert g.tokens.tolist() == r.tokens.tolist() and g.parents.tolist() == r.parents.tolist()
                assert torch.allclose(g.scores, r.scores, atol=1e-5)
            compared.append(len(reqs))
            return got

        drafter._chain = chain_and_check
        assert eng.generate(prompts[:1], TRITON_GREEDY)[0].token_ids == triton_plain_reference[0], f"{name}: batch 1 diverged"
        assert [o.token_ids for o in eng.generate(prompts[:2], TRITON_GREEDY)] == triton_plain_reference, f"{name}: batch 2 diverged"
        assert drafter.chain.replays == len(compared) > 0 and 2 in compared and eng.stats.accepted_draft_tokens > 0
        assert (set(eng.runner.graphs.entries), set(drafter.chain.entries)) == startup, "a step met a shape not made at startup"
    # the cut: a node exists while its parent scored at least the floor and the keep-th best so far
    assert _candidates([5, 6, 7, 8], [-0.1, -0.2, -3.0, -0.1], -1.0, None).tokens.tolist() == [5, 6, 7]
    assert _candidates([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.1], float("-inf"), 2).parents.tolist() == [-1, 0, 1]  # node 3's parent is below the 2nd best
    assert _candidates([5, 6, 7], [-0.1, -0.2, -0.3], float("-inf"), None).scores.tolist() == pytest.approx([-0.1, -0.3, -0.6])


def test_graph_buckets_and_settings():
    from specfw.graphs import buckets, graph_rows
    from specfw.config import EngineConfig
    from specfw.backends import make_backend

    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(20) == [1, 2, 4, 8, 16, 20]
    import torch

    cpu = make_backend("cpu")
    assert graph_rows(EngineConfig(cuda_graph_max_bs=8), torch.device("cpu"), cpu, None) == 0  # CPUs: never


def test_torch_compile_matches_eager_and_falls_back_when_compiling_fails(tiny_model_dir, prompts, plain_references, monkeypatch, caplog):
    """engine.torch_compile=true: greedy output == eager (the CPU kernels' opaque calls leave
    little to fuse; docs/gpu.md has the figures); a compilation that fails is logged and the
    layers run eagerly -- the request is served, not failed."""
    import torch
    from specfw.engine import Engine

    with Engine(make_cfg(model_path=str(tiny_model_dir), torch_compile=True, max_total_tokens=2048)) as eng:
        assert [o.token_ids for o in eng.generate(prompts[:2], GREEDY)] == plain_references["float32"][:2]
        assert not eng.runner.compiled_layers.failed

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("LoweringException: cannot lower this op")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    with Engine(make_cfg(model_path=str(tiny_model_dir), torch_compile=True, max_total_tokens=2048)) as eng:
        assert [o.token_ids for o in eng.generate(prompts[:2], GREEDY)] == plain_references["float32"][:2]
        assert eng.runner.compiled_layers.failed and "running eagerly" in caplog.text


def test_static_row_layout_pads_every_row_past_the_forward():
    import torch
    from specfw.backends.row_layout import RowLayout
    from specfw.forward_batch import SeqSpan
    from specfw.graphs import StaticRowLayout

    lay = StaticRowLayout(8, 100, 64, 99, torch.device("cpu"))
    big = RowLayout.build([SeqSpan(0, 6, torch.arange(10, 30), torch.eye(6, dtype=torch.bool))])
    lay.load(big)
    assert lay.seg_len[:6].tolist() == [14] * 6 and lay.ext_len[:6].tolist() == [1] * 6
    lay.load(RowLayout.build([SeqSpan(0, 1, torch.arange(40, 45))]))
    assert lay.row_q.tolist() == list(range(8)) and lay.seg_len.tolist() == [5, 1, 1, 1, 1, 1, 1, 1]
    assert lay.seg_start[1:].tolist() == [100] * 7 and lay.ext_len.tolist() == [0] * 8 and int(lay.slots[100]) == 99  # padding rows see the scratch slot
    assert lay.fits(big) and not lay.fits(RowLayout.build([SeqSpan(0, 9, torch.arange(9))]))


@pytest.mark.model
def test_the_demo_eagle_draft_drafts_over_its_committed_token_map(demo_engine):
    """With the committed demo draft and no ``speculative.token_map``, the EAGLE head scores the
    8,192 ids of the demo map (FR-Spec); ``token_map=full`` scores the whole vocabulary; greedy
    output equals plain greedy output either way."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    from specfw_plugins.eagle.config import EagleConfig

    params = SamplingParams(max_new_tokens=24, temperature=0)
    prompts = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref = [o.token_ids for o in demo_engine.generate(prompts, params)]
    for token_map, vocab in ((None, 8192), ("full", None)):
        spec = EagleConfig(algorithm="eagle", adaptive_draft=False, token_map=token_map)
        eng = Engine(make_cfg(max_total_tokens=4096, max_running_requests=2, speculative=spec))
        drafter = eng.worker.runtime
        assert (None if drafter.to_target is None else len(drafter.to_target)) == vocab
        assert vocab is None or drafter.lm_head.out_features == vocab
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref
        assert eng.stats.accepted_draft_tokens > 0


def test_standalone_over_a_token_map_is_lossless_greedy_and_sampled(tiny_model_dir, tiny_draft_dir, tiny_spec_prompts, tmp_path):
    """FR-Spec for the standalone draft: its lm_head scores the map's ids only; greedy output is
    plain greedy output, and sampled chains (topk 1) verify by rejection sampling against the
    draft's distribution spread over the whole vocabulary (zero off the map)."""
    from specfw.engine import Engine
    from specfw_plugins.standalone.config import StandaloneConfig

    greedy = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096))
    ref = [o.token_ids for o in plain.generate(tiny_spec_prompts, greedy)]
    ids = sorted(set(range(64)) | {t for seq in ref for t in seq[::2]})  # half of what the target writes, and more
    torch.save(torch.tensor(ids), tmp_path / "map.pt")

    def engine(**kw):
        spec = StandaloneConfig(algorithm="standalone", draft_model_path=str(tiny_draft_dir), token_map=str(tmp_path / "map.pt"), adaptive_draft=False, **kw)
        spec.validate()
        return Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype="float32", max_total_tokens=4096, max_running_requests=4, speculative=spec))

    eng = engine(num_steps=3, topk=2, num_draft_tokens=6)
    assert eng.worker.runtime.draft.model.lm_head.out_features == len(ids)
    assert [o.token_ids for o in eng.generate(tiny_spec_prompts, greedy)] == ref
    assert eng.stats.accepted_draft_tokens > 0
    chain = engine(num_steps=3, topk=1, num_draft_tokens=4)
    seen = []
    verify = chain.worker.hook.specfw_verify

    def spy(**kw):
        seen.append(kw["tree"].draft_probs)
        return verify(**kw)

    chain.worker.hook.specfw_verify = spy
    outs = chain.generate(tiny_spec_prompts[:2], SamplingParams(max_new_tokens=16, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    probs = [p for p in seen if p is not None]
    assert probs and all(p.shape[-1] == plain.runner.vocab_size for p in probs)
    off_map = torch.ones(plain.runner.vocab_size, dtype=torch.bool)
    off_map[torch.tensor(ids)] = False
    assert all(float(p[:, off_map].abs().sum()) == 0.0 for p in probs)


def _standalone_head(drafter):
    return drafter.draft.model.lm_head


def _mtp_head(drafter):
    return drafter.map_head


@pytest.mark.model
@pytest.mark.parametrize("algo, head", [("standalone", _standalone_head), ("mtp", _mtp_head)])
def test_the_demo_standalone_and_mtp_drafts_score_their_committed_token_map(demo_engine, algo, head):
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine

    params = SamplingParams(max_new_tokens=24, temperature=0)
    prompts = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref = [o.token_ids for o in demo_engine.generate(prompts, params)]
    spec = plugin_manager().algorithms[algo].config_class(algorithm=algo, adaptive_draft=False)
    eng = Engine(make_cfg(max_total_tokens=4096, max_running_requests=2, speculative=spec))
    drafter = eng.worker.runtime
    assert len(drafter.to_target) == 8192 and head(drafter).out_features == 8192
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.accepted_draft_tokens > 0


def test_mtp_multi_layer_refuses_a_token_map():
    from specfw_plugins.mtp.config import MtpConfig

    with pytest.raises(ConfigError, match="speculative.token_map"):
        MtpConfig(algorithm="mtp", multi_layer=True, topk=1, token_map="freq.pt").validate()
    MtpConfig(algorithm="mtp", multi_layer=True, topk=1, token_map="full").validate()


@pytest.mark.model
def test_eagle3_ignores_a_token_map_as_sglang_does(demo_engine, tmp_path, caplog):
    """SGLang ignores ``--speculative-token-map`` for EAGLE-3 (its draft vocabulary is ``d2t``):
    so does specfw, and says so in the log; the head keeps its whole draft vocabulary. (Cutting
    ``d2t`` to a map's ids was measured and not kept: docs/benchmarks.md, session 26.)"""
    import logging

    from specfw.engine import Engine
    from specfw_plugins.eagle3.config import Eagle3Config

    torch.save(torch.arange(0, 4096), tmp_path / "map.pt")
    spec = Eagle3Config(algorithm="eagle3", adaptive_draft=False, token_map=str(tmp_path / "map.pt"))
    with caplog.at_level(logging.WARNING):
        eng = Engine(make_cfg(max_total_tokens=4096, max_running_requests=2, speculative=spec))
    drafter = eng.worker.runtime
    assert len(drafter.to_target) == drafter.head.draft_vocab == 8192
    assert any("speculative.token_map is ignored for EAGLE-3" in r.getMessage() for r in caplog.records)

"""The standalone self-draft (``speculative.draft_model_path=target``): the target's own
checkpoint, quantized, drafting on the target's KV pool. Greedy output equals plain decoding,
alone and batched; the draft's scratch slots all go back to the pool; a draft that would be the
target itself, or a GGUF draft of a target without blocks, is a config error naming the key."""

import pytest

from conftest import make_cfg
from quant_spec_helpers import GREEDY, RAW, plain_reference
from specfw.backends.q8_linear import Q8Linear
from specfw.config import ConfigError
from specfw.sampling import SamplingParams


def _self_draft(**kw):
    from specfw_plugins.standalone.config import StandaloneConfig

    return StandaloneConfig(algorithm="standalone", draft_model_path="target", **kw)


@pytest.mark.parametrize("topk,scheme", [(1, "w8a8_int8"), (2, "int4")])
def test_self_draft_on_the_target_kv_equals_plain(tiny_model_dir, topk, scheme):
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=4)
    ref = plain_reference(Engine(make_cfg(**kw)))
    spec = _self_draft(num_steps=3, topk=topk, num_draft_tokens=5, draft_model_quantization=scheme, adaptive_draft="false")
    eng = Engine(make_cfg(**kw, speculative=spec))
    draft = eng.worker.runtime.draft
    assert draft.kv is eng.runner.kv  # no pool of its own: the committed prefix's KV is the target's
    assert len([m for m in draft.model.modules() if isinstance(m, Q8Linear)]) == 4 * len(draft.model.layers) + 1
    assert [eng.generate([p], GREEDY)[0].token_ids for p in RAW] == ref
    assert [o.token_ids for o in eng.generate(RAW, GREEDY)] == ref
    assert eng.stats.verify_forwards > 0 and eng.stats.accepted_draft_tokens > 0
    assert "int8 draft activations" in eng.backend.describe()  # int4 codes too: a draft's quantized weights take int8 activations
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)  # drafts sampled (topk 1), verified by rejection
    assert [len(o.token_ids) for o in eng.generate(RAW, sampled)] == [12] * len(RAW)
    assert eng.flush_cache()
    assert eng.runner.allocator.num_used == 0  # every root and beam slot the draft took came back


def test_self_draft_config_errors(tiny_model_dir):
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), max_total_tokens=4096)
    with pytest.raises(ConfigError, match=r"speculative\.draft_model_quantization: a self-draft .* target's own scheme \('none'\)"):
        Engine(make_cfg(**kw, speculative=_self_draft()))
    with pytest.raises(ConfigError, match=r"speculative\.draft_model_quantization: gguf: the target has no GGUF blocks"):
        Engine(make_cfg(**kw, speculative=_self_draft(draft_model_quantization="gguf")))
    with pytest.raises(ConfigError, match=r"speculative\.draft_kv_tokens: a self-draft .* target's KV pool"):
        Engine(make_cfg(**kw, speculative=_self_draft(draft_model_quantization="w8a8_int8", draft_kv_tokens=512)))
    # a target on int8 weights and activations: the same scheme for the draft is the target again
    with pytest.raises(ConfigError, match=r"speculative\.draft_model_quantization"):
        Engine(make_cfg(**kw, model_quantization="int8", model_activation_quantization="int8", speculative=_self_draft()))


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_self_draft_on_gguf_blocks_accepts_most_tokens(dtype):
    """The demo target drafting with its own Q4_1/Q8_0 blocks and int8 activations: == plain
    greedy, and only rounding separates it from the target, so most drafted tokens are accepted
    (a small trained draft accepts about half on chat). A bf16 target drafts on the blocks too:
    they round to its bf16 weights (before, every bf16 linear refused them and the draft ran the
    target's own bf16 forward: 0.95x plain)."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine

    params = SamplingParams(max_new_tokens=32, temperature=0)
    plain = Engine(make_cfg(max_total_tokens=4096, model_dtype=dtype))
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    del plain
    spec = _self_draft(num_steps=4, topk=1, num_draft_tokens=5, draft_model_quantization="gguf", adaptive_draft="false")
    eng = Engine(make_cfg(max_total_tokens=4096, model_dtype=dtype, speculative=spec))
    draft = eng.worker.runtime.draft.model
    assert len([m for m in draft.modules() if isinstance(m, Q8Linear)]) == 4 * len(draft.layers) + 1
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
    assert eng.stats.accept_rate > 0.8, eng.stats.accept_rate

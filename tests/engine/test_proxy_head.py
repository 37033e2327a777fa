"""A draft's lm_head as a 4-bit copy whose best candidates are rescored on the 8-bit codes
(``ProxyHead``, ``speculative.draft_lm_head``): ``q8_ops.rescore_best`` against a float64
reference on every build the CPU runs, the 4-bit copy within half a step of the 8-bit weights,
the head's argmax kept, the self-draft taking it by default on GGUF blocks and staying == plain,
and the config errors naming the key."""

import pytest
import torch

from conftest import make_cfg
from quant_spec_helpers import GREEDY, RAW, plain_reference, q8_ops_or_skip
from specfw.backends.proxy_head import ProxyHead, requantize_4bit
from specfw.backends.q8_linear import Q8Linear, dequantize, pack
from specfw.config import ConfigError
from specfw.kernels import Q8_ISAS
from specfw.sampling import SamplingParams


_ops = q8_ops_or_skip


def _head(ops, n=300, k=128, seed=0) -> Q8Linear:
    """An 8-bit symmetric head (Q8_0's form: w = d q, fp16 d) of ``n`` outputs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    return Q8Linear(pack(q, d, None, 8), None, ops, "gguf")


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("candidates", [1, 5, 300, 400])
def test_rescore_best_rewrites_the_best_logits_with_the_exact_product(isa, candidates):
    ops = _ops(isa)
    g = torch.Generator().manual_seed(1)
    V, K, R = 300, 128, 3
    codes = torch.randint(-128, 128, (V, K), generator=g, dtype=torch.int8)
    d = torch.rand(V, K // 32, generator=g) * 0.01
    x = torch.randn(R, K, generator=g)
    logits = torch.randn(R, V, generator=g)
    logits[0, 10] = logits[0, 20] = 50.0  # a tie at the top
    before = logits.clone()
    ops.rescore_best(logits, x, codes, d, candidates)
    w = (codes.double().view(V, -1, 32) * d.double()[..., None]).view(V, K)
    exact = x.double() @ w.t()
    for r in range(R):
        best = before[r].double().argsort(descending=True, stable=True)[: min(candidates, V)]
        changed = (logits[r] != before[r]).nonzero().flatten()
        assert set(changed.tolist()) <= set(best.tolist())  # nothing outside the C best is touched
        torch.testing.assert_close(logits[r, best].double(), exact[r, best], rtol=1e-5, atol=1e-4)
        rest = torch.ones(V, dtype=torch.bool)
        rest[best] = False
        assert torch.equal(logits[r, rest], before[r, rest])
    if candidates == 1:  # ties: the first index is the best
        assert logits[0, 20] == 50.0 and logits[0, 10] != 50.0


def test_rescore_best_rejects_bad_shapes():
    ops = _ops("portable")
    with pytest.raises(RuntimeError, match="codes"):
        ops.rescore_best(torch.zeros(1, 10), torch.zeros(1, 32), torch.zeros(10, 16, dtype=torch.int8), torch.zeros(10, 1), 2)


def test_requantize_4bit_is_within_half_a_step():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g) * 0.05
    w[3, :32] = 0.25  # a constant block: range 0
    q, d, m = requantize_4bit(w)
    assert q.min() >= 0 and q.max() <= 15 and torch.equal(q, q.round())
    assert torch.equal(d, d.half().float()) and torch.equal(m, m.half().float())  # fp16-exact: 2-byte scales
    back = (q.view(64, 3, 32) * d[..., None] + m[..., None]).view(64, 96)
    # half a step, plus what fp16 rounding of d (the top code clamps where d fell short of range / 15) and of m adds
    blocks = w.view(64, 3, 32)
    slack = ((blocks.amax(-1) - blocks.amin(-1)) + blocks.amin(-1).abs()) * 1e-3 + 1e-7
    assert ((back - w).abs() <= (d * 0.5 + slack).repeat_interleave(32, dim=1)).all()
    assert torch.equal(back[3, :32], w[3, :32])


@pytest.mark.parametrize("isa", Q8_ISAS)
def test_proxy_head_keeps_the_heads_argmax(isa):
    """The proxy's logits carry the 8-bit head's exact values at its candidates, so its argmax is
    the head's whenever that is among them (here: every row)."""
    ops = _ops(isa)
    head = _head(ops)
    proxy = ProxyHead(head, candidates=8)
    assert torch.equal(proxy.weight, dequantize(head.q8))
    assert isinstance(proxy.proxy, Q8Linear) and proxy.proxy.q8.bits == 4
    assert proxy.proxy.q8.nbytes < 0.6 * head.q8.nbytes
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    exact = x.double() @ dequantize(head.q8).double().t()
    y = proxy(x)
    assert y.shape == (16, 300) and y.dtype == torch.float32
    assert torch.equal(y.argmax(1), exact.argmax(1))
    torch.testing.assert_close(y.gather(1, exact.argmax(1, keepdim=True)).double(), exact.max(1, keepdim=True).values, rtol=1e-5, atol=1e-4)
    assert proxy(x[:0]).shape == (0, 300)
    assert proxy(x.view(2, 8, 128)).shape == (2, 8, 300)


def test_proxy_head_refuses_heads_it_cannot_rescore():
    ops = _ops("portable")
    g = torch.Generator().manual_seed(4)
    four_bit = Q8Linear(pack(torch.randint(0, 16, (16, 64), generator=g), torch.rand(16, 2), torch.rand(16, 2), 4), None, ops, "gguf")
    assert not ProxyHead.eligible(four_bit) and not ProxyHead.eligible(torch.nn.Linear(64, 16))
    with pytest.raises(ValueError, match="8-bit"):
        ProxyHead(four_bit)


def _self_draft(**kw):
    from specfw_plugins.standalone.config import StandaloneConfig

    return StandaloneConfig(algorithm="standalone", draft_model_path="target", **kw)


def test_self_draft_with_the_proxy_head_equals_plain(tiny_model_dir):
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=4)
    ref = plain_reference(Engine(make_cfg(**kw)))
    spec = _self_draft(num_steps=3, topk=1, num_draft_tokens=4, draft_model_quantization="w8a8_int8", adaptive_draft="false", draft_lm_head="proxy")
    eng = Engine(make_cfg(**kw, speculative=spec))
    assert isinstance(eng.worker.runtime.draft.model.lm_head, ProxyHead)
    assert [eng.generate([p], GREEDY)[0].token_ids for p in RAW] == ref
    assert [o.token_ids for o in eng.generate(RAW, GREEDY)] == ref
    assert eng.stats.accepted_draft_tokens > 0
    # sampled requests draft from the proxy's distribution and verify by rejection sampling against it
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    assert [len(o.token_ids) for o in eng.generate(RAW, sampled)] == [12] * len(RAW)
    assert eng.flush_cache() and eng.runner.allocator.num_used == 0
    # auto: only a self-draft on GGUF blocks takes it (this tiny target has none: w8a8_int8 keeps its head)
    auto = Engine(make_cfg(**kw, speculative=_self_draft(num_steps=3, topk=1, num_draft_tokens=4, draft_model_quantization="w8a8_int8")))
    assert isinstance(auto.worker.runtime.draft.model.lm_head, Q8Linear)


def test_draft_lm_head_config_errors_name_the_key(tiny_model_dir, tiny_draft_dir):
    from specfw.engine import Engine
    from specfw_plugins.standalone.config import StandaloneConfig

    with pytest.raises(ConfigError, match=r"speculative\.draft_lm_head: 'half' is not one of \['auto', 'full', 'proxy'\]"):
        StandaloneConfig(algorithm="standalone", draft_lm_head="half").validate()
    spec = StandaloneConfig(algorithm="standalone", draft_model_path=str(tiny_draft_dir), draft_lm_head="proxy")
    with pytest.raises(ConfigError, match=r"speculative\.draft_lm_head: proxy needs the draft's lm_head on 8-bit codes"):
        Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=4096, speculative=spec))


@pytest.mark.model
def test_demo_self_draft_takes_the_proxy_head_by_default():
    """The demo target's self-draft on its GGUF blocks: the Q8_0 head becomes a ProxyHead
    (``draft_lm_head=auto``), == plain greedy, and its chains are still accepted like the full
    head's (forced chains of 4 on two MT-bench answers)."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine

    params = SamplingParams(max_new_tokens=32, temperature=0)
    plain = Engine(make_cfg(max_total_tokens=4096))
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(2)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    del plain
    rates = {}
    for mode in ("auto", "full"):
        spec = _self_draft(num_steps=4, topk=1, num_draft_tokens=5, draft_model_quantization="gguf", adaptive_draft="false", draft_lm_head=mode)
        eng = Engine(make_cfg(max_total_tokens=4096, speculative=spec))
        head = eng.worker.runtime.draft.model.lm_head
        assert isinstance(head, ProxyHead) == (mode == "auto")
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
        rates[mode] = eng.stats.accept_rate
        del eng
    assert rates["auto"] > 0.8 and rates["auto"] >= rates["full"] - 0.05, rates

"""Greedy rows' lm_head through a bf16 copy and a per-logit bound (``GreedyHead``,
``cpu_ops.greedy_logits``): the argmax (first index on ties) and the logit there are the full fp32
product's bit for bit, every finite entry is exact, the rest -inf; the bound holds; rows of
requests that need whole logits (sampling, logprobs) never take it. The portable build
everywhere, each ISA build where the CPU has it; the proxy on ``bf16_dot`` (bf16 inputs too)
where the CPU has AVX512-BF16."""

import numpy as np
import pytest
import torch
from torch import nn

from conftest import make_cfg
from specfw.backends.greedy_head import BF16_HEAD_MAX_ROWS, GreedyHead, flush_subnormals
from specfw.backends.kernel_linear import KernelLinear
from specfw.kernels import ISAS, Q8_ISAS, bf16_dot, cpu_ops, isa_supported, q8_isa_supported, q8_ops
from specfw.sampling import SamplingParams


def _isas():
    """Each ISA build where the CPU has it, the avx512 build with the proxy on ``bf16_dot``, and
    each ``q8_ops`` build this CPU runs with the int8 proxy (``avx512bw``: the avx512 build without
    VNNI, forced on a VNNI CPU too)."""
    dot = pytest.mark.skipif(not isa_supported("avx512") or bf16_dot() is None, reason="this CPU lacks AVX512-BF16")
    plain = [pytest.param(i, marks=pytest.mark.skipif(not isa_supported(i), reason=f"this CPU lacks {i}")) for i in ISAS]
    int8 = [pytest.param(f"{i}+int8", marks=pytest.mark.skipif(not q8_isa_supported(i), reason=f"this CPU lacks {i}")) for i in Q8_ISAS if i != "amx"]
    return plain + [pytest.param("avx512+dot", marks=dot)] + int8


def _head(isa, weight):
    isa, _, proxy = isa.partition("+")
    ops = cpu_ops("avx512" if isa == "avx512bw" else isa)
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight.data = weight
    kl = KernelLinear(lin, ops, isa)
    if proxy == "int8":
        q8 = q8_ops(isa)
        if q8 is None:
            pytest.skip("the int8-activation kernels cannot be built here")
        assert GreedyHead.int8_eligible(kl)
        return kl, GreedyHead(ops, kl, q8=q8)
    return kl, GreedyHead(ops, kl, bf16_dot() if proxy == "dot" else None)


def _check(kl, head, x):
    full = kl(x).numpy()
    logits, argmax = head.select(x)
    got = logits.numpy()
    assert argmax == np.argmax(got, 1).tolist()  # the selection's own argmax: numpy's on its rows
    fin = np.isfinite(got)
    assert (got[fin] == full[fin]).all()  # every finite entry is the full product's, bit for bit
    assert (np.argmax(got, 1) == np.argmax(full, 1)).all()
    assert (got.max(1) == full.max(1)).all()
    return fin.sum(1)


@pytest.mark.parametrize("isa", _isas())
def test_greedy_logits_keep_the_full_products_argmax_and_value(isa):
    g = torch.Generator().manual_seed(0)
    V, K = 1003, 96  # not a whole number of 16-output blocks
    w = torch.randn(V, K, generator=g) * 0.1
    w[700] = w[20]  # an exact tie: the first index must win
    w[701] = w[20] * (1 - 2**-20)  # a near-tie inside the bf16 copy's error
    kl, head = _head(isa, w)
    rows = torch.randn(9, K, generator=g)
    rows[3] = w[20] * 7  # the argmax is the tied pair's first index
    for T in (1, 2, 9):  # one row (its own kernel path), a pair, a multi-row tile
        counts = _check(kl, head, rows[:T].contiguous())
        assert counts.min() >= 1 and counts.mean() < V / 4  # few candidates recomputed
    assert int(np.argmax(head(rows[3:4]).numpy())) == 20
    small = rows[:4] * 1e-3  # the bound spans most logits: many candidates, still exact
    _check(kl, head, small)
    bad = rows[:2].clone()
    bad[1, 5] = float("inf")  # a non-finite row: every entry computed exactly
    got, full = head(bad).numpy(), kl(bad).numpy()
    assert np.array_equal(got[1], full[1], equal_nan=True) and (np.argmax(got, 1) == np.argmax(full, 1)).all()


@pytest.mark.parametrize("isa", _isas())
def test_the_bound_brackets_every_logit(isa):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(500, 576, generator=g) * 0.05
    kl, head = _head(isa, w)
    x = torch.randn(6, 576, generator=g) * 3
    full = kl(x).double()
    slack = x.double().norm(dim=1, keepdim=True) * head.bound.double()[None]
    gamma = 578 * 2.0**-24 / (1 - 578 * 2.0**-24)
    if head.q8 is not None:  # the int8 proxy: plus (|x - x'| + gamma |x'|) |w'_v|, x' the row's int8 codes times their scales
        proxy = head.q8.linear(x, head.codes, head.scales, head.no_m, 8, 500, torch.empty(0)).double()
        q, dx, _ = head.q8.quantize_rows(x)
        xq = (q.double().view(6, 18, 32) * dx.double()[..., None]).view(6, 576)
        assert ((x.double() - xq).abs() <= dx.double().repeat_interleave(32, 1) * (0.5 + 1e-6)).all()  # round to nearest
        rows = (x.double() - xq).norm(dim=1, keepdim=True) + gamma * xq.norm(dim=1, keepdim=True)
        slack = slack + rows * head.wbound.double()[None]
        assert head.scales.dtype == torch.float16 and head.codes.numel() == 504 * 576  # 1 byte a weight (outputs padded to 8)
    elif head.dot is None:
        proxy = cpu_ops(isa.partition("+")[0]).linear(x, head.proxy, 500, torch.empty(0)).double()
    else:  # the proxy from bf16 inputs too: plus (|x - x'| + gamma |x'|) |w'_v|
        xb = flush_subnormals(x.bfloat16())
        proxy = head.dot.linear_f32(xb, head.proxy, 500).double()
        rows = (x.double() - xb.double()).norm(dim=1, keepdim=True) + gamma * xb.double().norm(dim=1, keepdim=True)
        slack = slack + rows * head.wbound.double()[None]
    assert ((full - proxy).abs() <= slack).all()
    assert (slack < 0.1 * full.abs().max()).all()  # and it is tight enough to leave few candidates


@pytest.mark.parametrize("isa", _isas())
def test_subnormal_and_huge_inputs_stay_exact(isa):
    """Subnormal weights and inputs (``vdpbf16ps`` reads them as zero), rows of tiny values whose
    logits are all subnormal or zero, and rows large enough to overflow the proxy."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(300, 64, generator=g) * 0.1
    w[::7, ::3] = 3e-39  # subnormal in fp32 and bf16
    w[5] = 0.0
    kl, head = _head(isa, w)
    x = torch.randn(5, 64, generator=g)
    x[0, ::2] = 2e-39
    x[1] = 1e-30  # every logit is subnormal or zero: the radius' absolute term keeps them candidates
    x[2] = 0.0  # all logits zero: index 0 wins
    x[3] = 3e38  # the proxy overflows: the row is computed whole
    _check(kl, head, x)
    assert int(np.argmax(head(x[2:3]).numpy())) == 0


def test_the_backend_takes_the_dot_proxy_only_on_its_own_build():
    """``CpuBackend`` hands the greedy head ``bf16_dot`` on the avx512 build with the bf16 kernel on,
    never on a forced AVX2 or portable build (those time their own path)."""
    from specfw.backends.cpu import CpuBackend

    for isa in ISAS:
        ops = cpu_ops(isa) if isa_supported(isa) else None
        if ops is None:
            continue
        for bf16 in (True, False):
            dot = CpuBackend(ops, isa, bf16_kernel=bf16)._greedy_dot()
            assert (dot is not None) == (isa == "avx512" and bf16 and bf16_dot() is not None)


def _bf16_weight_isas():
    """Each ISA build with bf16 weights in its own layout, and the avx512 build's ``pack_dot`` layout
    (vdpbf16ps) where the CPU has AVX512-BF16."""
    dot = pytest.mark.skipif(not isa_supported("avx512") or bf16_dot() is None, reason="this CPU lacks AVX512-BF16")
    plain = [pytest.param(i, marks=pytest.mark.skipif(not isa_supported(i), reason=f"this CPU lacks {i}")) for i in ISAS]
    return plain + [pytest.param("avx512+dot", marks=dot)]


@pytest.mark.parametrize("rows", ["bf16", "fp32"])
@pytest.mark.parametrize("isa", _bf16_weight_isas())
def test_a_head_on_bf16_weights_keeps_its_own_argmax_and_value(isa, rows):
    """A bf16 model's head (bf16 rows, outputs rounded to bf16: many exact ties) and an fp32 model's
    head holding bf16 values (packed as bf16, fp32 rows and sums) through the int8 proxy: every
    finite entry is the full head's, bit for bit, the argmax (first index on ties) too; subnormal
    weights and inputs (vdpbf16ps reads them as zero), all-zero rows, rows that overflow."""
    isa, _, dot = isa.partition("+")
    if rows == "fp32" and dot:
        pytest.skip("an fp32 model's head is never packed for vdpbf16ps")
    ops, q8 = cpu_ops(isa), q8_ops(isa)
    if ops is None or q8 is None:
        pytest.skip("the CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(4)
    V, K = 1003, 96
    w = (torch.randn(V, K, generator=g) * 0.1).bfloat16()
    w[700] = w[20]  # an exact tie
    w[701] = w[20].float().mul(1 + 2**-9).bfloat16()  # ties with w[20] once rows round to bf16
    w[::11, ::5] = 3e-39  # subnormal in bf16
    lin = nn.Linear(K, V, bias=False)
    lin.weight.data = w if rows == "bf16" else w.float()
    kl = KernelLinear(lin, ops, isa, bf16_dot=bool(dot))
    assert kl.packed.dtype == torch.bfloat16 and GreedyHead.bf16_eligible(kl) and not GreedyHead.eligible(kl)
    head = GreedyHead(ops, kl, q8=q8)
    dtype = torch.bfloat16 if rows == "bf16" else torch.float32
    x = torch.randn(12, K, generator=g)
    x[3] = w[20].float() * 7  # the argmax is the tied group's first index
    x[4, ::2] = 2e-39  # subnormal inputs
    x[5] = 1e-30  # every logit tiny
    x[6] = 0.0  # all logits zero: index 0 wins
    x[7] = 3e38  # the sums overflow: the row is computed whole
    x[8:] *= 40  # large logits: bf16's ulp is wide, many ties
    x = x.to(dtype)
    for T in (1, 3, 12):
        full = kl(x[:T]).float().numpy()
        logits, argmax = head.select(x[:T])
        got = logits.numpy()
        assert argmax == (np.argmax(got, 1).tolist() if T <= BF16_HEAD_MAX_ROWS else None)  # the whole head: no argmax of its own
        fin = np.isfinite(got)
        assert (got[fin] == full[fin]).all()
        assert (np.argmax(got, 1) == np.argmax(full, 1)).all() and (got.max(1) == full.max(1)).all()
        if T <= BF16_HEAD_MAX_ROWS:
            assert fin.sum(1)[:3].mean() < V / 4  # few candidates on ordinary rows
        else:
            assert np.array_equal(got, full, equal_nan=True)  # larger calls: the full head (the int8 copy stops paying)
    assert int(np.argmax(head(x[3:4]).numpy())) == 20 and int(np.argmax(head(x[6:7]).numpy())) == 0


@pytest.mark.skipif(not q8_isa_supported("amx"), reason="this CPU lacks AMX-INT8")
def test_the_int8_proxy_takes_the_amx_tile_build_from_16_rows_with_the_same_bits():
    """On an AMX-INT8 CPU the backend gives the int8 proxy q8_ops' tile build for calls of 16+ rows
    (verify forwards of wide trees, batches): the same logits as the avx512 build's, row for row."""
    from specfw.backends.cpu import CpuBackend
    from specfw.backends.q8_linear import TILE_ROWS

    ops = cpu_ops("avx512")
    if ops is None or q8_ops("amx") is None:
        pytest.skip("the CPU kernels cannot be built here")
    backend = CpuBackend(ops, "avx512")
    model = nn.Module()
    model.lm_head = KernelLinear(nn.Linear(96, 1003, bias=False), ops, "avx512")
    head = backend.greedy_head(model)
    assert head.q8 is q8_ops("avx512") and head.q8_tiles is q8_ops("amx")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g)
    with_tiles = head(x)  # 40 rows: the tile build
    for T in (TILE_ROWS - 1, TILE_ROWS, 40):
        _check(model.lm_head, head, x[:T].contiguous())
    tiles, head.q8_tiles = head.q8_tiles, None
    assert torch.equal(head(x), with_tiles)  # the avx512 build's logits, bit for bit
    head.q8_tiles = tiles
    assert torch.equal(torch.cat([head(x[i : i + 1]) for i in range(40)]), with_tiles)  # each row alone


def test_int8_scales_hold_every_code_and_fit_fp16():
    """``int8_scales``: each block's ``max|w| / 127`` rounded up to an fp16 value (codes stay in
    -127..127, the scales pack in 2 bytes); a block of zeros scales by 0; a weight fp16 cannot
    scale makes the head ineligible for the int8 proxy (it keeps the bf16 one)."""
    from specfw.backends.greedy_head import int8_scales

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g) * torch.logspace(-9, 2, 40)[:, None]
    w[3, :32] = 0.0
    d = int8_scales(w)
    amax = w.reshape(40, 2, 32).abs().amax(-1)
    assert (d >= amax / 127).all() and torch.equal(d.half().float(), d) and d[3, 0] == 0
    assert ((w.reshape(40, 2, 32) / torch.where(d > 0, d, 1)[..., None]).abs().round() <= 127).all()
    ops = cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    huge = nn.Linear(64, 8, bias=False)
    huge.weight.data[0, 0] = 1e7  # 1e7 / 127 > 65504
    assert not GreedyHead.int8_eligible(KernelLinear(huge, ops, "x"))
    assert not GreedyHead.int8_eligible(KernelLinear(nn.Linear(48, 8, bias=False), ops, "x"))  # 48 inputs: not whole blocks of 32


def test_the_backend_picks_the_proxy_the_setting_names():
    """``engine.cpu_greedy_head_proxy``: ``int8`` on every build (its own ``q8_ops`` build),
    ``bf16`` never, ``auto`` the int8 proxy on the avx512 and avx2 builds (not the portable one);
    a bf16 model's head takes the int8 proxy only when it is set to ``int8``."""
    from specfw.backends.cpu import CpuBackend

    for isa in ISAS:
        ops = cpu_ops(isa) if isa_supported(isa) else None
        if ops is None:
            continue
        for proxy, want in (("int8", True), ("bf16", False), ("auto", isa != "portable")):
            backend = CpuBackend(ops, isa)
            backend.greedy_head_proxy = proxy
            assert (backend._greedy_q8() is not None) == want, (isa, proxy)
            model = nn.Module()
            model.lm_head = KernelLinear(nn.Linear(64, 40, bias=False), ops, isa)
            head = backend.greedy_head(model)
            assert (head.q8 is not None) == want
            x = torch.randn(3, 64)
            assert torch.equal(head(x).argmax(1), model.lm_head(x).argmax(1))
            bf16_model = nn.Module()  # a bf16 model's head: the int8 proxy when set to int8, else no greedy head
            bf16_model.lm_head = KernelLinear(nn.Linear(64, 40, bias=False).bfloat16(), ops, isa)
            head = backend.greedy_head(bf16_model)
            assert (head is not None) == (proxy == "int8")
            if head is not None:
                xb = x.bfloat16()
                assert torch.equal(head(xb).argmax(1), bf16_model.lm_head(xb).float().argmax(1))
            huge = nn.Module()  # scales fp16 cannot hold: no int8 copy, whatever the setting
            huge.lm_head = KernelLinear(nn.Linear(64, 40, bias=False).bfloat16(), ops, isa)
            huge.lm_head.packed.mul_(2.0**100)
            assert backend.greedy_head(huge) is None


def test_a_bad_proxy_setting_names_the_key():
    from specfw.config import ConfigError, validate

    cfg = make_cfg(cpu_greedy_head_proxy="int4")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == "engine.cpu_greedy_head_proxy" and "bf16" in str(e.value)


def test_only_fp32_heads_without_bias_qualify():
    ops = cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here")
    assert GreedyHead.eligible(KernelLinear(nn.Linear(32, 48, bias=False), ops, "x"))
    assert not GreedyHead.eligible(KernelLinear(nn.Linear(32, 48, bias=True), ops, "x"))
    assert not GreedyHead.eligible(KernelLinear(nn.Linear(32, 48, bias=False).bfloat16(), ops, "x"))
    assert not GreedyHead.eligible(nn.Linear(32, 48, bias=False))


def test_greedy_requests_take_it_and_others_get_whole_rows(tiny_model_dir, tiny_spec_prompts, monkeypatch):
    """Plain and speculative engines: greedy requests' forwards go through the greedy head with the
    same tokens as without it; a request asking for logprobs (or sampling) gets whole rows, so its
    logprobs are those of the full head."""
    from specfw.engine import Engine
    from specfw.plugins import plugin_manager

    if cpu_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    calls = []
    real = GreedyHead.select
    monkeypatch.setattr(GreedyHead, "select", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    with_lp = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = tiny_spec_prompts[:2]
    ngram = plugin_manager().algorithms["ngram"].config_class(algorithm="ngram")
    for spec in (None, ngram):
        out = {}
        for on in (False, True):
            with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, cpu_greedy_head=on, speculative=spec)) as eng:
                calls.clear()
                tokens = [o.token_ids for o in eng.generate(prompts, greedy)]
                used = len(calls)
                calls.clear()
                req = eng.add_request(eng.make_request(prompts[0], with_lp))
                lps = []
                while eng.has_work:
                    lps += [t.logprob for o in eng.step() for t in o.logprobs]
                out[on] = (tokens, list(req.output_ids), lps, used, len(calls))
        assert out[True][:3] == out[False][:3] and len(out[True][2]) == 6, f"{spec}: the greedy head changed an output"
        assert out[True][3] > 0 and out[False][3] == 0  # greedy forwards took it only when on
        assert out[True][4] == 0  # the logprobs request's forwards never did


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_int8_proxy_gives_the_full_heads_tokens_on_the_demo_model(demo_dir, dtype):
    """The demo target in fp32 and in bf16: greedy decoding with the int8 proxy, the bf16 proxy
    (fp32 only: a bf16 head is its own bf16 copy) and no greedy head at all (the full head) make
    the same tokens."""
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig
    from specfw.engine import Engine

    if cpu_ops() is None or q8_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")
    prompts = ["The capital of France is", "def fibonacci(n):", "Speculative decoding works by"]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    runs = [("int8", {"cpu_greedy_head_proxy": "int8"}), ("full", {"cpu_greedy_head": False})]
    if dtype == "float32":
        runs.append(("bf16", {"cpu_greedy_head_proxy": "bf16"}))
    out = {}
    for name, engine in runs:
        # the fp32 weights themselves (model.quantization=auto would run the GGUF blocks, whose Q8_0 head has no proxy)
        model = ModelConfig(path=str(demo_dir), dtype=dtype, quantization="none")
        with Engine(SpecfwConfig(model=model, engine=EngineConfig(max_running_requests=1, **engine))) as eng:
            if dtype == "bfloat16" and not GreedyHead.bf16_eligible(eng.runner.model.lm_head):
                # an AMX-BF16 CPU runs bf16 linears on bf16_amx's tiles (DotBF16Linear), whose sums no
                # proxy's recomputation repeats: the engine keeps the full head there
                assert eng.runner.backend.greedy_head(eng.runner.model) is None
                pytest.skip(f"the bf16 lm_head is a {type(eng.runner.model.lm_head).__name__} here (AMX tiles): no int8 proxy")
            head = eng.runner.backend.greedy_head(eng.runner.model)
            assert (head is None) == (name == "full") and (name != "int8" or head.q8 is not None)
            out[name] = [c.token_ids for c in eng.generate(prompts, params)]
    assert all(v == out["full"] for v in out.values())

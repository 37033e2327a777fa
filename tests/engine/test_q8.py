"""Linears with int8 activations (model.activation_quantization=int8, kernels/q8_ops.cpp): the
kernel against a float64 reference of its arithmetic on every ISA this CPU runs, the builds
bit-equal to the portable one, row invariance, the layout round trip, config checks, and greedy
speculative == plain greedy within the scheme."""

import numpy as np
import pytest
import torch

from conftest import make_cfg
from quant_spec_helpers import GREEDY, RAW, assert_speculation_equals_plain, plain_reference, q8_ops_or_skip
from specfw.backends.q8_linear import Q8Linear, dequantize, pack, unblock
from specfw.backends.quant_linear import QuantLinear, dequantize_reference, quantize
from specfw.backends.quant_linear import pack as pack_blocked
from specfw.config import ConfigError, validate
from specfw.kernels import Q8_ISAS, q8_isa, q8_isa_supported
from specfw.sampling import SamplingParams


_ops = q8_ops_or_skip


def _weights(kind, n=70, k=192, seed=0):
    """Per-weight codes, d, m (None) and the bits of one weight of a kind."""
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    if kind in ("q8", "q8_m"):  # q8_m: 8-bit codes with an m (no scheme makes one; the kernel takes it)
        m = -torch.rand(n, k // 32, generator=g) * 0.1 if kind == "q8_m" else None
        return torch.randint(-128, 128, (n, k), generator=g), d, m, 8
    m = -torch.rand(n, k // 32, generator=g) * 0.1 if kind == "q4_1" else None
    return torch.randint(0, 16, (n, k), generator=g), d, m, 4


def quantize_rows_reference(x: torch.Tensor):
    """float32 numpy: dx = max|x|/127 per block of 32, q = round-half-even(x * (1/dx)), sx = dx * sum(q)."""
    v = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(v).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.rint(v * inv[..., None]).astype(np.int32)
    return torch.from_numpy(q.reshape(x.shape).astype(np.int8)), torch.from_numpy(d), torch.from_numpy((d * q.sum(-1)).astype(np.float32))


def linear_reference(x, q, d, m, bias):
    """float64: per block, (d * dx) * sum(q_w * q_x) (+ m * sx), summed over blocks, + bias."""
    qx, dx, sx = quantize_rows_reference(x)
    n, k = q.shape
    P = torch.einsum("rbj,nbj->rnb", qx.double().view(len(x), -1, 32), q.double().view(n, -1, 32))  # exact integers
    y = (P * (d.double()[None] * dx.double()[:, None])).sum(-1)
    if m is not None:
        y = y + (m.double()[None] * sx.double()[:, None]).sum(-1)
    return y + bias.double()


@pytest.mark.parametrize("isa", Q8_ISAS)
def test_quantize_rows_matches_the_reference(isa):
    ops = _ops(isa)
    x = torch.randn(5, 96) * 3
    x[1, :32] = 0  # an all-zero block: dx 0, codes 0
    x[2, 5] = 40.0  # an outlier block
    x[3, 32:64] = torch.arange(32) - 15.5  # ties at x * (1/dx) = .5 round to even
    got, want = ops.quantize_rows(x), quantize_rows_reference(x)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert got[0].abs().max() <= 127 and torch.equal(got[1][1, 0], torch.tensor(0.0))


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8", "q8_m"])
def test_kernel_matches_float64_reference_and_rows_are_independent(isa, kind):
    ops = _ops(isa)
    q, d, m, bits = _weights(kind)
    if kind == "q4_0":
        m = -8 * d  # Q4_0's d * (q - 8) as d * q + m
    bias = torch.randn(q.shape[0])
    lin = Q8Linear(pack(q, d, m, bits), bias, ops, kind)
    x = torch.randn(16, q.shape[1])
    y = lin(x)
    want = linear_reference(x, q, d, m, bias)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5), (y.double() - want).abs().max()
    for rows in (1, 2, 3, 4, 5, 7, 8, 11, 16):  # every tiling of the rows: each row's bits alone
        assert torch.equal(lin(x[:rows]), y[:rows]), rows
    assert torch.equal(lin(x[9:10]), y[9:10])


@pytest.mark.parametrize("isa", [i for i in Q8_ISAS if i != "portable"])
@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8", "q8_m"])
def test_simd_builds_give_the_portable_builds_bits(isa, kind):
    ops, portable = _ops(isa), _ops("portable")
    q, d, m, bits = _weights(kind, n=40, k=256, seed=1)
    w = pack(q, d, m, bits)
    x = torch.randn(6, 256)
    assert torch.equal(Q8Linear(w, None, ops, kind)(x), Q8Linear(w, None, portable, kind)(x))


@pytest.mark.parametrize("kind", ["q4_1", "q4_0", "q8"])
def test_layout_round_trip_from_the_weight_only_blocks(kind):
    """A weight-only QuantWeight (quant_ops layout) re-laid out for q8_ops stands for the same
    weights (offsets folded into m exactly)."""
    q, d, m, bits = _weights(kind, n=37, k=128)
    offset = 8 if kind == "q4_0" else 0
    qw = pack_blocked(q, d, m, bits, offset, 32)
    uq, ud, um = unblock(qw)
    assert torch.equal(uq.long(), q.long()) and torch.equal(ud, d)
    want = dequantize_reference(q, d, m, bits, offset)
    got = dequantize(pack(uq, ud, um, bits))
    assert torch.allclose(got, want, atol=1e-7, rtol=0)


def test_int8_per_channel_and_int4_from_fp32_weights():
    """int8 (one scale per output) and int4 (groups of 32) quantized at load: the q8 layout stands
    for exactly the weight-only scheme's weights, and outputs are within int8 activation error."""
    from specfw.kernels import quant_ops

    ops, qops = _ops("portable"), quant_ops("portable")
    if qops is None:
        pytest.skip("kernels cannot be built here")
    lin = torch.nn.Linear(96, 50)
    for scheme in ("int8", "int4"):
        qw = quantize(lin.weight, scheme)
        q8 = Q8Linear.from_quant_weight(qw, lin.bias, ops, scheme)
        assert torch.equal(q8.weight, QuantLinear(qw, lin.bias, qops, scheme).weight), scheme
        x = torch.randn(4, 96)
        exact = x.double() @ q8.weight.double().T + lin.bias.double()
        err = (q8(x).double() - exact).abs().max() / exact.abs().max()
        assert 0 < err < 0.02, (scheme, err)  # int8 activations: about 1% of the output scale


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match=r"model.activation_quantization.*\['none', 'int8', 'int8_per_token'\]"):
        validate(make_cfg(model_quantization="int4", model_activation_quantization="int4"))
    with pytest.raises(ConfigError, match="model.activation_quantization.*model.quantization"):
        validate(make_cfg(model_activation_quantization="int8"))
    validate(make_cfg(model_quantization="gguf", model_activation_quantization="int8"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_speculative_equals_plain_with_int8_activations(scheme, tiny_model_dir, tiny_draft_dir):
    """ngram and standalone (its draft on int8 activations too, and unquant), batch 1 and 4."""
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), model_quantization=scheme, model_activation_quantization="int8", max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    layers = [m for m in plain.runner.model.modules() if isinstance(m, Q8Linear)]
    assert len(layers) == 4 * len(plain.runner.model.layers) + 1
    ref = plain_reference(plain)
    assert_speculation_equals_plain(kw, str(tiny_draft_dir), ref)


def test_w8a8_int8_draft_on_an_unquantized_target_equals_plain(tiny_model_dir, tiny_draft_dir):
    """``speculative.draft_model_quantization=w8a8_int8`` (SGLang's name): only the draft model's
    linears take int8 weights and int8 activations; the target keeps its fp32 kernels; greedy
    output equals plain, batch 1 and 4; and the SGLang flag maps onto the key."""
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.engine import Engine
    from specfw.sglang_flags import translate
    from specfw_plugins.standalone.config import StandaloneConfig

    kw = dict(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    ref = [plain.generate([p], GREEDY)[0].token_ids for p in RAW]
    spec = StandaloneConfig(
        algorithm="standalone", draft_model_path=str(tiny_draft_dir), num_steps=3, topk=2, num_draft_tokens=6, draft_model_quantization="w8a8_int8"
    )
    eng = Engine(make_cfg(**kw, speculative=spec))
    target = [m for m in eng.runner.model.modules() if isinstance(m, (Q8Linear, KernelLinear))]
    assert target and all(isinstance(m, KernelLinear) for m in target)
    draft = eng.worker.runtime.draft.model
    assert len([m for m in draft.modules() if isinstance(m, Q8Linear)]) == 4 * len(draft.layers) + 1
    assert "int8 draft activations" in eng.backend.describe()
    assert [eng.generate([p], GREEDY)[0].token_ids for p in RAW] == ref
    assert [o.token_ids for o in eng.generate(RAW, GREEDY)] == ref
    assert eng.stats.accepted_draft_tokens > 0
    assert "speculative.draft_model_quantization=w8a8_int8" in translate(["--speculative-draft-model-quantization", "w8a8_int8"]).overrides


@pytest.mark.model
def test_demo_gguf_int8_activations_eagle3_equals_plain():
    """The demo's Q4_1/Q8_0 blocks with int8 activations: every linear on q8_ops, EAGLE-3 (its
    head, which has no GGUF blocks, on int8 weights) batch 1 and 4 == plain greedy of the same
    configuration."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw_plugins.eagle3.config import Eagle3Config

    params = SamplingParams(max_new_tokens=32, temperature=0)
    kw = dict(model_quantization="gguf", model_activation_quantization="int8", max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    model = plain.runner.model
    assert len([m for m in model.modules() if isinstance(m, Q8Linear)]) == 4 * len(model.layers) + 1
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(3)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    del plain
    eng = Engine(make_cfg(**kw, speculative=Eagle3Config(algorithm="eagle3")))
    assert "draft weights without GGUF blocks int8" in eng.backend.describe()
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8"])
def test_fp16_scales_give_the_bits_of_fp32_scales(isa, kind):
    """Scales that fp16 holds exactly (GGUF's own) are stored as fp16 and converted exactly."""
    from dataclasses import replace

    ops = _ops(isa)
    q, d, m, bits = _weights(kind, seed=2)
    d = d.half().float()
    m = m.half().float() if m is not None else None
    w16 = pack(q, d, m, bits)
    assert w16.d.dtype == torch.float16 and w16.m.dtype == torch.float16
    w32 = replace(w16, d=w16.d.float(), m=w16.m.float())
    x = torch.randn(6, q.shape[1])
    assert torch.equal(Q8Linear(w16, None, ops, kind)(x), Q8Linear(w32, None, ops, kind)(x))
    assert pack(q, d + 1e-4, m, bits).d.dtype == torch.float32  # not exact in fp16: kept fp32


def test_avx512_build_takes_vnni_where_the_cpu_has_it():
    """On an AVX512-VNNI CPU the avx512 build is the vpdpbusd one and the avx512bw build its
    vpmaddubsw twin (the bit tests above cover both); elsewhere the two are one build, the
    vpmaddubsw one."""
    from specfw.kernels import _cpu_flags

    ops, bw = _ops("avx512"), _ops("avx512bw")
    vnni = "avx512_vnni" in _cpu_flags()
    assert ops.isa() == ("avx512_vnni" if vnni else "avx512")
    assert bw.isa() == "avx512" and (bw is not ops) == vnni


def test_amx_build_where_the_cpu_has_amx_int8():
    """On an AVX-512 CPU with AMX-INT8 the kernels take the amx build (tiles from 16 rows: the bit
    tests here cover both its paths, 1-15 rows on vpdpbusd and 16+ on tiles); elsewhere the
    avx512 build, and a forced AVX2 or portable ISA keeps its own."""
    from specfw.kernels import _cpu_flags

    amx = {"amx_tile", "amx_int8", "avx512_vnni"} <= _cpu_flags() and q8_isa_supported("avx512")
    assert q8_isa("avx512") == ("amx" if amx else "avx512")
    assert q8_isa("avx2") == "avx2" and q8_isa("portable") == "portable"
    if amx:
        assert _ops("amx").isa() == "amx"


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8"])
@pytest.mark.parametrize("rows", [7, 8, 9, 15, 16, 21])
def test_tree_sized_calls_equal_the_portable_build(isa, kind, rows):
    """Calls of 7-21 rows (a verify forward's tree; the avx2 build's two-group tiles from 8, the
    amx build's tiles from 16), with an odd
    number of blocks and a last span of one group of 8 outputs: each row's bits are the portable
    build's, and a row alone gives the same bits."""
    ops, portable = _ops(isa), _ops("portable")
    q, d, m, bits = _weights(kind, n=40, k=224, seed=4)  # 7 blocks; 5 groups: the last span holds one
    w = pack(q, d, m, bits)
    bias = torch.randn(40)
    x = torch.randn(rows, 224) * 2
    y = Q8Linear(w, bias, ops, kind)(x)
    assert torch.equal(y, Q8Linear(w, bias, portable, kind)(x))
    assert torch.equal(Q8Linear(w, bias, ops, kind)(x[rows - 1 :]), y[rows - 1 :])


def test_calls_of_tile_rows_go_to_the_tile_build():
    """``Q8Linear.tile_ops`` (the backend sets q8_ops' amx build there on an AMX-INT8 CPU) serves
    calls of ``TILE_ROWS`` rows or more, in any shape; fewer stay on ``ops``; the bits do not
    depend on which build ran."""
    from specfw.backends.q8_linear import TILE_ROWS

    tiles_isa = "amx" if q8_isa_supported("amx") else "portable"
    ops, tiles = _ops("portable"), _ops(tiles_isa)
    calls = []

    class Recording:
        def linear(self, x, *args):
            calls.append(x.shape[0])
            return tiles.linear(x, *args)

    q, d, m, bits = _weights("q4_1", n=24, k=96)
    lin = Q8Linear(pack(q, d, m, bits), None, ops, "q4_1")
    x = torch.randn(TILE_ROWS + 5, 96)
    want = lin(x)
    lin.tile_ops = Recording()
    assert torch.equal(lin(x[: TILE_ROWS - 1]), want[: TILE_ROWS - 1]) and calls == []
    assert torch.equal(lin(x[:TILE_ROWS]), want[:TILE_ROWS]) and calls == [TILE_ROWS]
    y = lin(x.view(1, TILE_ROWS + 5, 96).to(torch.bfloat16))  # a prompt's [batch, rows, width] in a bf16 layer
    assert y.shape == (1, TILE_ROWS + 5, 24) and calls == [TILE_ROWS, TILE_ROWS + 5]


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("kind", ["q4_1", "q8"])
def test_many_rows_equal_the_portable_build_row_by_row(isa, kind):
    """Prefill-sized calls (several row tiles and a ragged last one) give each row the bits of that
    row alone on the portable build."""
    ops, portable = _ops(isa), _ops("portable")
    q, d, m, bits = _weights(kind, n=72, k=160, seed=3)
    w = pack(q, d, m, bits)
    x = torch.randn(37, 160)
    y = Q8Linear(w, None, ops, kind)(x)
    ref = Q8Linear(w, None, portable, kind)
    assert torch.equal(y, torch.cat([ref(x[i : i + 1]) for i in range(len(x))]))


@pytest.mark.parametrize("isa", Q8_ISAS)
def test_draft_logits_take_the_fp32_sums_of_a_bf16_row(isa):
    """``sdk.draft_logits``: an int8-activation lm_head gets a bf16 row in fp32 (exact) and returns
    its fp32 sums unrounded, the sums of the bf16 row; a linear without ``computes_fp32`` keeps
    its own dtype's output (rounded to bf16, then widened)."""
    from specfw.sdk import draft_logits

    ops = _ops(isa)
    q, d, m, bits = _weights("q8", n=72, k=128)
    lin = Q8Linear(pack(q, d, m, bits), None, ops, "q8")
    x = (torch.randn(3, 128) * 2).to(torch.bfloat16)
    got = draft_logits(lin, x)
    assert got.dtype == torch.float32
    assert torch.equal(got, lin(x.float()))  # the kernel's own fp32 output, nothing lost
    assert not torch.equal(got, lin(x).float())  # what the model's dtype would have rounded
    assert torch.equal(lin(x).float(), got.to(torch.bfloat16).float())
    plain = torch.nn.Linear(128, 72, bias=False).to(torch.bfloat16)
    assert torch.equal(draft_logits(plain, x), plain(x).float())

"""Quantized weights (model.quantization, kernels/quant_ops.cpp): the kernel against float64
references on every ISA this CPU runs, bit identity of GGUF blocks with the fp32 kernel on the
dequantized weight, batch/row invariance, GGUF block parsing against gguf-py, config checks, and
greedy speculative == plain greedy within each scheme."""

import numpy as np
import pytest
import torch

from conftest import make_cfg
from quant_spec_helpers import assert_speculation_equals_plain, plain_reference
from specfw.backends.quant_linear import INT4_GROUP, QuantLinear, dequantize_reference, gguf_blocks, pack
from specfw.config import ConfigError, validate
from specfw.kernels import ISAS, cpu_ops, isa_supported, quant_ops
from specfw.sampling import SamplingParams


def _ops(isa):
    if not isa_supported(isa):
        pytest.skip(f"this CPU cannot run {isa}")
    q, c = quant_ops(isa), cpu_ops(isa)
    if q is None or c is None:
        pytest.skip("kernels cannot be built here")
    return q, c


def _q4_1(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = torch.rand(n, k // 32, generator=g) * 0.02
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    return q, d, m


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("scales", ["fp32", "fp16"])
def test_gguf_blocks_give_the_fp32_kernels_bits(isa, kind, scales):
    """Dequantized in registers as gguf-py does (d*q, then +m), accumulated like cpu_ops' linear:
    the very bits of KernelLinear on the dequantized fp32 weight, for 1..40 rows, with bias.
    fp16 scales (GGUF's) make every d*q exact: the kernel then dequantizes with one FMA
    (``fma_dq``), which must round to the same weights."""
    from specfw.backends.kernel_linear import KernelLinear

    qops, cops = _ops(isa)
    n, k = 70, 192
    q, d, m = _q4_1(n, k)
    if scales == "fp16":
        # (a first group whose min nearly cancels the largest products: most bits are lost there)
        d[:, 0], m[:, 0] = 0.0123, -0.1789
        d, m = d.half().float(), m.half().float()
    bits, offset = 4, 0
    if kind == "Q4_0":
        m, offset = None, 8
    elif kind == "Q8_0":
        q, m, bits = torch.randint(-128, 128, (n, k)), None, 8
    w = dequantize_reference(q, d, m, bits, offset)
    lin = torch.nn.Linear(k, n)
    lin.weight.data.copy_(w)
    ql = QuantLinear(pack(q, d, m, bits, offset, 32), lin.bias, qops, "gguf")
    assert ql.qw.fma_dq == (scales == "fp16")
    assert torch.equal(ql.weight, w)
    kl = KernelLinear(lin, cops, isa)
    x = torch.randn(40, k)
    for rows in (1, 2, 3, 4, 5, 8, 11, 16, 17, 40):  # register tiles up to 16 rows, an L1 buffer above (prefills)
        assert torch.equal(ql(x[:rows]), kl(x[:rows])), rows


def test_exact_products_reads_the_scales_significands():
    """fma_dq only where every d * q is exact: fp16 scales with 4- or 8-bit codes, a 17-bit
    significand with 4-bit codes but not 8-bit ones; never a full fp32 significand or a subnormal."""
    from specfw.backends.quant_linear import exact_products

    fp16 = (torch.rand(8, 4) * 0.02).half().float()
    assert exact_products(fp16, 4) and exact_products(fp16, 8)
    seventeen = torch.tensor([[1 + 2.0**-16, 3.0, 0.0]])  # 17 significant bits, 2 bits, zero
    assert exact_products(seventeen, 4) and not exact_products(seventeen, 8)
    assert not exact_products(torch.tensor([[1 + 2.0**-23]]), 4)
    assert not exact_products(torch.tensor([[1e-40]]), 4)  # subnormal


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_linear_matches_float64_and_is_row_invariant(isa, scheme):
    qops, _ = _ops(isa)
    torch.manual_seed(1)
    n, k = 83, 256
    lin = torch.nn.Linear(k, n)
    ql = QuantLinear.from_linear(lin, qops, scheme)
    w = ql.weight.double()
    # the quantization error itself: int8 within half a step of max|w|/127, int4 within half a group step
    step = (
        (lin.weight.abs().amax(1, keepdim=True) / 127)
        if scheme == "int8"
        else ((lambda g: (g.amax(2) - g.amin(2)) / 15)(lin.weight.view(n, -1, INT4_GROUP)).repeat_interleave(INT4_GROUP, 1))
    )
    assert ((w - lin.weight.double()).abs() <= step.double() * 0.5 + 1e-6).all()
    x = torch.randn(20, k)
    y = ql(x)
    ref = x.double() @ w.T + lin.bias.double()
    assert (y.double() - ref).abs().max() < 1e-4
    for i in range(20):  # a row's bits never depend on the other rows
        assert torch.equal(ql(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(ql(x[3:12]), y[3:12])


def test_portable_and_avx2_agree_on_int_schemes():
    """AVX2 (FMA) and portable (multiply, add) round differently; both stay close to float64."""
    if not isa_supported("avx2"):
        pytest.skip("no avx2")
    a, _ = _ops("avx2")
    p, _ = _ops("portable")
    lin = torch.nn.Linear(128, 40)
    x = torch.randn(5, 128)
    qa, qp = QuantLinear.from_linear(lin, a, "int4"), QuantLinear.from_linear(lin, p, "int4")
    assert torch.equal(qa.weight, qp.weight)
    assert (qa(x) - qp(x)).abs().max() < 1e-5


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random raw GGUF blocks of ``kind`` [n, bytes] with sane fp16 scales (codes: any bytes)."""
    block, size = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q5_K": (256, 176)}[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, (n, k // block, 2)).astype(np.float16)
    if kind.endswith("_K"):
        scales = np.abs(scales) * np.float16(0.05)  # d and dmin, times 6-bit scales and mins
    raw[..., 0:2] = scales[..., :1].view(np.uint8)
    if kind in ("Q4_1", "Q4_K", "Q5_K"):
        raw[..., 2:4] = scales[..., 1:].view(np.uint8)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K"])
def test_gguf_block_parsing_matches_gguf_py(kind):
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    n, k = 6, 512
    raw = random_blocks(kind, n, k)
    expect = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    q, d, m, bits, offset = gguf_blocks(raw, kind, n, k)
    assert torch.equal(dequantize_reference(q, d, m, bits, offset), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_blocks_match_the_weight_loaded_in_its_dtype(dtype):
    """A linear keeps its GGUF blocks where they dequantize to the loaded weight rounded to its
    dtype (a bf16 model loads the fp32 values rounded); one changed weight refuses them."""
    from specfw.backends.quant_linear import _match

    n, k = 8, 64
    q, d, m, bits, offset = gguf_blocks(random_blocks("Q4_1", n, k), "Q4_1", n, k)
    loaded = dequantize_reference(q, d, m, bits, offset).to(dtype)
    parts = [("blk.0.ffn_down.weight", (q, d, m, bits, offset))]
    qw = _match(loaded, parts, 1, 1)
    assert qw is not None and torch.equal(qw.codes, pack(q, d, m, bits, offset, 32).codes)
    off = loaded.clone()
    off[3, 5] = off[3, 5] * 2 + 1
    assert _match(off, parts, 1, 1) is None
    if dtype == torch.bfloat16:  # the blocks' fp32 values are not the bf16 weights themselves
        assert not torch.equal(dequantize_reference(q, d, m, bits, offset), loaded.float())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_give_the_fp32_kernels_bits(isa, kind):
    """K-quant super-blocks as 32-weight blocks (d = d * sc, m = -dmin * min): the weight-only
    kernel gives KernelLinear's bits on gguf-py's dequantized weight; int8 activations run them."""
    from gguf.quants import dequantize

    import gguf
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.backends.q8_linear import Q8Linear
    from specfw.kernels import q8_ops

    qops, cops = _ops(isa)
    n, k = 40, 256
    raw = random_blocks(kind, n, k, seed=3)
    w = torch.from_numpy(dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k).astype(np.float32))
    q, d, m, bits, offset = gguf_blocks(raw, kind, n, k)
    lin = torch.nn.Linear(k, n)
    lin.weight.data.copy_(w)
    ql = QuantLinear(pack(q, d, m, bits, offset, 32), lin.bias, qops, "gguf")
    assert torch.equal(ql.weight, w)
    x = torch.randn(5, k)
    kl = KernelLinear(lin, cops, isa)
    for rows in (1, 2, 5):
        assert torch.equal(ql(x[:rows]), kl(x[:rows])), rows
    a8 = Q8Linear.from_quant_weight(ql.qw, lin.bias, q8_ops(isa), "gguf")
    assert torch.equal(a8.weight, w)
    exact = x.double() @ w.double().T + lin.bias.double()
    assert (a8(x).double() - exact).abs().max() < 0.02 * exact.abs().max()


def test_config_names_the_key():
    from specfw_plugins.standalone.config import StandaloneConfig

    with pytest.raises(ConfigError, match="model.quantization.*int4"):
        validate(make_cfg(model_quantization="int3"))
    with pytest.raises(ConfigError, match="speculative.draft_model_quantization.*unquant"):
        validate(make_cfg(speculative=StandaloneConfig(algorithm="standalone", draft_model_quantization="fp4")))
    validate(make_cfg(model_quantization="int8", speculative=StandaloneConfig(algorithm="standalone", draft_model_quantization="unquant")))


def test_gguf_needs_a_gguf_source(tiny_model_dir):
    from specfw.engine import Engine
    from specfw.model_loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="model.quantization"):
        Engine(make_cfg(model_path=str(tiny_model_dir), model_quantization="gguf", max_total_tokens=1024))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_speculative_equals_plain_within_scheme(scheme, tiny_model_dir, tiny_draft_dir):
    """ngram and standalone (its draft quantized too, and unquant), batch 1 and 4."""
    from specfw.engine import Engine

    kw = dict(model_path=str(tiny_model_dir), model_quantization=scheme, max_total_tokens=4096, max_running_requests=4)
    plain = Engine(make_cfg(**kw))
    assert any(isinstance(m, QuantLinear) for m in plain.runner.model.modules())
    ref = plain_reference(plain)
    assert_speculation_equals_plain(kw, str(tiny_draft_dir), ref)


@pytest.mark.model
def test_demo_gguf_is_bit_identical_to_fp32():
    """The demo's own Q4_1 file run on its blocks: the fp32 model's logits and tokens exactly
    (``gguf`` asked for, and ``auto``, the default, which picks it for the demo)."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine

    params = SamplingParams(max_new_tokens=32, temperature=0)
    ref_eng = Engine(make_cfg(model_quantization="none", max_total_tokens=4096, max_running_requests=4))
    assert not any(isinstance(m, QuantLinear) for m in ref_eng.runner.model.modules())
    prompts = [ref_eng.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(3)]
    ref = [o.token_ids for o in ref_eng.generate(prompts, params)]
    x = torch.randn(5, 576)
    ref_q = ref_eng.runner.model.layers[3].gate_up_proj(x)
    del ref_eng
    for scheme in ("gguf", "auto"):
        eng = Engine(make_cfg(model_quantization=scheme, max_total_tokens=4096, max_running_requests=4))
        model = eng.runner.model
        quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(quant) == 4 * len(model.layers) + 1, scheme  # every layer linear and the (Q8_0) lm_head
        assert eng.runner.backend.decoder_stack(model).quant_linear != 0  # decode forwards: one call for every layer
        assert torch.equal(model.layers[3].gate_up_proj(x), ref_q)
        assert [o.token_ids for o in eng.generate(prompts, params)] == ref, scheme
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref, scheme  # one at a time
        del eng, model, quant


@pytest.mark.model
def test_auto_quantization_picks_the_gguf_blocks_only_where_they_are_the_fp32_bits(tiny_model_dir):
    """``model.quantization=auto``: gguf for the fp32 demo (converted from its GGUF file) on the
    CPU kernels; none for a bf16 target, a checkpoint with no GGUF source, the torch ops, int8
    activations (those ask for a scheme of their own) or dummy weights; other values as given."""
    from omegaconf import OmegaConf

    from specfw.backends import target_quantization
    from specfw.config import EngineConfig, ModelConfig, SpecfwConfig

    if cpu_ops() is None or quant_ops() is None:
        pytest.skip("the CPU kernels cannot be built here")

    def resolved(device="cpu", **kw):
        engine = {k[7:]: kw.pop(k) for k in list(kw) if k.startswith("engine_")}
        return target_quantization(OmegaConf.structured(SpecfwConfig(model=ModelConfig(**kw), engine=EngineConfig(**engine))), device)

    assert ModelConfig().quantization == "auto"
    assert resolved() == "gguf"
    assert resolved(dtype="bfloat16") == "none"
    assert resolved(path=str(tiny_model_dir)) == "none"
    assert resolved(engine_cpu_isa="none") == "none"
    assert resolved(device="meta") == "none"
    assert resolved(load_format="dummy") == "none"
    assert resolved(quantization="none") == "none" and resolved(quantization="int4", path=str(tiny_model_dir)) == "int4"


@pytest.mark.model
@pytest.mark.parametrize("scheme", ["int8", "gguf"])
def test_demo_eagle3_equals_plain_within_scheme(scheme):
    """EAGLE-3 on the demo model (its draft head quantized with the target's scheme where it can
    be), batch 1 and 4, == plain greedy of the same scheme."""
    from specfw.datasets import mtbench_first_turns
    from specfw.engine import Engine
    from specfw_plugins.eagle3.config import Eagle3Config

    params = SamplingParams(max_new_tokens=32, temperature=0)
    plain = Engine(make_cfg(model_quantization=scheme, max_total_tokens=4096, max_running_requests=4))
    prompts = [plain.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(3)]
    ref = [plain.generate([p], params)[0].token_ids for p in prompts]
    del plain
    eng = Engine(make_cfg(model_quantization=scheme, max_total_tokens=4096, max_running_requests=4, speculative=Eagle3Config(algorithm="eagle3")))
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == ref
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref
    assert eng.stats.accepted_draft_tokens > 0

"""Linears with int8 activations per token over int8 per-channel weights
(model.activation_quantization=int8_per_token, kernels/w8a8_ops.cpp): each build (AMX tiles,
AVX512-VNNI, AVX2, portable) against a float64 reference of its arithmetic, bit-equal builds, row
invariance, the layout round trip, config checks, and greedy speculative == plain greedy within
the scheme (the one-call layers: tests/unit/test_kernel_layers.py)."""

import numpy as np
import pytest
import torch

from conftest import make_cfg
from quant_spec_helpers import assert_speculation_equals_plain, kernel_or_skip, plain_reference
from specfw.backends.quant_linear import QuantLinear, quantize
from specfw.backends.w8a8_linear import W8A8Linear, from_quant_weight
from specfw.config import ConfigError, validate
from specfw.kernels import W8A8_ISAS, quant_ops, w8a8_isa, w8a8_isa_supported, w8a8_ops


def _ops(isa):
    return kernel_or_skip(isa, w8a8_isa_supported, w8a8_ops, "w8a8's build ")


def _linear(n, k, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def reference(x: torch.Tensor, qw, bias):
    """float32 numpy for the row codes (dx = max|x| / 127, q = round-half-even(x * (1 / dx))),
    exact integers for the sums, then fma(float32(P), float32(dx * d), bias): the product of two
    float32 is exact in float64 and the sum rounds once more, to float32."""
    v = x.numpy().astype(np.float32)
    dx = (np.abs(v).max(1) / np.float32(127)).astype(np.float32)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    q = np.rint(v * inv[:, None]).astype(np.int64)
    from specfw.backends.q8_linear import unblock

    c, d, _ = unblock(qw)
    P = (q @ c.numpy().astype(np.int64).T).astype(np.float32)
    s = (dx[:, None] * d[:, 0].numpy()[None, :]).astype(np.float32)
    y = P.astype(np.float64) * s.astype(np.float64)
    if bias is not None:
        y = y + bias.detach().numpy().astype(np.float64)
    return torch.from_numpy(y.astype(np.float32))


@pytest.mark.parametrize("isa", W8A8_ISAS)
@pytest.mark.parametrize("n, k", [(40, 64), (70, 96), (200, 576)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_matches_the_reference_and_rows_are_independent(isa, n, k, bias):
    """Widths that are not whole chunks of 64 inputs, outputs that are not whole blocks of 16; every
    tiling of the rows (1-20, past one AMX tile of 16) gives each row its bits alone."""
    ops = _ops(isa)
    lin = _linear(n, k, seed=n + k, bias=bias)
    qw = quantize(lin.weight, "int8")
    w8 = W8A8Linear.from_quant_weight(qw, lin.bias, ops)
    x = torch.randn(20, k) * 2
    x[3] = 0  # an all-zero row: dx 0, codes 0, the bias alone
    x[5, 7] = 60.0  # an outlier: the whole row's codes shrink
    y = w8(x)
    assert torch.equal(y, reference(x, qw, lin.bias if bias else None))
    for rows in (1, 2, 5, 8, 9, 16, 17):
        assert torch.equal(w8(x[:rows]), y[:rows]), rows
    assert torch.equal(w8(x[11:12]), y[11:12])


@pytest.mark.parametrize("isa", [i for i in W8A8_ISAS if i != "portable"])
def test_simd_builds_give_the_portable_builds_bits(isa):
    ops, portable = _ops(isa), _ops("portable")
    lin = _linear(100, 320, seed=5)
    qw = quantize(lin.weight, "int8")
    x = torch.randn(37, 320)  # three AMX row groups, the last ragged
    assert torch.equal(W8A8Linear.from_quant_weight(qw, lin.bias, ops)(x), W8A8Linear.from_quant_weight(qw, lin.bias, portable)(x))


def test_layout_round_trip_and_the_weight_only_schemes_weights():
    """The kernel's codes stand for exactly the int8 weight-only scheme's weights, and the output
    is within per-token rounding of them."""
    ops, qops = _ops("portable"), quant_ops("portable")
    if qops is None:
        pytest.skip("kernels cannot be built here")
    lin = _linear(50, 96, seed=3)
    qw = quantize(lin.weight, "int8")
    w8 = W8A8Linear.from_quant_weight(qw, lin.bias, ops)
    assert torch.equal(w8.weight, QuantLinear(qw, lin.bias, qops, "int8").weight)
    x = torch.randn(4, 96)
    exact = x.double() @ w8.weight.double().T + lin.bias.double()
    err = (w8(x).double() - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.02, err
    with pytest.raises(ValueError, match="one scale per output channel"):
        from_quant_weight(quantize(lin.weight, "int4"), ops)


def test_the_avx512_cpu_picks_amx_where_it_has_it():
    from specfw.kernels import _cpu_flags, isa_supported

    if not isa_supported("avx512"):
        assert w8a8_isa("avx2") == "avx2"
        return
    flags = _cpu_flags()
    want = "amx" if {"amx_tile", "amx_int8"} <= flags else "avx512" if "avx512_vnni" in flags else "avx2"
    assert w8a8_isa("avx512") == want
    assert w8a8_isa("portable") == "portable" and w8a8_isa("avx2") == "avx2"


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match=r"model.activation_quantization.*quantization=int8.*'gguf'"):
        validate(make_cfg(model_quantization="gguf", model_activation_quantization="int8_per_token"))
    with pytest.raises(ConfigError, match="model.activation_quantization.*needs quantized weights"):
        validate(make_cfg(model_activation_quantization="int8_per_token"))
    validate(make_cfg(model_quantization="int8", model_activation_quantization="int8_per_token"))


def test_speculative_equals_plain_per_token(tiny_model_dir, tiny_draft_dir):
    """Every linear of the target on w8a8_ops (the decoder layers in one kernel call); ngram and
    standalone (its draft on the per-token kernels too, and unquant) batch 1 and 4 == plain greedy."""
    from specfw.engine import Engine

    kw = dict(
        model_path=str(tiny_model_dir), model_quantization="int8", model_activation_quantization="int8_per_token", max_total_tokens=4096, max_running_requests=4
    )
    plain = Engine(make_cfg(**kw))
    model = plain.runner.model
    assert len([m for m in model.modules() if isinstance(m, W8A8Linear)]) == 4 * len(model.layers) + 1
    assert plain.backend.decoder_stack(model) is not None  # the one call takes these linears
    assert "int8 activations per token" in plain.backend.describe()
    ref = plain_reference(plain)
    drafts_checked = []

    def draft_on_the_per_token_kernels(spec, eng):
        if spec.algorithm == "standalone" and spec.draft_model_quantization is None:
            draft = eng.worker.runtime.draft.model
            assert len([m for m in draft.modules() if isinstance(m, W8A8Linear)]) == 4 * len(draft.layers) + 1
            drafts_checked.append(spec)

    assert_speculation_equals_plain(kw, str(tiny_draft_dir), ref, check=draft_on_the_per_token_kernels)
    assert len(drafts_checked) == 1


@pytest.mark.parametrize("isa", W8A8_ISAS)
def test_any_width_through_the_kernel_directly(isa):
    """Widths the linear module never passes (not multiples of 16 or 32) run the SIMD loops' scalar
    tails and the chunk padding: the reference's bits still, rows alone or together."""
    ops = _ops(isa)
    g = torch.Generator().manual_seed(7)
    n, k = 21, 100
    c = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    d = torch.rand(n, generator=g) * 0.01
    codes = ops.pack(c)
    scale = torch.zeros(codes.shape[0] * 16)
    scale[:n] = d
    x = torch.randn(5, k, generator=g)
    y = ops.linear(x, codes, scale, torch.empty(0), 8, n, torch.empty(0))
    v = x.numpy()
    dx = (np.abs(v).max(1) / np.float32(127)).astype(np.float32)
    q = np.rint(v * (np.float32(1) / dx)[:, None]).astype(np.int64)
    want = ((q @ c.numpy().astype(np.int64).T).astype(np.float32).astype(np.float64) * (dx[:, None] * d.numpy()[None]).astype(np.float64)).astype(np.float32)
    assert torch.equal(y, torch.from_numpy(want))
    assert torch.equal(torch.cat([ops.linear(x[i : i + 1], codes, scale, torch.empty(0), 8, n, torch.empty(0)) for i in range(5)]), y)
    qq, dd = ops.quantize_rows(x)
    assert torch.equal(qq, torch.from_numpy(q.astype(np.int8))) and torch.equal(dd, torch.from_numpy(dx))

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from specfw.cpu_linear import FastLinear, PackedBF16Linear, mkl_packing_available, onednn_bf16_available, use_fast_linears

pytestmark = pytest.mark.skipif(not mkl_packing_available(), reason="needs MKL")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 64])
def test_fast_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    fast = FastLinear(lin)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(fast(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.weight, lin.weight)


def test_fast_linear_keeps_leading_dims():
    lin = nn.Linear(32, 48, bias=False)
    fast = FastLinear(lin)
    x = torch.randn(2, 5, 32)
    out = fast(x)
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out, lin(x), rtol=1e-5, atol=1e-5)


def test_use_fast_linears_swaps_fp32_and_bf16_linears():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 4).to(torch.float16), nn.Linear(4, 4).to(torch.bfloat16))
    assert use_fast_linears(model) == (4 if onednn_bf16_available() else 3) - 1
    assert isinstance(model[0], FastLinear) and isinstance(model[1][0], FastLinear)
    assert type(model[2]) is nn.Linear
    from specfw.cpu_linear import DotBF16Linear, bf16_kernel_available

    bf16 = DotBF16Linear if bf16_kernel_available() else PackedBF16Linear
    assert isinstance(model[3], bf16) == onednn_bf16_available()
    plain = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))
    use_fast_linears(plain, bf16_kernel=False)
    assert isinstance(plain[0], PackedBF16Linear) == onednn_bf16_available()


@pytest.mark.skipif(not onednn_bf16_available(), reason="needs oneDNN bf16")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_linear(bias):
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    fast = PackedBF16Linear(lin)
    for rows in (1, 5, 16, 70):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(fast(x), F.linear(x, lin.weight, lin.bias), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(fast.weight, lin.weight)
    assert fast(torch.randn(2, 3, 96, dtype=torch.bfloat16)).shape == (2, 3, 200)


def _row_by_row(layer, x):
    return torch.cat([layer(x[r : r + 1]) for r in range(x.shape[0])])


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_batch_invariant_linears_give_every_row_its_one_row_result(kind):
    """The property batch-invariant decoding rests on: a row's output bits do not depend on how
    many rows share the call (576x1536 in bf16 breaks it at 150-256 rows without the row blocks)."""
    if kind == "bf16" and not onednn_bf16_available():
        pytest.skip("needs oneDNN bf16")
    torch.manual_seed(1)
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    lin = nn.Linear(1536, 576, bias=False)
    lin.weight.data.mul_(0.05)
    lin = lin.to(dtype)
    layer = FastLinear(lin, batch_invariant=True) if kind == "fp32" else PackedBF16Linear(lin, batch_invariant=True)
    x = torch.randn(260, 1536, dtype=dtype)
    ref = _row_by_row(layer, x)
    for rows in (2, 3, 4, 8, 10, 17, 65, 150, 200, 260):
        assert torch.equal(layer(x[:rows]), ref[:rows]), rows
    assert 1 <= layer.row_plan().block <= 64


def test_engine_greedy_same_on_every_cpu_kernel_choice(tiny_model_dir):
    """torch's plain linears, MKL-packed ones (engine.cpu_isa=none) and specfw's kernels
    (engine.cpu_isa=auto, and the portable build) decode the same greedy tokens."""
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams

    prompts = [[1, 5, 9, 200, 31], [7, 7, 100], [3, 4, 5, 6, 7, 8, 9, 10], [42]]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for isa, packed, linear in (("none", True, "FastLinear"), ("none", False, "Linear"), ("auto", True, "KernelLinear"), ("portable", True, "KernelLinear")):
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=4, max_total_tokens=1024, cpu_packed_gemm=packed, cpu_isa=isa))
        kinds = {type(m).__name__ for m in eng.runner.model.modules()}
        assert linear in kinds, (isa, packed, kinds)
        outs[(isa, packed)] = [c.token_ids for c in eng.generate(prompts, params)]
    first = next(iter(outs.values()))
    assert all(o == first for o in outs.values()), outs

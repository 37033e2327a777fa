import pytest
import torch
from torch import nn
import torch.nn.functional as F

from specfw.cpu_linear import FastLinear, mkl_packing_available, use_fast_linears

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


def test_use_fast_linears_swaps_only_fp32_linears():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 4).to(torch.bfloat16))
    assert use_fast_linears(model) == 2
    assert isinstance(model[0], FastLinear) and isinstance(model[1][0], FastLinear)
    assert type(model[2]) is nn.Linear


def test_engine_greedy_same_with_and_without_packed_gemm(tiny_model_dir):
    from conftest import make_cfg
    from specfw.engine import Engine
    from specfw.sampling import SamplingParams
    prompts = [[1, 5, 9, 200, 31], [7, 7, 100], [3, 4, 5, 6, 7, 8, 9, 10], [42]]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    outs = {}
    for packed in (True, False):
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_running_requests=4, max_total_tokens=1024,
                              cpu_packed_gemm=packed))
        kinds = {type(m).__name__ for m in eng.runner.model.modules()}
        assert ("FastLinear" in kinds) == packed
        outs[packed] = [c.token_ids for c in eng.generate(prompts, params)]
    assert outs[True] == outs[False]

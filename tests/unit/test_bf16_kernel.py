"""specfw's bf16 linear kernels (cpu_linear.DotBF16Linear over specfw/kernels/bf16_dot.cpp,
AVX512-BF16, and bf16_amx.cpp, AMX tiles): right values, every row independent of the others
and of the thread count, and chosen for bf16 layers where one runs. Each runs where the CPU has
its flags and skips elsewhere."""

import pytest
import torch
from torch import nn

from specfw.cpu_linear import DotBF16Linear, PackedBF16Linear, fast_linear_for, onednn_bf16_available
from specfw.kernels import bf16_amx, bf16_dot, bf16_dot_preferred, bf16_kernel, cpu_has_amx_bf16, cpu_has_avx512_bf16

needs_kernel = pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="CPU without avx512_bf16")
KERNELS = [pytest.param("dot", marks=needs_kernel), pytest.param("amx", marks=pytest.mark.skipif(not cpu_has_amx_bf16(), reason="CPU without amx_bf16"))]


def _kernel(name):
    return bf16_dot() if name == "dot" else bf16_amx()


@needs_kernel
def test_kernel_builds_on_cpus_with_avx512_bf16():
    """Every machine this project runs on has the flag, gcc and (from pyproject) ninja."""
    assert bf16_dot() is not None


@pytest.mark.skipif(not cpu_has_amx_bf16(), reason="CPU without amx_bf16")
def test_amx_kernel_builds_and_is_the_one_chosen_on_amx_cpus():
    assert bf16_amx() is not None and bf16_kernel() is bf16_amx()


def _layer(n, k, bias, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.normal_()
        if bias:
            lin.bias.normal_()
    return lin.to(torch.bfloat16)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (50, 577, True), (576, 1536, True), (8192, 576, False), (70, 40, True)])
def test_values_and_row_independence(n, k, bias, kernel):
    lin = _layer(n, k, bias)
    dot = DotBF16Linear(lin, kernel=_kernel(kernel))
    assert torch.equal(dot.weight, lin.weight.detach())  # the packed layout unpacks to the weight
    g = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 7, 8, 9, 16, 17, 70):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            y = dot(x)
            ref = x.float() @ lin.weight.float().t() + (lin.bias.float() if bias else 0)
            # fp32 accumulation, one bf16 rounding at the end
            assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
            assert torch.allclose(y.float(), ref, rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
            alone = torch.cat([dot(x[i : i + 1]) for i in range(rows)])
            assert torch.equal(y, alone), f"{rows} rows: a row's bits depend on the other rows"


@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_do_not_depend_on_the_thread_count(kernel):
    dot = DotBF16Linear(_layer(3072, 576, False), kernel=_kernel(kernel))
    x = torch.randn(9, 576).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = dot(x)
            torch.set_num_threads(2)
            two = dot(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_invariant_plan_takes_every_row_count_unpadded(kernel):
    dot = DotBF16Linear(_layer(576, 1536, False), batch_invariant=True, kernel=_kernel(kernel))
    plan = dot.row_plan()
    assert plan.block == 64 and not plan.pad  # the probe agrees with the construction


def test_bf16_layers_get_the_kernel_where_it_is_preferred():
    lin = _layer(64, 32, False)
    chosen = fast_linear_for(lin)
    if bf16_dot_preferred():
        assert isinstance(chosen, DotBF16Linear)
    elif onednn_bf16_available():
        assert isinstance(chosen, PackedBF16Linear)
    if onednn_bf16_available():
        assert isinstance(fast_linear_for(lin, bf16_kernel=False), PackedBF16Linear)

"""The kernel seam (specfw.backends): which backend the engine gets, what prepare_module does to a
drafter's layer, and that kernel settings stay inside the backends."""

import re
from pathlib import Path

import pytest
import torch

from specfw.backends import make_backend
from specfw.backends.cpu import CpuBackend
from specfw.backends.kernel_linear import KernelLinear
from specfw.backends.torch_ops import TorchBackend
from specfw.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]


def test_backend_choice_follows_device_and_cpu_isa():
    assert isinstance(make_backend("meta"), TorchBackend)
    assert isinstance(make_backend("cpu", cpu_isa="none"), TorchBackend)
    cpu = make_backend("cpu", cpu_isa="portable")
    assert isinstance(cpu, CpuBackend) and cpu.isa == "portable"
    assert make_backend("cpu", batch_invariant=True).for_drafting().batch_invariant is False


def test_kernel_backend_falls_back_to_torch_ops_when_kernels_cannot_build(monkeypatch):
    from specfw import kernels

    monkeypatch.setenv("SPECFW_NO_KERNELS", "1")
    monkeypatch.setattr(kernels, "_cache", {})
    assert cpu_ops() is None
    assert isinstance(make_backend("cpu"), TorchBackend)


def test_prepare_module_fuses_a_draft_layer_and_keeps_its_output(tiny_model_dir):
    """A draft layer prepared by the CPU backend runs q/k/v and gate/up as one kernel linear each
    and the fused glue; its output matches the unfused torch path."""
    from transformers import LlamaConfig
    from specfw.kv_cache import KVPool
    from specfw.model_runner import build_forward_batch
    from specfw.models.draft_layer import DraftDecoderLayer
    from specfw.models.llama import Rotary

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    plain = DraftDecoderLayer(cfg).eval().requires_grad_(False)
    fused = DraftDecoderLayer(cfg).eval().requires_grad_(False)
    fused.load_state_dict(plain.state_dict())
    make_backend("cpu").prepare_module(fused)
    assert isinstance(fused.qkv_fused, KernelLinear) and isinstance(fused.gate_up_fused, KernelLinear)
    rotary = Rotary(cfg, 256, torch.float32)
    x, res = torch.randn(5, 64), torch.randn(5, 64)
    outs = []
    for layer in (plain, fused):
        kv = KVPool(1, 2, 16, 32)
        prefix = kv.allocator.alloc(2)
        kv.k[0][prefix] = 0.5
        kv.v[0][prefix] = 0.25
        fb = build_forward_batch([(torch.arange(5), torch.arange(2, 7), kv.allocator.alloc(5), prefix, None)])
        with torch.inference_mode():
            outs.append(layer(x, res, fb, kv, rotary))
    assert torch.allclose(outs[0], outs[1], atol=1e-4), (outs[0] - outs[1]).abs().max()


def test_model_runner_kv_pool_and_plugins_carry_no_kernel_flags():
    """Kernel choices live in specfw.backends: the model, the runner, the KV pool, the workers and
    the plugins never read engine.cpu_* or batch_invariant settings."""
    flags = re.compile(
        r"cpu_packed_gemm|cpu_bf16_kernel|cpu_isa|\bpacked_gemm\b|\bbf16_kernel\b|"
        r"(engine|cfg|config|model)\.batch_invariant\b|batch_invariant\s*=\s*(True|False|cfg)"
    )
    paths = [
        ROOT / "core" / "model_runner.py",
        ROOT / "core" / "kv_cache.py",
        ROOT / "core" / "worker.py",
        *(ROOT / "core" / "models").glob("*.py"),
        *(ROOT / "core" / "speculative").glob("*.py"),
        *(ROOT / "plugins").rglob("*.py"),
    ]
    offenders = [str(p.relative_to(ROOT)) for p in paths if flags.search(p.read_text())]
    assert not offenders, offenders


def test_huge_page_relocation_keeps_values_in_one_aligned_buffer():
    from specfw.backends import huge_pages

    ts = [torch.randn(700, 1024), torch.randn(3, 5).to(torch.bfloat16), torch.randn(512, 512)]
    out = huge_pages.relocate(ts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(ts, out))
    if not huge_pages.huge_pages_available():
        assert all(a is b for a, b in zip(ts, out))
        return
    assert out[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(t.data_ptr() % 64 == 0 for t in out)
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()  # one buffer
    small = [torch.randn(4, 4)]
    assert huge_pages.relocate(small)[0] is small[0]  # under 2 MB: not worth a buffer


def test_cpu_backend_puts_packed_weights_on_one_buffer():
    from specfw.backends import huge_pages
    from specfw.backends.kernel_linear import KernelLinear
    from specfw.kernels import cpu_ops

    ops = cpu_ops("portable")
    if ops is None or not huge_pages.huge_pages_available():
        pytest.skip("no kernels or no transparent huge pages here")
    from specfw.backends.cpu import CpuBackend

    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    x = torch.randn(3, 512)
    ref = model(x)
    CpuBackend(ops, "portable").prepare_module(model)
    layers = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert len(layers) == 2
    assert layers[0].packed.untyped_storage().data_ptr() == layers[1].packed.untyped_storage().data_ptr()
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activations", ["none", "int8", "int8_per_token"])
def test_cpu_backend_puts_quantized_codes_on_one_buffer(activations):
    """Weight-only codes (``QuantLinear``), int8-activation codes (``Q8Linear``) and per-token ones
    (``W8A8Linear``) with their scales move to the huge-page buffer; outputs keep their bits."""
    import copy

    from specfw.backends import huge_pages
    from specfw.backends.q8_linear import Q8Linear
    from specfw.backends.quant_linear import QuantLinear
    from specfw.kernels import cpu_ops

    ops = cpu_ops("portable")
    if ops is None or not huge_pages.huge_pages_available():
        pytest.skip("no kernels or no transparent huge pages here")
    from specfw.backends.cpu import CpuBackend

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))
    backend = CpuBackend(ops, "portable", quantization="int8", activation_quantization=activations)
    kept = backend._swap(copy.deepcopy(model), False, "int8", None, activations)  # the same linears, left where torch put them
    backend.prepare_module(model)
    kind = QuantLinear if activations == "none" else Q8Linear
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert len(layers) == 2
    storages = {t.untyped_storage().data_ptr() for m in layers for t in ((m.qw.codes, m.qw.scale) if kind is QuantLinear else (m.q8.codes, m.q8.d))}
    assert len(storages) == 1
    x = torch.randn(3, 1024)
    assert torch.equal(model(x), kept(x))

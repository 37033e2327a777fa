"""``model.attention_backend`` / ``speculative.draft_attention_backend``: names checked at
startup, device needs checked where the device is known, SGLang's flags mapped."""

import pytest
import torch
from hydra import compose, initialize_config_module

from specfw.backends import make_backend
from specfw.backends.attention_backends import check_attention_backend, resolve
from specfw.config import ConfigError, validate
from specfw.config_store import register_configs
from specfw.sglang_flags import translate


def _cfg(*overrides):
    register_configs()
    with initialize_config_module("specfw_conf", version_base="1.3"):
        return compose("serve", overrides=list(overrides))


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.attention_backend=fa3", "model.attention_backend"),
        ("speculative.draft_attention_backend=flashmla", "speculative.draft_attention_backend"),
    ],
)
def test_an_unknown_backend_fails_at_startup_naming_the_key_and_the_allowed_values(override, key):
    with pytest.raises(ConfigError) as e:
        validate(_cfg("speculative=eagle3", override))
    assert e.value.key == key and "triton" in str(e.value) and "flashinfer" in str(e.value)


def test_gpu_backends_without_cuda_fail_naming_the_key(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError) as e:
        check_attention_backend("triton", cpu)
    assert e.value.key == "model.attention_backend" and ("CUDA" in str(e.value) or "not installed" in str(e.value))
    with pytest.raises(ConfigError) as e:
        check_attention_backend("flashinfer", cpu, "speculative.draft_attention_backend")
    assert e.value.key == "speculative.draft_attention_backend" and "CUDA" in str(e.value)
    check_attention_backend("torch", cpu)
    check_attention_backend(None, cpu)


def test_ngram_refuses_a_draft_attention_backend():
    with pytest.raises(ConfigError) as e:
        validate(_cfg("speculative=ngram", "speculative.draft_attention_backend=torch"))
    assert e.value.key == "speculative.draft_attention_backend"


def test_auto_resolves_per_device_and_the_backend_plans_accordingly():
    from specfw.backends.attention_backends import TritonAttentionPlan
    from specfw.backends.base import HeadShape
    from specfw.backends.torch_ops import SdpaPlan
    from specfw.forward_batch import SeqSpan

    assert resolve("auto", torch.device("cpu")) == "native" and resolve(None, torch.device("cpu")) == "native"
    assert resolve("torch", torch.device("cpu")) == "torch"
    seqs, shape = [SeqSpan(0, 1, torch.tensor([0, 1, 2]))], HeadShape(torch.float32, 4, 2, 16)
    be = make_backend("cpu").set_attention("torch")
    assert isinstance(be.plan_attention(seqs, torch.device("cpu"), shape, True), SdpaPlan)
    assert "attention torch" in be.describe()
    be = make_backend("cpu").set_attention("auto", "triton")
    assert be.attention == "native" and be.for_draft_modules().attention == "triton" and be.for_drafting().attention == "triton"
    assert be.for_draft_modules().plan_attention(seqs, torch.device("cpu"), shape, False).__class__ is TritonAttentionPlan
    assert be.plan_attention(seqs, torch.device("cpu"), shape, True).__class__ is not TritonAttentionPlan
    assert "draft attention triton" in be.describe()


def test_sglang_attention_flags_map_to_the_keys():
    t = translate("--attention-backend torch_native --speculative-draft-attention-backend triton")
    assert "model.attention_backend=torch" in t.overrides and "speculative.draft_attention_backend=triton" in t.overrides
    t = translate("--attention-backend flashinfer")
    assert t.overrides == ["model.attention_backend=flashinfer"] and not t.warnings
    t = translate("--attention-backend fa3")
    assert not t.overrides and "fa3" in t.warnings[0]


def test_flashinfer_visibility_mask_lists_the_same_keys_as_the_row_layout():
    """The custom mask FlashInfer gets (page = slot) shows each row exactly the keys the Triton
    and CPU kernels read for it (pure torch: runs without CUDA)."""
    from specfw.backends.flashinfer_attention import visibility
    from specfw.backends.row_layout import RowLayout
    from specfw.forward_batch import SeqSpan

    tree = torch.eye(4, dtype=torch.bool)
    tree[1, 0] = tree[2, 0] = tree[3, 0] = tree[3, 1] = True
    seqs = [SeqSpan(0, 1, torch.tensor([5, 6, 7])), SeqSpan(1, 4, torch.tensor([1, 2, 3, 10, 11, 12, 13]), tree), SeqSpan(5, 3, torch.tensor([20, 21, 22]))]
    qo, kv, idx, mask = visibility(seqs)
    lay = RowLayout.build(seqs)
    assert qo.tolist() == [0, 1, 5, 8] and kv.tolist() == [0, 3, 10, 13] and idx.tolist() == [5, 6, 7, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22]
    offset = 0
    for s in seqs:
        n = int(s.kv_slots.numel())
        m = mask[offset : offset + s.q_len * n].view(s.q_len, n)
        offset += s.q_len * n
        for i in range(s.q_len):
            assert s.kv_slots[m[i]].tolist() == lay.keys(s.q_start + i).tolist()
    assert offset == mask.numel()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it on a GPU)")


@needs_cuda
@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_attention_backends_match_the_float64_reference(name, dtype):
    from specfw.backends.attention_backends import check_attention_backend, named_plan
    from specfw.backends.base import HeadShape
    from specfw.backends.row_layout import RowLayout, reference_attention
    from specfw.forward_batch import SeqSpan

    if name == "flashinfer" and dtype == torch.float32:
        pytest.skip("FlashInfer's kernels take fp16/bf16")
    if name == "flashinfer":
        pytest.importorskip("flashinfer")  # the optional extra specfw[gpu]
    dev = torch.device("cuda")
    check_attention_backend(name, dev)
    g = torch.Generator().manual_seed(0)
    tree = torch.eye(4, dtype=torch.bool)
    tree[1:, 0] = True
    seqs = [SeqSpan(0, 1, torch.arange(0, 300)), SeqSpan(1, 4, torch.arange(300, 404), tree), SeqSpan(5, 37, torch.arange(404, 441))]
    k = torch.randn(512, 2, 64, generator=g).to(dtype).to(dev)
    v = torch.randn(512, 2, 64, generator=g).to(dtype).to(dev)
    q = torch.randn(42, 8, 64, generator=g).to(dtype).to(dev)
    out = named_plan(name, seqs, dev, HeadShape(dtype, 8, 2, 64), True)(q, k, v, 0.125)
    ref = reference_attention(q, k, v, 0.125, RowLayout.build(seqs))
    assert (out.double().cpu() - ref).abs().max().item() < (1e-4 if dtype == torch.float32 else 2e-2)

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

"""``speculative.draft_model_quantization=auto``, EAGLE-3's default: int8 weights and activations
for the head on the CPU kernels' avx512 build where the CPU has AVX512-VNNI, or on their avx2
build, and the target is unquantized; the target's scheme (null) everywhere else. Output stays the plain output."""

import pytest

from conftest import make_cfg
from specfw.backends import resolve_draft_quantization
from specfw.config import ConfigError
from specfw.kernels import isa_supported, q8_ops
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

VNNI = isa_supported("avx512") and q8_ops("avx512") is not None and q8_ops("avx512").isa() == "avx512_vnni"
PROMPTS = [[1, 2, 3, 4, 5, 6], [1000, 20, 1000, 20, 1000]]


def test_auto_resolves_per_device_isa_and_target_scheme():
    for given in (None, "none", "unquant", "int8", "w8a8_int8", "gguf"):  # every other value as given
        assert resolve_draft_quantization(given, "cpu", "auto", "none", "none") == given
    assert resolve_draft_quantization("auto", "cuda", "auto", "none", "none") is None  # a GPU: the target's scheme
    assert resolve_draft_quantization("auto", "cpu", "none", "none", "none") is None  # torch's ops: no int8 kernels
    assert resolve_draft_quantization("auto", "cpu", "portable", "none", "none") is None
    assert resolve_draft_quantization("auto", "cpu", "auto", "gguf", "int8") is None  # a quantized target's drafts follow it
    assert resolve_draft_quantization("auto", "cpu", "auto", "int8", "none") is None
    if isa_supported("avx2") and q8_ops("avx2") is not None:  # an AVX2-only Zen 3 gained (session 68)
        assert resolve_draft_quantization("auto", "cpu", "avx2", "none", "none") == "w8a8_int8"
    if VNNI:
        assert resolve_draft_quantization("auto", "cpu", "avx512", "none", "none") == "w8a8_int8"
        assert resolve_draft_quantization("auto", "cpu", "auto", "none", "none") == "w8a8_int8"


def test_eagle3_defaults_to_auto_and_a_bad_value_names_the_key(tiny_model_dir):
    from specfw.config import validate

    config_class = plugin_manager().algorithms["eagle3"].config_class
    assert config_class(algorithm="eagle3").draft_model_quantization == "auto"
    assert plugin_manager().algorithms["eagle"].config_class(algorithm="eagle").draft_model_quantization is None  # measured no gain: null
    with pytest.raises(ConfigError, match=r"speculative\.draft_model_quantization: 'int9' is not one of .*'auto'"):
        validate(make_cfg(model_path=str(tiny_model_dir), speculative=config_class(algorithm="eagle3", draft_model_quantization="int9")))
    validate(make_cfg(model_path=str(tiny_model_dir), speculative=config_class(algorithm="eagle3")))  # auto passes


def _run(model_dir, draft, dtype, **keys):
    from specfw.engine import Engine

    spec = plugin_manager().algorithms["eagle3"].config_class(algorithm="eagle3", draft_model_path=str(draft), aux_layers=[0, 1, 1], **keys)
    with Engine(make_cfg(model_path=str(model_dir), model_dtype=dtype, max_total_tokens=2048, speculative=spec)) as eng:
        kinds = {type(m).__name__ for m in eng.worker.runtime.head.modules() if type(m).__name__.endswith("Linear")}
        outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0))]
    return kinds, outs


@pytest.mark.skipif(not VNNI, reason="the auto int8 head needs the avx512 kernels on a CPU with AVX512-VNNI")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_head_runs_int8_and_decodes_as_plain(dtype, tiny_model_dir, tiny_eagle_drafts):
    from specfw.engine import Engine

    kinds, outs = _run(tiny_model_dir, tiny_eagle_drafts["eagle3"], dtype)
    assert kinds == {"Q8Linear"}
    null_kinds, null_outs = _run(tiny_model_dir, tiny_eagle_drafts["eagle3"], dtype, draft_model_quantization=None)
    assert "Q8Linear" not in null_kinds
    with Engine(make_cfg(model_path=str(tiny_model_dir), model_dtype=dtype, max_total_tokens=2048)) as eng:
        plain = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0))]
    assert outs == plain == null_outs


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_avx2_build_runs_an_int8_head_the_portable_build_the_models_dtype(isa, tiny_model_dir, tiny_eagle_drafts):
    """The avx2 build (an AVX2-only CPU's, or forced on any x86-64 one) drafts on q8_ops' avx2
    int8 head; the portable build keeps the head as the model is. Both decode as plain."""
    if not isa_supported(isa) or (isa == "avx2" and q8_ops("avx2") is None):
        pytest.skip(f"this CPU or build lacks the {isa} int8-activation kernels")
    from specfw.engine import Engine

    spec = plugin_manager().algorithms["eagle3"].config_class(algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1])
    with Engine(make_cfg(model_path=str(tiny_model_dir), cpu_isa=isa, max_total_tokens=2048, speculative=spec)) as eng:
        kinds = {type(m).__name__ for m in eng.worker.runtime.head.modules() if type(m).__name__.endswith("Linear")}
        outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0))]
    if isa == "avx2":
        assert kinds == {"Q8Linear"}  # int8 weights, int8 activations (w8a8_int8)
    else:
        assert eng.runner.backend.draft_quantization == "none" and "Q8Linear" not in kinds
    with Engine(make_cfg(model_path=str(tiny_model_dir), cpu_isa=isa, max_total_tokens=2048)) as eng:
        assert outs == [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=32, temperature=0))]

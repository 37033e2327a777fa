"""What the quantized-kernel tests (test_quant, test_q8, test_w8a8, test_proxy_head) share: q8_ops' builds or a skip; greedy ngram and
standalone speculation (the draft on the target's scheme, and unquantized) equal plain decoding of
the same engine settings, one request at a time and four at once."""

import pytest

from conftest import make_cfg
from specfw.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
RAW = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999], [3, 4, 3, 4, 3, 4]]


def kernel_or_skip(isa: str, supported, build, label: str = ""):
    """A kernel module's ``isa`` build (``build(isa)``), or a clean skip where this CPU cannot run it
    (``supported(isa)`` false) or nothing can be built here."""
    if not supported(isa):
        pytest.skip(f"this CPU cannot run {label}{isa}")
    ops = build(isa)
    if ops is None:
        pytest.skip("kernels cannot be built here")
    return ops


def q8_ops_or_skip(isa: str):
    from specfw.kernels import q8_isa_supported, q8_ops

    return kernel_or_skip(isa, q8_isa_supported, q8_ops)


def plain_reference(engine) -> list[list[int]]:
    """Each RAW prompt's greedy tokens alone; asserts the batch of four gives the same."""
    ref = [engine.generate([p], GREEDY)[0].token_ids for p in RAW]
    assert [o.token_ids for o in engine.generate(RAW, GREEDY)] == ref
    return ref


def assert_speculation_equals_plain(kw: dict, draft_dir: str, ref: list[list[int]], check=None) -> None:
    """ngram, standalone on ``kw``'s scheme and standalone unquantized, each an Engine of ``kw``:
    RAW's greedy tokens == ``ref`` alone and batched, with verify forwards run; ``check(spec,
    engine)``: a test's own checks of each engine."""
    from specfw.engine import Engine
    from specfw_plugins.ngram.config import NgramConfig
    from specfw_plugins.standalone.config import StandaloneConfig

    for spec in [
        NgramConfig(algorithm="ngram", num_draft_tokens=4),
        StandaloneConfig(algorithm="standalone", draft_model_path=draft_dir, num_steps=2, topk=2, num_draft_tokens=5),
        StandaloneConfig(algorithm="standalone", draft_model_path=draft_dir, num_steps=3, topk=1, draft_model_quantization="unquant"),
    ]:
        eng = Engine(make_cfg(**kw, speculative=spec))
        assert [eng.generate([p], GREEDY)[0].token_ids for p in RAW] == ref, spec
        assert [o.token_ids for o in eng.generate(RAW, GREEDY)] == ref, spec
        assert eng.stats.verify_forwards > 0
        if check is not None:
            check(spec, eng)

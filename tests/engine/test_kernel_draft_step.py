"""An EAGLE-3 head's draft step in one kernel call (``KernelDraftStep``, ``cpu_ops.eagle3_draft``:
the extend pass and EAGLE-2's beam search): step for step the Python step's candidates (tokens,
parents, scores, in order), in fp32 and bf16, on each ISA build the CPU has; with three requests in
flight, the auto shape and a wide tree, a score floor and the keep cut pruning beams, and a
catch-up extend over more than 32 pending pairs (after plain-played steps), and an int8 head
(``draft_model_quantization=w8a8_int8``). The portable build
keeps the Python step, and so does a head whose lm_head is not a plain kernel linear."""

import dataclasses

import pytest
import torch

from conftest import make_cfg
from specfw.backends.cpu import CpuBackend
from specfw.backends.kernel_draft_step import KernelDraftStep
from specfw.kernels import cpu_ops, isa_supported, q8_isa
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999], [42] * 7]


def _run(model_dir, draft, isa, dtype, one_call, monkeypatch, shape=None, floor=None, plain_steps=0):
    """(every draft step's candidates, the outputs, the one-call steps made, whether the head has
    one) of one engine run."""
    from specfw.engine import Engine

    monkeypatch.setattr(CpuBackend, "one_call_drafts", one_call)
    calls = []
    real_call = KernelDraftStep.__call__
    monkeypatch.setattr(KernelDraftStep, "__call__", lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k))
    config_class = plugin_manager().algorithms["eagle3"].config_class
    keys = {"draft_model_quantization": None, **(shape or {})}  # the head in the model's dtype unless a case says int8 (EAGLE-3's auto would pick it)
    spec = config_class(algorithm="eagle3", draft_model_path=str(draft), aux_layers=[0, 1, 1], adaptive_draft="false", **keys)
    cfg = make_cfg(model_path=str(model_dir), model_dtype=dtype, cpu_isa=isa, max_running_requests=3, max_total_tokens=4096, speculative=spec)
    with Engine(cfg) as eng:
        drafter, policy = eng.worker.runtime, eng.worker.policy
        step = drafter.kernel_draft_step()
        has_one, tiles = step is not None, step.tiles if step is not None else None
        steps = []
        real_draft = drafter._draft

        def draft(reqs, plan):
            out = real_draft(reqs, plan)
            steps.append([(c.tokens.tolist(), c.parents.tolist(), c.scores.tolist()) for c in out])
            return out

        drafter._draft = draft
        if floor is not None:
            real_plan = policy.plan
            policy.plan = lambda batch: dataclasses.replace(real_plan(batch), score_floor=floor)
        if plain_steps:
            plays = iter([1] * plain_steps)
            full = eng.worker.budget.max_size
            eng.worker.budget.choose = lambda batch, explore=True: next(plays, full)
        outs = [o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_new_tokens=48, temperature=0))]
    return steps, outs, len(calls), has_one, tiles


def _isas():
    return [pytest.param(i, marks=pytest.mark.skipif(not isa_supported(i), reason=f"this CPU lacks {i}")) for i in ("avx2", "avx512")]


CASES = {
    "auto shape": {},
    "a wide tree, score floor": {"shape": {"num_steps": 4, "topk": 6, "num_draft_tokens": 12}, "floor": -4.0},
    "a chain after plain steps": {"shape": {"num_steps": 3, "topk": 1, "num_draft_tokens": 3}, "plain_steps": 40},
    "an int8 head": {"shape": {"draft_model_quantization": "w8a8_int8"}},  # int8 activations: q8_ops' linears by address
    # 3 requests x 6 beams: beam steps of 18 rows, on q8_ops' AMX-INT8 tile build where the CPU has one
    "an int8 head, a wide tree": {"shape": {"draft_model_quantization": "w8a8_int8", "num_steps": 4, "topk": 6, "num_draft_tokens": 12}},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", _isas())
def test_one_call_draft_steps_equal_the_python_steps(case, dtype, isa, tiny_model_dir, tiny_eagle_drafts, monkeypatch):
    if cpu_ops(isa) is None:
        pytest.skip("the CPU kernels cannot be built here")
    kw = CASES[case]
    one, one_out, made, has_one, tiles = _run(tiny_model_dir, tiny_eagle_drafts["eagle3"], isa, dtype, True, monkeypatch, **kw)
    if not has_one:  # a bf16 head's linears outside cpu_ops (DotBF16Linear: per op without vdpbf16ps, on AMX-BF16 tiles)
        assert dtype == "bfloat16" and kw.get("shape", {}).get("draft_model_quantization") is None, "only a bf16 head keeps the Python step"
        pytest.skip(f"the {isa} build runs a {dtype} head's linears outside cpu_ops here (DotBF16Linear): no one-call draft step")
    py, py_out, none, _, _ = _run(tiny_model_dir, tiny_eagle_drafts["eagle3"], isa, dtype, False, monkeypatch, **kw)
    assert made == len(one) > 0 and none == 0
    int8 = kw.get("shape", {}).get("draft_model_quantization") == "w8a8_int8"
    # an int8 head's passes of 16+ rows run q8_ops' AMX-INT8 tile build where the CPU has it (else 0: vpdpbusd)
    assert (tiles[0] != 0 and tiles[1] != 0) == (int8 and q8_isa(isa) == "amx")
    assert one == py
    assert one_out == py_out
    assert sum(len(c[0]) for step in one for c in step) > 0  # something was drafted
    if kw.get("floor") is not None:  # pruned (the floor, the keep cut): some step drafted fewer than every beam's children
        k, steps = kw["shape"]["topk"], kw["shape"]["num_steps"]
        assert any(len(c[0]) < k + (steps - 1) * k * k for step in one for c in step)


def test_portable_and_other_heads_keep_the_python_step(tiny_model_dir, tiny_eagle_drafts, monkeypatch):
    if cpu_ops("portable") is None:
        pytest.skip("the CPU kernels cannot be built here")
    _, _, made, has_one, _ = _run(tiny_model_dir, tiny_eagle_drafts["eagle3"], "portable", "float32", True, monkeypatch)
    assert made == 0 and not has_one
    from specfw.engine import Engine

    spec = plugin_manager().algorithms["eagle3"].config_class(algorithm="eagle3", draft_model_path=str(tiny_eagle_drafts["eagle3"]), aux_layers=[0, 1, 1])
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=spec)) as eng:
        drafter = eng.worker.runtime
        step = drafter.kernel_draft_step()
        if eng.runner.backend.isa == "portable":
            assert step is None
        else:
            assert step is not None and step.current()
            head = drafter.head
            assert not KernelDraftStep.eligible(step.ops, step.one_call, drafter.embed, head.norm, torch.nn.Linear(4, 4))
            assert not KernelDraftStep.eligible(step.ops, None, drafter.embed, head.norm, head.lm_head)

"""specfw greedy output == transformers greedy generate, token for token (demo model, fp32)."""

import pytest
import torch

from specfw.datasets import mtbench_first_turns
from specfw.sampling import SamplingParams

pytestmark = pytest.mark.model
N_PROMPTS, N_NEW = 5, 64  # HF generate of the references is most of this file's time


@pytest.fixture(scope="module")
def prompts_and_reference(demo_engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(demo_engine.model_path, dtype=torch.float32).eval()
    prompts = [demo_engine.tokenize_chat([{"role": "user", "content": q}]) for q in mtbench_first_turns(N_PROMPTS)]
    refs = []
    eos = demo_engine.tokenizer.eos_token_id
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            refs.append(out[0, len(ids) :].tolist())
    return prompts, refs


def _check(outs, refs):
    for i, (o, ref) in enumerate(zip(outs, refs)):
        assert o.token_ids == ref, f"prompt {i}: first divergence at {next(j for j, (a, b) in enumerate(zip(o.token_ids + [-1], ref)) if a != b)}"


def test_single_request_matches_hf(demo_engine, prompts_and_reference):
    prompts, refs = prompts_and_reference
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0)
    _check([demo_engine.generate([p], params)[0] for p in prompts], refs)


def test_batched_requests_match_hf(demo_engine, prompts_and_reference):
    prompts, refs = prompts_and_reference
    params = SamplingParams(max_new_tokens=N_NEW, temperature=0)
    outs = demo_engine.generate(prompts, params)  # all concurrent: one prefill batch, ragged decode batches
    _check(outs, refs)
    assert demo_engine.scheduler.kv_in_use == 0

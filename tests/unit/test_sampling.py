import pytest
import torch

from specfw.sampling import SamplingParams, SamplingParamsError, apply_penalties, make_generator, sample_one, target_probs


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(1000)
    p = SamplingParams(temperature=1.0, seed=7)
    a = [sample_one(logits, p, g, [], [])[0] for g in [make_generator(7)] for _ in range(20)]
    b = [sample_one(logits, p, g, [], [])[0] for g in [make_generator(7)] for _ in range(20)]
    c = [sample_one(logits, p, g, [], [])[0] for g in [make_generator(8)] for _ in range(20)]
    assert a == b and a != c


def test_top_k_mask():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    probs = target_probs(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [False, True, False, True, False]
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, SamplingParams(top_p=0.7))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    assert probs[0, 0].item() == pytest.approx(0.5 / 0.8)
    probs = target_probs(logits, SamplingParams(top_p=0.5))
    assert (probs[0] > 0).tolist() == [True, False, False, False]


def test_min_p():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.06, 0.04]]))
    probs = target_probs(logits, SamplingParams(min_p=0.1))
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    hot = target_probs(logits, SamplingParams(temperature=2.0))[0, 1]
    cold = target_probs(logits, SamplingParams(temperature=0.5))[0, 1]
    assert cold > hot


def test_greedy_ignores_generator():
    logits = torch.randn(50)
    tok, lp = sample_one(logits, SamplingParams(temperature=0, logprobs=True, top_logprobs=3), make_generator(1), [], [])
    assert tok == int(logits.argmax())
    assert lp.logprob == pytest.approx(torch.log_softmax(logits, -1)[tok].item())
    assert [t for t, _ in lp.top][0] == tok and len(lp.top) == 3


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out[0].tolist() == [1.0, -4.0, 1.0, 1.0]
    out = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0], [2, 2, 3])
    assert out[0].tolist() == [2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", 0),
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("top_logprobs", 21),
        ("temperature", 2.5),
        ("temperature", 1e308),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", float("inf")),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", float("-inf")),
        ("top_k", True),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [False]),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field and field in str(e.value)


def test_greedy_tokens_is_torch_argmax_with_first_index_on_ties():
    from specfw.sampling import greedy_tokens

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 49152, generator=g)
    x[1, 7] = x[1, 9000] = x[1].max() + 1  # a tie: the first index
    x[2, 300] = float("nan")  # a NaN row: torch's argmax takes the NaN as the maximum
    assert greedy_tokens(x) == x.argmax(-1).tolist() and greedy_tokens(x)[1] == 7 and greedy_tokens(x)[2] == 300
    assert greedy_tokens(x[3]) == int(x[3].argmax())
    assert greedy_tokens(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # a strided view
    assert greedy_tokens(x.bfloat16()) == x.bfloat16().argmax(-1).tolist()  # other dtypes: torch's own

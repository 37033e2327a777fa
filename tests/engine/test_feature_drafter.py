"""``FeatureDrafter``'s kept features: a step that kept every row of its forward (a plain-played
step) takes ``target_features_all``, which must keep what selecting every row keeps."""

import pytest
import torch

from conftest import make_cfg
from specfw.plugins import plugin_manager
from specfw.sampling import SamplingParams


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
def test_features_of_every_row_equal_the_selected_rows(name, tiny_model_dir, tiny_eagle_drafts):
    from specfw.engine import Engine

    extra = {"aux_layers": [0, 1, 1]} if name == "eagle3" else {}
    spec = plugin_manager().algorithms[name].config_class(algorithm=name, draft_model_path=str(tiny_eagle_drafts[name]), **extra)
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024, speculative=spec)) as eng:
        drafter = eng.worker.runtime
        taps = eng.worker.ctx.capture_layers
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(5, eng.runner.hf_config.hidden_size, generator=g)
        aux = [torch.randn(5, eng.runner.hf_config.hidden_size, generator=g) for _ in taps]
        every = drafter.target_features_all(hidden, aux)
        assert torch.equal(every, drafter.target_features(hidden, aux, torch.arange(5)))
        assert torch.equal(every[1:3], drafter.target_features(hidden, aux, torch.tensor([1, 2])))
        # in the engine: plain-played steps keep every row's features, then drafting resumes from
        # them (its catch-up extend consumes them); the output stays plain greedy's
        plays = iter([1] * 4)  # four plain-played steps, then the whole tree
        eng.worker.budget.choose = lambda batch, explore=True: next(plays, eng.worker.budget.max_size)
        prompt = [1, 2, 3, 4, 5, 6]
        got = eng.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0))[0].token_ids
        assert eng.stats.verify_forwards > 0
    with Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024)) as plain:
        assert got == plain.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0))[0].token_ids

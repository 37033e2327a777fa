"""``model.load_format`` / ``speculative.draft_load_format`` (SGLang's --load-format and
--speculative-draft-load-format) and ``model.trust_remote_code`` (--trust-remote-code) on tiny
model directories."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import make_cfg
from specfw.config import ConfigError
from specfw.model_loader import ModelLoadError, load_model, load_state_dict
from specfw.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [1000, 20, 1000, 20, 1000], [9, 99, 999, 9999], [42] * 6]
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _copy_without_weights(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix not in (".safetensors", ".bin", ".pt"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def pt_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its weights as a PyTorch pickle (pytorch_model.bin) only."""
    out = _copy_without_weights(tiny_model_dir, tmp_path_factory.mktemp("tiny-pt"))
    torch.save(load_state_dict(tiny_model_dir, "safetensors"), out / "pytorch_model.bin")
    return out


@pytest.fixture(scope="module")
def config_only_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model's config and tokenizer, no weight file."""
    return _copy_without_weights(tiny_model_dir, tmp_path_factory.mktemp("tiny-config-only"))


def _params(loaded):
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def test_each_format_reads_the_same_weights(tiny_model_dir, pt_dir):
    ref = _params(load_model(str(tiny_model_dir), load_format="safetensors"))
    for path, fmt in ((tiny_model_dir, "auto"), (pt_dir, "pt"), (pt_dir, "auto")):
        got = _params(load_model(str(path), load_format=fmt))
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), (path, fmt)


def test_a_format_whose_files_are_missing_is_a_clear_error(tiny_model_dir, pt_dir, config_only_dir):
    with pytest.raises(ModelLoadError, match=r"model.load_format: 'pt' finds no PyTorch weight files"):
        load_model(str(tiny_model_dir), load_format="pt")
    with pytest.raises(ModelLoadError, match=r"model.load_format: 'safetensors' finds no \*.safetensors files"):
        load_model(str(pt_dir), load_format="safetensors")
    with pytest.raises(ModelLoadError, match=r"model.load_format: 'auto' finds no weight files .*model.load_format=dummy"):
        load_model(str(config_only_dir))
    with pytest.raises(ModelLoadError, match=r"model.load_format: 'gguf' needs model.path to be a .gguf file or a directory holding one"):
        load_model(str(tiny_model_dir), load_format="gguf")


def test_gguf_format_and_gguf_files(tmp_path):
    from specfw.model_loader import resolve_model_path

    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # never parsed: the checks come first
    with pytest.raises(ModelLoadError, match=r"model.load_format: 'safetensors' cannot read the GGUF file .*\['auto', 'gguf'\]"):
        resolve_model_path(str(tmp_path / "m.gguf"), load_format="safetensors")
    with pytest.raises(ModelLoadError, match="model.load_format: 'dummy' needs a model directory with config.json"):
        load_model(str(tmp_path / "m.gguf"), load_format="dummy")
    (tmp_path / "n.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="holds 2"):
        resolve_model_path(str(tmp_path), load_format="gguf")


def test_unknown_formats_name_the_key_and_the_allowed_values(tiny_model_dir):
    from specfw.config import validate
    from specfw_plugins.standalone.config import StandaloneConfig

    cfg = make_cfg(model_path=str(tiny_model_dir), model_load_format="npcache")
    with pytest.raises(ConfigError, match=r"model.load_format: 'npcache' is not one of \['auto', 'safetensors', 'pt', 'gguf', 'dummy'\]"):
        validate(cfg)
    cfg = make_cfg(model_path=str(tiny_model_dir), speculative=StandaloneConfig(algorithm="standalone", draft_load_format="gguf"))
    with pytest.raises(ConfigError, match=r"speculative.draft_load_format: 'gguf' is not one of \[None, 'auto', 'safetensors', 'pt', 'dummy'\]"):
        validate(cfg)


def test_dummy_reads_no_weight_file_and_is_the_same_in_every_load(tiny_model_dir, config_only_dir):
    a = _params(load_model(str(config_only_dir), load_format="dummy"))
    b = _params(load_model(str(tiny_model_dir), load_format="dummy"))  # weight files present, not read
    ckpt = _params(load_model(str(tiny_model_dir)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(float(v.abs().max()) <= 1e-3 for k, v in a.items() if "rotary" not in k)
    assert not torch.equal(a["embed_tokens.weight"], ckpt["embed_tokens.weight"])
    assert not torch.equal(a["layers.0.qkv_proj.weight"], a["layers.1.qkv_proj.weight"])  # seeded per parameter name


def test_dummy_serves_and_greedy_spec_equals_plain(config_only_dir):
    """Target and standalone draft both dummy (the draft inherits model.load_format) from the same
    config: the same seed gives the draft the target's weights, so its drafts are accepted."""
    from specfw.engine import Engine
    from specfw_plugins.standalone.config import StandaloneConfig

    path = str(config_only_dir)
    plain = [o.token_ids for o in Engine(make_cfg(model_path=path, model_load_format="dummy", max_total_tokens=2048)).generate(PROMPTS, GREEDY)]
    assert all(len(t) == GREEDY.max_new_tokens for t in plain)
    spec = StandaloneConfig(algorithm="standalone", draft_model_path=path, num_steps=3, topk=1)
    eng = Engine(make_cfg(model_path=path, model_load_format="dummy", max_total_tokens=2048, max_running_requests=4, speculative=spec))
    assert [eng.generate([p], GREEDY)[0].token_ids for p in PROMPTS] == plain
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain
    assert eng.stats.accepted_draft_tokens > 0


def test_draft_load_format_reads_the_draft_as_told(tiny_model_dir, tiny_draft_dir):
    from specfw.engine import Engine
    from specfw_plugins.standalone.config import StandaloneConfig

    spec = StandaloneConfig(algorithm="standalone", draft_model_path=str(tiny_draft_dir), num_steps=2, topk=1, draft_load_format="pt")
    with pytest.raises(ModelLoadError, match=r"speculative.draft_load_format: 'pt' finds no PyTorch weight files"):
        Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, speculative=spec))


# ---- trust_remote_code ------------------------------------------------------------------------
CUSTOM_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class ShoutingTokenizer(PreTrainedTokenizerFast):
    """The demo tokenizer, upper-casing what it decodes: proof that this file ran."""

    def decode(self, *args, **kwargs):
        return super().decode(*args, **kwargs).upper()
'''


@pytest.fixture(scope="module")
def remote_code_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer class of its own (``auto_map`` + a .py file)."""
    out = tmp_path_factory.mktemp("tiny-remote-code")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    (out / "tokenization_shouting.py").write_text(CUSTOM_TOKENIZER)
    raw = json.loads((out / "tokenizer_config.json").read_text())
    raw["auto_map"] = {"AutoTokenizer": [None, "tokenization_shouting.ShoutingTokenizer"]}
    raw["tokenizer_class"] = "ShoutingTokenizer"
    (out / "tokenizer_config.json").write_text(json.dumps(raw))
    return out


def test_shipped_tokenizer_code_is_refused_without_trust_remote_code(remote_code_dir):
    from specfw.engine import Engine

    with pytest.raises(ModelLoadError, match=r"model.trust_remote_code: .* ships its own code \(AutoTokenizer: tokenization_shouting.ShoutingTokenizer\)"):
        Engine(make_cfg(model_path=str(remote_code_dir), max_total_tokens=1024))


def test_trust_remote_code_runs_the_directorys_tokenizer(remote_code_dir, tiny_model_dir):
    from specfw.engine import Engine

    eng = Engine(make_cfg(model_path=str(remote_code_dir), model_trust_remote_code=True, max_total_tokens=1024))
    assert type(eng.tokenizer).__name__ == "ShoutingTokenizer"
    ids = eng.tokenizer.encode("hello world")
    assert eng.tokenizer.decode(ids) == "HELLO WORLD"
    plain = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=1024))  # specfw's model code runs the weights
    assert eng.generate(PROMPTS[:1], GREEDY)[0].token_ids == plain.generate(PROMPTS[:1], GREEDY)[0].token_ids


def test_eagle_drafts_read_pt_and_dummy(tiny_model_dir, tiny_eagle_drafts, tmp_path):
    """The trained tiny EAGLE head as a PyTorch pickle drafts exactly as its safetensors do; as
    dummy (EAGLE-3 too) it loads from its config alone and greedy output stays plain."""
    from specfw.engine import Engine
    from specfw_plugins.eagle.config import EagleConfig
    from specfw_plugins.eagle3.config import Eagle3Config

    src = tiny_eagle_drafts["eagle"]
    pt = _copy_without_weights(src, tmp_path / "eagle-pt")
    torch.save(load_state_dict(src, "safetensors"), pt / "pytorch_model.bin")
    e3 = _copy_without_weights(tiny_eagle_drafts["eagle3"], tmp_path / "e3")  # config only
    plain = [o.token_ids for o in Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048)).generate(PROMPTS, GREEDY)]
    runs = {}
    for name, spec in {
        "safetensors": EagleConfig(algorithm="eagle", draft_model_path=str(src), num_steps=3, topk=1, adaptive_draft="false"),
        "pt": EagleConfig(algorithm="eagle", draft_model_path=str(pt), num_steps=3, topk=1, adaptive_draft="false", draft_load_format="pt"),
        "dummy": EagleConfig(algorithm="eagle", draft_model_path=str(pt), num_steps=3, topk=1, adaptive_draft="false", draft_load_format="dummy"),
        "dummy3": Eagle3Config(algorithm="eagle3", draft_model_path=str(e3), num_steps=2, topk=1, draft_load_format="dummy"),
    }.items():
        eng = Engine(make_cfg(model_path=str(tiny_model_dir), max_total_tokens=2048, max_running_requests=4, speculative=spec))
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain, name
        runs[name] = (eng.stats.verify_forwards, eng.stats.accepted_draft_tokens)
    assert runs["pt"] == runs["safetensors"]

"""The plugin test kit: check an algorithm keeps specfw's contract from your own pytest.

    from specfw.testing import check_lossless

    def test_lossless():
        check_lossless("myalgo", {"num_steps": 4, "topk": 1})

``check_lossless`` runs greedy speculative decoding against plain greedy decoding on a tiny
random-init Llama (2 layers, hidden 64, the demo tokenizer; built once per process in a
temporary directory, no training), in float32 and bfloat16, one request at a time and four at
a time, and fails naming the dtype, the batch size and the first prompt whose tokens differ.
It takes seconds. A drafter with a model of its own takes ``draft_model_path`` in
``overrides`` (``tiny_model()`` gives a directory to derive one from).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

# Token-id prompts: repeated patterns (what copy-based drafters find) and plain sequences.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
    [1000, 20, 1000, 20, 1000],
    [9, 99, 999, 9999],
    [300, 301, 302, 303, 304, 300, 301, 302],
    [42] * 6,
    [7, 70, 700, 7, 70],
]

_TINY: Path | None = None


def tiny_model(out: str | Path | None = None, seed: int = 0) -> Path:
    """A 2-layer random Llama with the demo tokenizer, saved in the HF layout (cached per process
    when ``out`` is None). Its embeddings are scaled up so greedy paths are stable and varied."""
    global _TINY
    if out is None and _TINY is not None and (_TINY / "config.json").exists():
        return _TINY
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .demo_model import demo_model_dir

    path = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="specfw-tiny-"))
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    torch.random.set_rng_state(state)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(path)
    demo = demo_model_dir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo / f).exists():
            shutil.copy(demo / f, path / f)
    if out is None:
        import atexit

        atexit.register(shutil.rmtree, path, True)
        _TINY = path
    return path


@dataclass
class LosslessReport:
    """What ``check_lossless`` ran: per (dtype, batch size) the verify forwards and accepted draft tokens."""

    algorithm: str
    runs: dict = field(default_factory=dict)

    @property
    def accepted(self) -> int:
        return sum(r["accepted"] for r in self.runs.values())


def check_lossless(
    algorithm: str,
    overrides: dict | None = None,
    *,
    dtypes=("float32", "bfloat16"),
    batch_sizes=(1, 4),
    prompts: list | None = None,
    max_new_tokens: int = 24,
    model_dir: str | Path | None = None,
    require_accepts: bool = True,
    tp_size: int = 1,
) -> LosslessReport:
    """Assert greedy speculative output == plain greedy output for ``algorithm`` (a registered
    name) with ``overrides`` (keys of its config dataclass, e.g. ``{"num_steps": 4, "topk": 1}``).

    :param dtypes: model dtypes to run; :param batch_sizes: requests running at once;
    :param prompts: token-id lists or strings (default: ``PROMPTS``); :param model_dir: the target
        (default: ``tiny_model()``); :param require_accepts: also fail when no draft token was ever
        accepted (the contract would then hold vacuously).
    :returns: a ``LosslessReport``; raises ``AssertionError`` naming the first divergence.
    """
    from .config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from .engine import Engine
    from .plugins import plugin_manager
    from .sampling import SamplingParams

    algos = plugin_manager().algorithms
    if algorithm not in algos:
        raise AssertionError(
            f"'{algorithm}' is not registered (installed: {sorted(algos)}); is the package installed and its [project.entry-points.specfw] entry point right?"
        )
    spec = algos[algorithm].config_class(algorithm=algorithm, **(overrides or {}))
    spec.validate()
    spec.resolve_shape("LlamaForCausalLM")
    model = str(model_dir or tiny_model())
    prompts = prompts or PROMPTS
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    report = LosslessReport(algorithm)

    def engine(dtype, batch, speculative):
        return Engine(
            SpecfwConfig(
                model=ModelConfig(path=model, dtype=dtype, tp_size=tp_size),
                engine=EngineConfig(max_running_requests=batch, max_total_tokens=4096),
                speculative=speculative,
            )
        )

    for dtype in dtypes:
        with engine(dtype, 1, SpeculativeConfig()) as eng:
            plain = [o.token_ids for o in eng.generate(prompts, greedy)]
        for batch in batch_sizes:
            with engine(dtype, batch, spec) as eng:
                if batch == 1:
                    got = [eng.generate([p], greedy)[0].token_ids for p in prompts]
                else:
                    got = [o.token_ids for o in eng.generate(prompts, greedy)]
            for i, (a, b) in enumerate(zip(got, plain)):
                if a != b:
                    at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    raise AssertionError(
                        f"{algorithm} {overrides or {}}: {dtype}, batch {batch}: prompt {i} diverges "
                        f"from plain greedy at output token {at} ({a[at : at + 4]} vs {b[at : at + 4]})"
                    )
            report.runs[(dtype, batch)] = {"verify_forwards": eng.stats.verify_forwards, "accepted": eng.stats.accepted_draft_tokens}
    if require_accepts and report.accepted == 0:
        raise AssertionError(
            f"{algorithm}: no draft token was ever accepted, so the contract was not exercised "
            "(give prompts your drafter can predict, or require_accepts=False)"
        )
    return report

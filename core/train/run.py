"""``specfw train``: build the data, the teacher and the draft trainer, then run the loop."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..device import resolve_device

logger = logging.getLogger(__name__)


def make_trainer(cfg, teacher, examples):
    """The registered trainer of ``cfg.draft.kind`` (``specfw_register_trainers``)."""
    from ..plugins import plugin_manager

    trainers = plugin_manager().trainers
    if cfg.draft.kind not in trainers:
        from ..config import ConfigError

        raise ConfigError("draft.kind", f"'{cfg.draft.kind}' is not a registered trainer; installed: {sorted(trainers)}")
    return trainers[cfg.draft.kind].factory(cfg, teacher, examples)


def init_from_draft(trainer, cfg) -> None:
    """Load the weights of ``cfg.init_draft`` (a draft directory, or "demo": the committed draft
    the kind's trainer registered) into the fresh trainer; a resumed checkpoint still takes precedence."""
    from safetensors.torch import load_file

    from ..plugins import plugin_manager

    path = Path(cfg.init_draft)
    if cfg.init_draft == "demo":
        path = plugin_manager().trainers[cfg.draft.kind].demo_draft
        if path is None:
            from ..config import ConfigError

            raise ConfigError("init_draft", f"there is no committed demo draft of kind '{cfg.draft.kind}'; give a directory")
        path = Path(path)
    from ..committed_drafts import committed_draft

    path = committed_draft(path)
    trainer.init_from(load_file(str(path / "model.safetensors")))
    logger.info("initialised the %s draft from %s", cfg.draft.kind, path)


def run_training(cfg) -> Path:
    from omegaconf import OmegaConf
    from ..config import EngineConfig, ModelConfig, SpecfwConfig, SpeculativeConfig
    from ..demo_model import cache_dir
    from ..engine import Engine
    from ..model_loader import resolve_model_path
    from .data import batches, build_examples, load_prompts
    from .target import TargetTeacher

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(str(cfg.device), key="device")
    logger.info("training on %s", device)
    target_dir = resolve_model_path(cfg.model.path, cfg.model.revision)
    d = cfg.data
    items = load_prompts(str(getattr(d.source, "value", d.source)), d.jsonl, d.num_prompts, d.seed, str(getattr(d.turns, "value", d.turns)))
    responses = str(getattr(d.responses, "value", d.responses))
    engine, cache = None, None
    if responses in ("target", "mixed"):
        regen_dtype = str(getattr(d.regen_dtype, "value", d.regen_dtype))
        cache = Path(d.cache_dir) if d.cache_dir else cache_dir() / "train" / target_dir.name
        cache = cache / f"responses-{regen_dtype}.jsonl"
        if device.type == "cuda":
            from .hf_regen import HFGenerator

            engine = HFGenerator(target_dir, getattr(torch, regen_dtype), device)
        else:
            engine = Engine(
                SpecfwConfig(
                    model=ModelConfig(path=cfg.model.path, dtype=regen_dtype, device=str(device)),
                    engine=EngineConfig(max_running_requests=d.regen_batch, num_threads=cfg.num_threads),
                    speculative=SpeculativeConfig(),
                )
            )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    examples = build_examples(tok, items, responses, engine, cache, d.max_len, d.max_new_tokens, d.num_onpolicy, d.regen_batch)
    del engine
    logger.info("%d training sequences, %d tokens", len(examples), sum(len(e.input_ids) for e in examples))
    teacher = TargetTeacher(target_dir, getattr(torch, str(getattr(cfg.target_dtype, "value", cfg.target_dtype))), device)
    trainer = make_trainer(cfg, teacher, examples)
    if cfg.init_draft:
        init_from_draft(trainer, cfg)
    from .loop import train

    out = Path(cfg.output_dir)
    (out).mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text(OmegaConf.to_yaml(cfg))
    final = train(cfg, trainer, lambda start: batches(examples, cfg.batch_size, cfg.seed, start), out, device)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if kind_needs_tokenizer(cfg) and (target_dir / f).exists():
            (final / f).write_bytes((target_dir / f).read_bytes())
    print(f"draft written to {final} (loss plot: {out / 'loss.png'})")
    return final


def kind_needs_tokenizer(cfg) -> bool:
    from ..plugins import plugin_manager

    return plugin_manager().trainers[cfg.draft.kind].copy_tokenizer

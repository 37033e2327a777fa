"""Prompt sets for ``specfw bench`` / ``specfw tune``: chat contexts or raw completion texts."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError


@dataclass(frozen=True)
class BenchPrompt:
    """One request: ``messages`` (chat template / ``/v1/chat/completions``) or ``text`` (raw
    completion / ``/v1/completions``, e.g. HumanEval's function stubs)."""

    messages: tuple | None = None
    text: str | None = None


def load_prompts(ps, key: str = "bench.prompts") -> list[BenchPrompt]:
    """``ps.num_prompts`` prompts of ``ps.dataset`` from ``ps.start`` on; fewer available is an
    error naming ``<key>.num_prompts``."""
    from .. import datasets

    end = ps.start + ps.num_prompts
    if ps.dataset == "mtbench":
        items = [BenchPrompt(messages=({"role": "user", "content": q},)) for q in datasets.mtbench_first_turns(end)]
    elif ps.dataset == "humaneval":
        items = [BenchPrompt(text=p) for p in datasets.humaneval_prompts(end)]
    elif ps.dataset == "sharegpt":
        items = [BenchPrompt(messages=(c[0],)) for c in datasets.sharegpt_conversations(end)]
    else:
        items = [BenchPrompt(messages=tuple(m)) for m in datasets.jsonl_messages(ps.path)[:end]]
    items = items[ps.start : end]
    if len(items) < ps.num_prompts:
        raise ConfigError(f"{key}.num_prompts", f"{ps.dataset} has {len(items)} prompts from start={ps.start} on, fewer than {ps.num_prompts}")
    return items


def token_ids(engine, prompts: list[BenchPrompt]) -> list[list[int]]:
    """The prompts as the engine's token ids (chat template for chat contexts)."""
    return [engine.tokenize_chat(list(p.messages)) if p.messages else engine.tokenizer(p.text)["input_ids"] for p in prompts]

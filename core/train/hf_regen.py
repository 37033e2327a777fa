"""Batched greedy regeneration with Hugging Face ``generate`` on a GPU.

specfw's own engine is the CPU path; on a CUDA device ``specfw train`` regenerates on-policy
responses with this instead (left-padded batches, greedy, stop at eos). It offers the two methods
``data.regenerate`` uses: ``tokenize_chat`` and ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generated:
    token_ids: list[int]


class HFGenerator:
    def __init__(self, model_dir, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

    def tokenize_chat(self, messages: list[dict]) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params) -> list[Generated]:
        S = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), S), self.pad, dtype=torch.long)
        attn = torch.zeros(len(prompts), S, dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at column S-1
            ids[i, S - len(p) :] = torch.tensor(p)
            attn[i, S - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attn.to(self.device),
            max_new_tokens=params.max_new_tokens,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        results = []
        for row in out[:, S:].tolist():
            if self.eos in row:
                row = row[: row.index(self.eos) + 1]  # keep the eos, as the engine does
            results.append(Generated(row))
        return results

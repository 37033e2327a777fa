"""Standalone draft distillation: a narrow Llama (same tokenizer) trained with KL(target ‖ draft)
on every response position. Embeddings start from the target's, projected onto their top
principal directions (tied lm_head), so the narrow model starts with the target's vocabulary
geometry."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfw.sdk import ModuleTrainer, load_matching


class StandaloneTrainer(ModuleTrainer):
    def __init__(self, cfg, teacher, examples):
        from transformers import LlamaConfig, LlamaForCausalLM

        t, d = teacher.config, cfg.draft
        self.cfg = LlamaConfig(
            vocab_size=t.vocab_size,
            hidden_size=d.hidden_size,
            intermediate_size=d.intermediate_size,
            num_hidden_layers=d.num_layers,
            num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads,
            max_position_embeddings=t.max_position_embeddings,
            rms_norm_eps=t.rms_norm_eps,
            rope_parameters=dict(t.rope_parameters),
            tie_word_embeddings=True,
            bos_token_id=t.bos_token_id,
            eos_token_id=t.eos_token_id,
            pad_token_id=t.pad_token_id,
        )
        self.cfg.architectures = ["LlamaForCausalLM"]
        self.model = LlamaForCausalLM(self.cfg).float().to(teacher.device)
        with torch.no_grad():
            E = teacher.embed.weight.float()
            _, _, V = torch.linalg.svd(E - E.mean(0), full_matrices=False)
            proj = E @ V[: d.hidden_size].T
            self.model.model.embed_tokens.weight.copy_(proj / proj.std() * 0.02 * 20)
        self.teacher, self.temp = teacher, d.temperature

    @property
    def module(self):
        return self.model

    def init_from(self, sd: dict) -> None:
        """Start from a standalone draft of the same shape (lm_head tied to the embeddings)."""
        sd = dict(sd)
        sd.setdefault("lm_head.weight", sd.get("model.embed_tokens.weight"))
        load_matching(self.model, sd)

    def loss(self, ids, mask, valid):
        _, tlogits = self.teacher(ids, valid)
        logits = self.model(input_ids=ids, attention_mask=valid.long()).logits
        m = (mask * valid)[:, 1:]
        logp = torch.log_softmax(logits[:, :-1].float() / self.temp, -1)
        tgt = torch.softmax(tlogits[:, :-1].float() / self.temp, -1)
        kl = (tgt * (torch.log(tgt + 1e-9) - logp)).sum(-1)
        loss = (kl * m).sum() / m.sum().clamp_min(1)
        agree = (logits[:, :-1].argmax(-1) == tlogits[:, :-1].argmax(-1)).float()
        return loss, {"loss": float(loss.detach()), "acc0": float((agree * m).sum() / m.sum().clamp_min(1))}

    def export(self, out: Path, dtype: torch.dtype) -> Path:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        sd = {k: v.to(dtype).contiguous() for k, v in self.model.state_dict().items() if k != "lm_head.weight"}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.cfg.to_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        return out

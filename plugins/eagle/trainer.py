"""EAGLE-1/2 head training: fc over [embedding, feature] + one decoder layer (no input norm);
loss = feature_weight * SmoothL1(predicted feature, next target feature)
     + token_weight * CE(target lm_head(predicted feature), target's distribution);
uniform noise on the input features. Features are the target's final (post-norm) hidden states.
Pair i = (t_{i+1}, f_i) at position i predicts f_{i+1} (and so token t_{i+2})."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specfw.sdk import ModuleTrainer, Rotary, load_matching
from specfw_plugins.eagle3.trainer import head_config


class EagleTrainer(ModuleTrainer):
    def __init__(self, cfg, teacher, examples):
        from .model import EagleHead

        tcfg = teacher.config
        self.hcfg = head_config(tcfg, tcfg.vocab_size, (1,), cfg.data.max_len + 8)
        for k in ("draft_vocab_size", "target_hidden_size", "eagle_config"):
            delattr(self.hcfg, k)
        self.head = EagleHead(self.hcfg, bias=True).float().to(teacher.device)
        self.rotary = Rotary(self.hcfg, self.hcfg.max_position_embeddings, torch.float32).to(teacher.device)
        self.teacher, self.d = teacher, cfg.draft

    @property
    def module(self):
        return self.head

    def init_from(self, sd: dict) -> None:
        """Start from a published EAGLE draft (``fc``, ``layers.0``)."""
        load_matching(self.head, sd)

    def loss(self, ids, mask, valid):
        hs, logits = self.teacher(ids, valid)
        feat = hs[-1].float()  # final post-norm hidden states
        B, S = ids.shape
        n = S - 2
        f_in = feat[:, :n]
        f_in = f_in + (torch.rand_like(f_in) - 0.5) * self.d.noise_std
        x = self.head.fc(torch.cat([self.teacher.embed(ids[:, 1 : 1 + n]).float(), f_in], -1))
        pos = torch.arange(n, device=ids.device).expand(B, n)
        out = self.head.layers[0].forward_dense(x, x, pos, self.rotary)
        m = (mask[:, 2 : 2 + n] * valid[:, 2 : 2 + n]).unsqueeze(-1)
        denom = m.sum().clamp_min(1)
        feat_loss = (F.smooth_l1_loss(out, feat[:, 1 : 1 + n], reduction="none").mean(-1, keepdim=True) * m).sum() / denom
        logp = torch.log_softmax(self.teacher.lm_head(out.to(self.teacher.lm_head.weight.dtype)).float(), -1)
        tgt = torch.softmax(logits[:, 1 : 1 + n].float(), -1)
        tok_loss = (-(tgt * logp).sum(-1, keepdim=True) * m).sum() / denom
        total = self.d.feature_weight * feat_loss + self.d.token_weight * tok_loss
        agree = (logp.argmax(-1) == logits[:, 1 : 1 + n].argmax(-1)).float().unsqueeze(-1)
        return total, {
            "loss": float(total.detach()),
            "feat": float(feat_loss.detach()),
            "ce": float(tok_loss.detach()),
            "acc0": float((agree * m).sum() / denom),
        }

    def export(self, out: Path, dtype: torch.dtype) -> Path:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        sd = {k: v.to(dtype).contiguous() for k, v in self.head.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.hcfg.to_dict()
        cfg.update(architectures=["LlamaForCausalLMEagle"], model_type="llama", torch_dtype=str(dtype).removeprefix("torch."))
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        return out

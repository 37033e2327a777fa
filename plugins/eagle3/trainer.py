"""EAGLE-3 head training: fused low/mid/high target features, draft vocabulary by token
frequency (``d2t``/``t2d``), training-time test unrolled over ``ttt_steps``, soft cross-entropy
against the target distribution restricted to the draft vocabulary, step weights decay**j.

Pair i = (token t_{i+1}, feature f_i) at position i predicts t_{i+2} (the inference convention of
``specfw.speculative.feature_drafter``). Unroll step j feeds, for origin i, token t_{i+1+j} with the
head's own output hidden of step j-1; it attends to the real pairs of origins <= i and to its own
earlier unroll steps (the diagonal), exactly what a depth-j draft node sees at inference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfw.sdk import ModuleTrainer, Rotary, load_matching, unroll, unrolled_layer_step


def draft_vocab_by_frequency(examples, vocab_size: int, k: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor(e.input_ids)
        counts += torch.bincount(ids, minlength=vocab_size)
    k = min(k, vocab_size)
    return torch.sort(torch.topk(counts, k).indices).values


def head_config(tcfg, draft_vocab: int, aux_layers, max_pos: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=tcfg.num_key_value_heads,
        head_dim=getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads,
        rms_norm_eps=tcfg.rms_norm_eps,
        vocab_size=tcfg.vocab_size,
        num_hidden_layers=1,
        max_position_embeddings=max(max_pos, tcfg.max_position_embeddings),
        rope_parameters=dict(tcfg.rope_parameters),
        tie_word_embeddings=False,
    )
    cfg.draft_vocab_size = draft_vocab
    cfg.target_hidden_size = tcfg.hidden_size
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in aux_layers]}
    return cfg


class Eagle3Trainer(ModuleTrainer):
    def __init__(self, cfg, teacher, examples):
        from .model import Eagle3Head

        tcfg = teacher.config
        L = tcfg.num_hidden_layers
        self.aux_layers = tuple(cfg.draft.aux_layers or (2, L // 2, L - 3))
        self.draft_ids = draft_vocab_by_frequency(examples, tcfg.vocab_size, cfg.draft.draft_vocab_size)
        self.hcfg = head_config(tcfg, len(self.draft_ids), self.aux_layers, cfg.data.max_len + cfg.draft.ttt_steps + 8)
        self.head = Eagle3Head(self.hcfg, tcfg.hidden_size, tcfg.vocab_size).float()
        with torch.no_grad():  # start from the target's own head restricted to the draft vocabulary
            self.head.lm_head.weight.copy_(teacher.lm_head.weight[self.draft_ids].float())
            self.head.norm.weight.copy_(teacher.norm.weight.float())
            self.head.d2t.copy_(self.draft_ids - torch.arange(len(self.draft_ids)))
            self.head.t2d.zero_()
            self.head.t2d[self.draft_ids] = True
        dev = teacher.device
        self.head.to(dev)
        self.draft_ids = self.draft_ids.to(dev)
        self.rotary = Rotary(self.hcfg, self.hcfg.max_position_embeddings, torch.float32).to(dev)
        self.teacher, self.ttt, self.decay = teacher, cfg.draft.ttt_steps, cfg.draft.ttt_decay

    @property
    def module(self):
        return self.head

    def init_from(self, sd: dict) -> None:
        """Start from a published EAGLE-3 draft: its weights and its draft vocabulary (``d2t``)."""
        from specfw.sdk import ConfigError

        d2t = sd["d2t"].long()
        if len(d2t) != len(self.draft_ids):
            raise ConfigError("draft.draft_vocab_size", f"init_draft has a {len(d2t)}-token draft vocabulary; set draft.draft_vocab_size={len(d2t)}")
        self.draft_ids = (d2t + torch.arange(len(d2t))).to(self.draft_ids.device)
        load_matching(self.head, sd)

    def loss(self, ids, mask, valid):
        hs, logits = self.teacher(ids, valid)
        aux = torch.cat([hs[a] for a in self.aux_layers], -1).float()
        embeds = self.teacher.embed(ids).float()
        tgt = torch.softmax(logits[..., self.draft_ids].float(), -1)
        tgt_top = logits.argmax(-1)
        in_vocab = self.head.t2d[tgt_top]
        layer, head = self.head.midlayer, self.head
        S = ids.shape[1]

        def step(j, n, hid):
            x = layer.attn_input(embeds[:, 1 + j : 1 + j + n], hid)
            h = unrolled_layer_step(layer, x, hid, j, ks, vs, self.rotary)
            logp = torch.log_softmax(head.lm_head(head.norm(h)), -1)
            m = mask[:, 2 + j : 2 + j + n] * valid[:, 2 + j : 2 + j + n]
            lj = (-(tgt[:, 1 + j : 1 + j + n] * logp).sum(-1) * m).sum() / m.sum().clamp_min(1)
            agree = (self.draft_ids[logp.argmax(-1)] == tgt_top[:, 1 + j : 1 + j + n]) & in_vocab[:, 1 + j : 1 + j + n]
            return h, lj, float((agree.float() * m).sum() / m.sum().clamp_min(1))

        ks, vs = [], []
        return unroll(head.fc(aux)[:, : S - 2], self.ttt, self.decay, step)

    def export(self, out: Path, dtype: torch.dtype) -> Path:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.head.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.hcfg.to_dict()
        cfg.update(
            architectures=["LlamaForCausalLMEagle3"],
            model_type="llama",
            draft_vocab_size=len(self.draft_ids),
            target_hidden_size=self.hcfg.target_hidden_size,
            eagle_config=self.hcfg.eagle_config,
            torch_dtype=str(dtype).removeprefix("torch."),
        )
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        return out

"""MTP / NextN layer training for a target that has none: one DeepSeek-V3-style NextN layer
(``enorm``, ``hnorm``, ``eh_proj``, a decoder layer, ``shared_head.norm``; the target's embeddings
and lm_head) trained with soft cross-entropy against the target's next-next-token distribution.

Pair i = (token t_{i+1}, the target's final post-norm hidden f_i) predicts t_{i+2}, the inference
convention of ``specfw_plugins.mtp``; with ``ttt_steps > 1`` the layer is also trained on its own
outputs, as the drafter reuses it for deeper chain steps (EAGLE-3's training-time test). The decoder layer starts as a copy of the target's last
layer and the output norm as the target's final norm. The export is a NextN-only checkpoint:
the layer's tensors under ``model.layers.{num_hidden_layers}.`` plus the target's config with
``num_nextn_predict_layers: 1`` (the layout SGLang reads for DeepSeek NextN drafts), which
``speculative=mtp speculative.draft_model_path=DIR`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specfw.sdk import ModuleTrainer, Rotary, load_matching, unroll, unrolled_layer_step


class MtpTrainer(ModuleTrainer):
    def __init__(self, cfg, teacher, examples):
        from transformers import LlamaConfig
        from .model import DEEPSEEK, MtpHead

        t = teacher.config
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "rope_parameters")
        self.hcfg = LlamaConfig(
            **{k: getattr(t, k) for k in keys if getattr(t, k, None) is not None}, max_position_embeddings=max(cfg.data.max_len + 8, t.max_position_embeddings)
        )
        bias = bool(getattr(t, "attention_bias", False)) or getattr(t, "model_type", "") == "qwen2"
        self.head = MtpHead(self.hcfg, DEEPSEEK, has_head=False, attn_bias=bias).float()
        last = teacher.model.model.layers[-1]
        with torch.no_grad():
            for name, p in self.head.layer.named_parameters():
                if name.startswith("self_attn.") or name.startswith("mlp.") or name.startswith("post_attention"):
                    p.copy_(last.get_parameter(name).float())
            self.head.input_layernorm.weight.copy_(last.input_layernorm.weight.float())
            self.head.final_norm.weight.copy_(teacher.norm.weight.float())
        self.head.to(teacher.device)
        self.rotary = Rotary(self.hcfg, self.hcfg.max_position_embeddings, torch.float32).to(teacher.device)
        self.teacher = teacher
        self.num_layers = t.num_hidden_layers
        self.ttt, self.decay = cfg.draft.ttt_steps, cfg.draft.ttt_decay

    @property
    def module(self):
        return self.head

    def init_from(self, sd: dict) -> None:
        """Start from a NextN checkpoint of this layout (as exported below)."""
        from .model import _names, find_mtp_layers

        layers = find_mtp_layers(sd, self.num_layers)
        if not layers:
            from specfw.sdk import ConfigError

            raise ConfigError("init_draft", "the checkpoint has no NextN layer (model.layers.{num_hidden_layers}.eh_proj)")
        layout, prefix = layers[min(layers)]
        names = _names(layout, prefix, self.head.layer.self_attn.q_proj.bias is not None)
        load_matching(self.head, {own: sd[name] for own, name in names.items() if name in sd})

    def loss(self, ids, mask, valid):
        """Unroll step j feeds, for origin i, token t_{i+1+j} with the layer's own output of step j-1
        (the target's feature at j = 0) and predicts t_{i+2+j}: what a depth-j chain node sees."""
        hs, logits = self.teacher(ids, valid)
        feat = hs[-1].float()  # final post-norm hidden states
        embeds = self.teacher.embed(ids).float()
        tgt = torch.softmax(logits.float(), -1)
        tgt_top = logits.argmax(-1)
        w = self.teacher.lm_head.weight
        S = ids.shape[1]

        def step(j, n, hid):
            x = self.head.fuse(embeds[:, 1 + j : 1 + j + n], hid)
            h = unrolled_layer_step(self.head.layer, self.head.input_layernorm(x), x, j, ks, vs, self.rotary)
            logp = torch.log_softmax((self.head.final_norm(h).to(w.dtype) @ w.T).float(), -1)
            m = mask[:, 2 + j : 2 + j + n] * valid[:, 2 + j : 2 + j + n]
            denom = m.sum().clamp_min(1)
            lj = (-(tgt[:, 1 + j : 1 + j + n] * logp).sum(-1) * m).sum() / denom
            agree = (logp.argmax(-1) == tgt_top[:, 1 + j : 1 + j + n]).float()
            return h, lj, float((agree * m).sum() / denom)

        ks, vs = [], []
        return unroll(feat[:, : S - 2], self.ttt, self.decay, step)

    def export(self, out: Path, dtype: torch.dtype) -> Path:
        from safetensors.torch import save_file
        from .model import DEEPSEEK, _names

        out.mkdir(parents=True, exist_ok=True)
        names = _names(DEEPSEEK, f"model.layers.{self.num_layers}.", self.head.layer.self_attn.q_proj.bias is not None)
        sd = {names[k]: v.to(dtype).contiguous() for k, v in self.head.state_dict().items()}
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = self.teacher.config.to_dict()
        cfg.update(num_nextn_predict_layers=1, torch_dtype=str(dtype).removeprefix("torch."))
        (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        return out

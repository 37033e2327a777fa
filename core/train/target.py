"""Teacher-forced target forward for training: hidden states (layer inputs) and logits."""

from __future__ import annotations

import torch


class TargetTeacher:
    def __init__(self, model_dir, dtype: torch.dtype, device: torch.device | str = "cpu"):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        self.device = torch.device(device)
        self.config = self.model.config
        self.embed = self.model.get_input_embeddings()
        self.lm_head = self.model.get_output_embeddings()
        self.norm = self.model.model.norm

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, valid: torch.Tensor):
        """Returns (hidden_states tuple: [0]=embeddings, [i]=input of layer i, [-1]=final post-norm; logits fp32)."""
        out = self.model(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True, use_cache=False)
        return out.hidden_states, out.logits

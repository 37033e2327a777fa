"""What every draft trainer shares: the trained module's parameters and state, and loading a
published draft into it (``init_draft``)."""

from __future__ import annotations

import torch

from ..models.llama import Rotary


def load_matching(module: torch.nn.Module, sd: dict) -> None:
    """Load ``sd`` into ``module`` (cast to each parameter's dtype); every tensor must be present with
    its shape, else a ConfigError naming ``init_draft`` and the first mismatch."""
    from ..config import ConfigError

    own = module.state_dict()
    for k, v in own.items():
        if k not in sd:
            raise ConfigError("init_draft", f"the draft has no tensor '{k}' (is it a draft of this kind?)")
        if tuple(sd[k].shape) != tuple(v.shape):
            raise ConfigError("init_draft", f"tensor '{k}' has shape {tuple(sd[k].shape)}, this draft config needs {tuple(v.shape)}")
    module.load_state_dict({k: sd[k].to(v.dtype) for k, v in own.items()})


class ModuleTrainer:
    """Base of the draft trainers: ``self.module`` is what the optimizer trains and checkpoints hold."""

    module: torch.nn.Module

    def parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_dict(self):
        return self.module.state_dict()

    def load_state_dict(self, sd):
        self.module.load_state_dict(sd)


def _ttt_attention(layer, q, ks, vs):
    """q [B,H,n,D]; ks[0]/vs[0] [B,Hkv,S0,D] the real pairs (causal by origin); ks[j>0] [B,Hkv,>=n,D]
    the origin's own earlier unroll steps (one key each: the diagonal)."""
    rep = layer.n_heads // layer.n_kv
    k0, v0 = ks[0].repeat_interleave(rep, 1), vs[0].repeat_interleave(rep, 1)
    n, S0 = q.shape[2], k0.shape[2]
    s0 = (q @ k0.transpose(-1, -2)) * layer.scale
    causal = torch.ones(n, S0, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * k[:, :, :n].repeat_interleave(rep, 1)).sum(-1) * layer.scale).unsqueeze(-1) for k in ks[1:]]
    w = torch.softmax(torch.cat([s0] + diag, -1), -1)
    out = w[..., :S0] @ v0
    for j, v in enumerate(vs[1:]):
        out = out + w[..., S0 + j : S0 + j + 1] * v[:, :, :n].repeat_interleave(rep, 1)
    return out


def unrolled_layer_step(layer, attn_in: torch.Tensor, residual: torch.Tensor, j: int, ks: list, vs: list, rotary: Rotary) -> torch.Tensor:
    """Unroll step ``j`` of training-time test through a DraftDecoderLayer: ``attn_in`` [B, n, *] at
    rope positions j..j+n-1 attends to the real pairs of origins <= i and to its own earlier steps
    (``ks``/``vs`` grow by this step's keys), exactly what a depth-j draft node sees at inference."""
    B, n, _ = attn_in.shape
    pos = torch.arange(j, j + n, device=attn_in.device)
    cos, sin = rotary.cos[pos][None, :, None], rotary.sin[pos][None, :, None]
    q = Rotary.apply(layer.self_attn.q_proj(attn_in).view(B, n, layer.n_heads, -1), cos, sin).transpose(1, 2)
    k = Rotary.apply(layer.self_attn.k_proj(attn_in).view(B, n, layer.n_kv, -1), cos, sin).transpose(1, 2)
    v = layer.self_attn.v_proj(attn_in).view(B, n, layer.n_kv, -1).transpose(1, 2)
    ks.append(k)
    vs.append(v)
    o = _ttt_attention(layer, q, ks, vs).transpose(1, 2).reshape(B, n, -1)
    h = residual + layer.self_attn.o_proj(o)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def unroll(first_hidden: torch.Tensor, steps: int, decay: float, step) -> tuple[torch.Tensor, dict]:
    """The training-time-test loop: origins 0..n-1 (n = first_hidden's length) go ``steps`` deep; step
    j runs ``step(j, n_j, hidden)`` on the n_j = n - j origins that still have a target token, with
    the previous step's output hidden (``first_hidden`` at j = 0), and returns (output hidden,
    loss_j, top-1 agreement_j). Loss = sum decay**j * loss_j."""
    total, metrics, hid = 0.0, {}, first_hidden
    for j in range(steps):
        n = first_hidden.shape[1] - j
        if n <= 0:
            break
        hid, lj, acc = step(j, n, hid[:, :n])
        total = total + (decay**j) * lj
        metrics[f"acc{j}"] = acc
    metrics["loss"] = float(total.detach())
    return total, metrics

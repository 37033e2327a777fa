"""One Llama decoder layer for EAGLE-family draft heads, with checkpoint-compatible names
(``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``post_attention_layernorm``) and a
configurable attention input width (EAGLE-3 feeds ``2H``: embedding and feature side by side).
Runs over a one-layer KV pool with specfw's attention (tree masks included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..backends import HeadShape
from ..forward_batch import ForwardBatch
from ..kv_cache import KVPool
from .llama import RMSNorm, Rotary, default_backend


class _Attn(nn.Module):
    def __init__(self, in_dim: int, hidden: int, n_heads: int, n_kv: int, head_dim: int, bias: bool = False):
        super().__init__()
        self.q_proj = nn.Linear(in_dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, n_kv * head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, n_kv * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=False)


class _MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg, in_dim: int | None = None, attn_bias: bool = False):
        super().__init__()
        h = cfg.hidden_size
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.n_heads
        self.self_attn = _Attn(in_dim or h, h, self.n_heads, self.n_kv, self.head_dim, attn_bias)  # bias: Qwen2-style q/k/v
        self.mlp = _MLP(h, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.backend = None  # the target runner's kernel backend (ModelRunner.prepare hands it over)
        self.qkv_fused: nn.Linear | None = None  # inference copies of q/k/v and gate/up in one
        self.gate_up_fused: nn.Linear | None = None  # linear each (fuse_projections)

    def fuse_projections(self) -> None:
        """Inference only: q/k/v and gate/up as one linear each (half the kernel calls per draft
        step; the checkpoint-named layers stay for training and saving). Called by the backend's
        ``prepare_module`` before it swaps in its kernels."""
        a, m = self.self_attn, self.mlp
        with torch.no_grad():
            qkv = nn.Linear(
                a.q_proj.in_features,
                a.q_proj.out_features + 2 * a.k_proj.out_features,
                bias=a.q_proj.bias is not None,
                device=a.q_proj.weight.device,
                dtype=a.q_proj.weight.dtype,
            )
            qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            if a.q_proj.bias is not None:
                qkv.bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            gate_up = nn.Linear(
                m.gate_proj.in_features, 2 * m.gate_proj.out_features, bias=False, device=m.gate_proj.weight.device, dtype=m.gate_proj.weight.dtype
            )
            gate_up.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        self.qkv_fused, self.gate_up_fused = qkv.requires_grad_(False), gate_up.requires_grad_(False)

    def norm_rows(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` for a head's own norms (around this layer: EAGLE-3's input and hidden norms,
        the final norm), one call of the backend's fused op where it has one (a draft only
        proposes: its bits need not match torch's)."""
        return norm.rows(x, self.backend.fused_ops(x.dtype, self.mlp.gate_proj.out_features) if self.backend else None)

    def forward(self, attn_in: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch, kv: KVPool, rotary: Rotary) -> torch.Tensor:
        """attn_in [T, in_dim] feeds q/k/v; residual [T, H] is added to the attention output."""
        T = attn_in.shape[0]
        ops = self.backend.fused_ops(attn_in.dtype, self.mlp.gate_proj.out_features) if self.backend else None
        if ops is not None and self.qkv_fused is not None:
            return self._forward_fused(attn_in, residual, fb, kv, rotary, ops)
        cos, sin = rotary.lookup(fb.positions)
        q = Rotary.apply(self.self_attn.q_proj(attn_in).view(T, self.n_heads, self.head_dim), cos, sin)
        k = Rotary.apply(self.self_attn.k_proj(attn_in).view(T, self.n_kv, self.head_dim), cos, sin)
        v = self.self_attn.v_proj(attn_in).view(T, self.n_kv, self.head_dim)
        kv.write(0, fb.out_slots, k, v)
        if fb.attn_plan is None:  # draft heads need no exact plans (they propose, never emit)
            backend = self.backend or default_backend(attn_in.device)
            fb.attn_plan = backend.plan_attention(fb.seqs, attn_in.device, HeadShape(q.dtype, self.n_heads, self.n_kv, self.head_dim), exact=False)
        o = fb.attn_plan(q, kv.k[0], kv.v[0], self.scale)
        x = residual + self.self_attn.o_proj(o.reshape(T, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def _forward_fused(self, attn_in, residual, fb: ForwardBatch, kv: KVPool, rotary: Rotary, ops) -> torch.Tensor:
        """``forward`` on the fused projections and the backend's fused glue (rope + KV write,
        residual add + norm, silu * up): ~6 calls instead of ~25."""
        T = attn_in.shape[0]
        if fb.attn_plan is None:
            fb.attn_plan = self.backend.plan_attention(fb.seqs, attn_in.device, HeadShape(attn_in.dtype, self.n_heads, self.n_kv, self.head_dim), exact=False)
        one_call = self.backend.draft_layer(self)  # the whole layer in one kernel call where the backend has one
        if one_call is not None and one_call.accepts(fb.attn_plan, T):
            return one_call(attn_in, residual, fb, kv, rotary)
        cos, sin = rotary.lookup(fb.positions)
        q = ops.rope_write(self.qkv_fused(attn_in), cos, sin, kv.k[0], kv.v[0], fb.out_slots, self.n_heads, self.n_kv)
        x, h = ops.add_rms_norm(
            residual.contiguous(),
            self.self_attn.o_proj(fb.attn_plan(q, kv.k[0], kv.v[0], self.scale).reshape(T, -1)),
            self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps,
        )
        return x + self.mlp.down_proj(ops.silu_mul(self.gate_up_fused(h)))

    def forward_dense(
        self, attn_in: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, rotary: Rotary, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training path: [B, S, *] batches, causal (or ``attn_mask`` [B|1, 1, S, S_kv]) attention,
        no KV pool. ``positions`` [B, S]."""
        B, S, _ = attn_in.shape
        cos, sin = rotary.cos[positions].unsqueeze(2), rotary.sin[positions].unsqueeze(2)
        q = Rotary.apply(self.self_attn.q_proj(attn_in).view(B, S, self.n_heads, self.head_dim), cos, sin)
        k = Rotary.apply(self.self_attn.k_proj(attn_in).view(B, S, self.n_kv, self.head_dim), cos, sin)
        v = self.self_attn.v_proj(attn_in).view(B, S, self.n_kv, self.head_dim)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            is_causal=attn_mask is None,
            scale=self.scale,
            enable_gqa=self.n_kv != self.n_heads,
        )
        x = residual + self.self_attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        return x + self.mlp(self.post_attention_layernorm(x))

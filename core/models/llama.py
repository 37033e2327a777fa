"""A lean Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over specfw's KV pool.

Fused QKV and gate/up projections, one attention call per layer for the whole ragged batch,
tree masks for speculative verification, and optional capture of inner hidden states
(EAGLE-3 taps). Numerics follow transformers' LlamaForCausalLM (fp32 RMSNorm, same RoPE).
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from ..backends import HeadShape
from ..forward_batch import ForwardBatch, ForwardOutput
from ..kv_cache import KVPool


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, bitwise equal to the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # HF's formula (upcast, x * rsqrt(mean(x^2) + eps), cast back, times weight) with its fp32
        # part as the fused op: bitwise the same (tests/unit/test_model_runner.py), and cheaper per call
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def rows(self, x: torch.Tensor, ops) -> torch.Tensor:
        """This norm of ``x``'s rows as one call of a backend's fused ``add_rms_norm`` (``ops``, from
        ``Backend.fused_ops``; None or not 2-d: the torch op above). The decoder layers' norms are
        that kernel's too; torch's op costs ~10 us warm, more right after a forward's weight stream."""
        if ops is None or x.dim() != 2:
            return self(x)
        return ops.add_rms_norm(x.contiguous(), x.new_empty(0), self.weight, self.eps)[1]


class Rotary:
    """Precomputed cos/sin tables, indexed by position (HF inv_freq, incl. rope scaling types)."""

    def __init__(self, hf_config, max_positions: int, dtype: torch.dtype):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(hf_config)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * rope.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * rope.attention_scaling).to(dtype)
        self.sin = (emb.sin() * rope.attention_scaling).to(dtype)

    def to(self, device) -> "Rotary":
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a forward's positions, shaped [T, 1, D] (computed once per forward)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.n_heads, self.n_kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or h // self.n_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.intermediate = cfg.intermediate_size

    def forward(self, x, fb: ForwardBatch, kv: KVPool, layer: int, cos, sin, fused=None) -> torch.Tensor:
        if fused is not None:
            return self._forward_fused(x, fb, kv, layer, cos, sin, fused)
        T = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        # rope on q and k heads together: one set of ops instead of two
        qk = Rotary.apply(qkv[:, : self.q_size + self.kv_size].view(T, self.n_heads + self.n_kv, self.head_dim), cos, sin)
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.n_kv, self.head_dim)
        kv.write(layer, fb.out_slots, k, v)
        o = fb.attn_plan(q, kv.k[layer], kv.v[layer], self.scale)
        x = x + self.o_proj(o.reshape(T, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).split(self.intermediate, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def _forward_fused(self, x, fb: ForwardBatch, kv: KVPool, layer: int, cos, sin, ops) -> torch.Tensor:
        """The same layer with the backend's fused per-row glue (``Backend.fused_ops``): norm,
        rope + KV write, residual add + norm, silu * up -- one call each."""
        # submodules through _modules and .forward: nn.Module's __getattr__ and __call__ cost ~0.35 ms
        # of a 6.4 ms token on the demo model (30 layers x 5 linears; gguf + int8 activations, AMX Xeon)
        m = self._modules
        ln1, ln2 = m["input_layernorm"], m["post_attention_layernorm"]
        x = x.contiguous()
        qkv = m["qkv_proj"].forward(ops.add_rms_norm(x, x.new_empty(0), ln1.weight, ln1.eps)[1])
        q = ops.rope_write(qkv, cos, sin, kv.k[layer], kv.v[layer], fb.out_slots, self.n_heads, self.n_kv)
        o = fb.attn_plan(q, kv.k[layer], kv.v[layer], self.scale)
        x, h = ops.add_rms_norm(x, m["o_proj"].forward(o.reshape(x.shape[0], self.q_size)), ln2.weight, ln2.eps)
        return x + m["down_proj"].forward(ops.silu_mul(m["gate_up_proj"].forward(h)))


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_positions: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.rotary = Rotary(cfg, max_positions, dtype)
        self.backend = None  # the runner's kernel backend (specfw.backends), handed over by the ModelRunner

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, kv: KVPool) -> ForwardOutput:
        """``fb``'s per-token tensors on the model's device (``ForwardBatch.to``)."""
        x = self.embed_tokens(fb.input_ids)
        cos, sin = self.rotary.lookup(fb.positions)
        backend = self.backend or default_backend(x.device)
        if fb.attn_plan is None:  # a static (graphed) forward brings its own plan (specfw.graphs)
            fb.attn_plan = backend.plan_attention(fb.seqs, x.device, self.head_shape(x.dtype), backend.batch_invariant)
        fused = backend.fused_ops(x.dtype, self.layers[0].intermediate)
        stack = backend.decoder_stack(self) if fused is not None else None
        if stack is not None and stack.accepts(fb.attn_plan, x.shape[0]):
            x, captured = stack(x, fb, kv, cos, sin, fb.capture_layers)
        else:
            captured = {}
            for i, layer in enumerate(self.layers):
                if i in fb.capture_layers:
                    captured[i] = x
                x = layer.forward(x, fb, kv, i, cos, sin, fused)
        hidden = x
        captured[len(self.layers)] = x
        aux = [captured[i] for i in fb.capture_layers]  # in the requested order (ids may repeat)
        sel = hidden if fb.logits_indices is None else hidden.index_select(0, fb.logits_indices)
        normed = self.norm.rows(sel, fused)
        greedy = backend.greedy_head(self) if fb.greedy_only else None
        logits, argmax = greedy.select(normed) if greedy is not None else (self.lm_head(normed).float(), None)
        return ForwardOutput(logits=logits, hidden=hidden, aux_hidden=aux, argmax=argmax)

    def head_shape(self, dtype: torch.dtype) -> HeadShape:
        a = self.layers[0]
        return HeadShape(dtype, a.n_heads, a.n_kv, a.head_dim)


def default_backend(device: torch.device):
    """Torch's ops, loose plans: for a model run without a ModelRunner (tests, training tools)."""
    from ..backends import plain_backend

    return plain_backend(device)

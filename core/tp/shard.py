"""Splitting a loaded Llama-family target over the ranks of a ``TPGroup`` (Megatron's layout).

Per decoder layer:

* attention by whole key-value groups: rank r keeps KV heads ``kv[r]`` (as even a split as the
  count allows: the demo model's 3 KV heads over 2 ranks are 2 + 1) and the query heads that read
  them; the fused QKV projection keeps those heads' rows (column parallel), ``o_proj`` their
  input columns (row parallel: partial sums, one all-reduce), the KV pool only those heads;
* the MLP by the intermediate dimension in blocks of 32 (GGUF/int4 groups stay whole): the fused
  gate/up keeps its rows of both halves, ``down_proj`` the matching input columns (row parallel,
  one all-reduce);
* embedding and lm_head vocabulary parallel: rank r keeps ids ``[r*w, (r+1)*w)``; an embedding
  lookup is an all-reduce of each rank's rows (zero where the id is not its own), the logits an
  all-gather of each rank's columns.

Linears carrying the GGUF file's blocks (``gguf_weight``) get the same rows and columns of their
blocks, so ``model.quantization=gguf`` stays the file's own arithmetic under TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

from ..config import ConfigError
from ..backends.quant_linear import QuantWeight, pack, unpack
from .group import TPGroup

BLOCK = 32  # intermediate split unit: one GGUF / int4 group


class TPConfigError(ConfigError):
    def __init__(self, message: str):
        super().__init__("model.tp_size", message)


def even_split(n: int, parts: int, part: int, unit: int = 1) -> tuple[int, int]:
    """[start, stop) of ``part``'s share of ``n`` (counted in ``unit``s; earlier parts take the remainder)."""
    units = n // unit
    base, extra = divmod(units, parts)
    start = part * base + min(part, extra)
    stop = start + base + (1 if part < extra else 0)
    return start * unit, stop * unit


@dataclass(frozen=True)
class Partition:
    """What one rank keeps of the target."""

    kv_heads: tuple[int, int]
    q_per_kv: int
    intermediate: tuple[int, int]
    vocab_start: int
    vocab_width: int  # every rank's shard is this wide (the last padded with zero rows)


def partition(hf_config, rank: int, world: int) -> Partition:
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter, vocab = hf_config.intermediate_size, hf_config.vocab_size
    if world > kv:
        raise TPConfigError(f"{world} ranks need at least {world} key-value heads (heads are split by whole KV groups); this model has {kv}")
    unit = BLOCK if inter % BLOCK == 0 and inter // BLOCK >= world else 1
    width = -(-vocab // world)
    return Partition(even_split(kv, world, rank), heads // kv, even_split(inter, world, rank, unit), rank * width, width)


# ---------------------------------------------------------------- weights


def _take(linear: nn.Linear, rows: torch.Tensor | None = None, cols: slice | None = None) -> nn.Linear:
    """A new linear holding ``rows`` (output indices) and ``cols`` (an input range) of ``linear``,
    its GGUF blocks sliced alike."""
    w = linear.weight.detach()
    w = w if rows is None else w.index_select(0, rows)
    w = w if cols is None else w[:, cols]
    out = nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, dtype=w.dtype, device=w.device)
    out.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    if linear.bias is not None:
        b = linear.bias.detach()
        out.bias = nn.Parameter((b if rows is None else b.index_select(0, rows)).contiguous(), requires_grad=False)
    if hasattr(linear, "gguf_weight"):
        out.gguf_weight = take_quant(linear.gguf_weight, rows, cols)
    return out


def take_quant(qw: QuantWeight, rows: torch.Tensor | None, cols: slice | None) -> QuantWeight:
    codes, scale, minv = unpack(qw)
    if rows is not None:
        codes, scale = codes.index_select(0, rows), scale.index_select(0, rows)
        minv = minv.index_select(0, rows) if minv is not None else None
    if cols is not None:
        if cols.start % qw.group or cols.stop % qw.group:
            raise TPConfigError(f"a shard boundary ({cols.start}, {cols.stop}) splits a quantization group of {qw.group}")
        g = slice(cols.start // qw.group, cols.stop // qw.group)
        codes, scale = codes[:, cols], scale[:, g]
        minv = minv[:, g] if minv is not None else None
    return pack(codes, scale, minv, qw.bits, qw.offset, qw.group)


def _padded_rows(w: torch.Tensor, start: int, width: int) -> torch.Tensor:
    shard = w[start : start + width]
    if shard.shape[0] < width:
        shard = torch.cat([shard, shard.new_zeros(width - shard.shape[0], *shard.shape[1:])])
    return shard.contiguous()


# ---------------------------------------------------------------- parallel modules


class RowParallel(nn.Module):
    """A linear over this rank's share of the inputs; the ranks' partial sums all-reduced."""

    def __init__(self, linear: nn.Module, group: TPGroup):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self._modules["linear"].forward(x))


class _Named(nn.Module):
    """A module the leader may call outside a forward (a drafter using the target's embedding or
    lm_head): the followers then run the same call (``TPGroup.running("call", ...)``)."""

    def __init__(self, group: TPGroup, tp_name: str):
        super().__init__()
        self.group, self.tp_name = group, tp_name  # tp_name: the module's path in the model, for the followers

    def _running(self, method: str, *args):
        return self.group.running("call", self.tp_name, method, *args)


class VocabParallelEmbedding(_Named):
    def __init__(self, embedding: nn.Embedding, part: Partition, group: TPGroup, tp_name: str):
        super().__init__(group, tp_name)
        self.start, self.width = part.vocab_start, part.vocab_width
        self.num_embeddings = embedding.num_embeddings
        self.weight = nn.Parameter(_padded_rows(embedding.weight.detach(), self.start, self.width), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with self._running("forward", ids):
            local = ids - self.start
            mine = (local >= 0) & (local < self.width)
            rows = F.embedding(local.clamp(0, self.width - 1), self.weight)
            return self.group.all_reduce(torch.where(mine.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype)))


class VocabParallelHead(_Named):
    def __init__(self, linear: nn.Linear, part: Partition, group: TPGroup, tp_name: str):
        super().__init__(group, tp_name)
        self.vocab = linear.out_features
        rows = torch.arange(part.vocab_start, part.vocab_start + part.vocab_width).clamp(max=self.vocab - 1)
        # the last rank's ids past the vocabulary repeat the last id: their columns are cut after the gather
        shard = _take(linear, rows)
        self.linear = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._running("forward", x):
            return self.group.gather_columns(self._modules["linear"].forward(x), self.vocab)

    @property
    def weight(self) -> torch.Tensor:
        """The whole [vocab, H] weight (FR-Spec heads take rows of it)."""
        with self._running("full_weight"):
            return self.full_weight()

    def full_weight(self) -> torch.Tensor:
        w = self._modules["linear"].weight.detach()
        return self.group.gather_columns(w.t().contiguous(), self.vocab).t().contiguous()


# ---------------------------------------------------------------- the model


def shard_model(model: nn.Module, hf_config, group: TPGroup) -> Partition:
    """Replace ``model``'s weights by this rank's shard (before the backend swaps in its kernels)."""
    part = partition(hf_config, group.rank, group.world)
    for layer in model.layers:
        _shard_layer(layer, part, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, part, group, "embed_tokens")
    model.lm_head = VocabParallelHead(model.lm_head, part, group, "lm_head")
    return part


def _shard_layer(layer: nn.Module, part: Partition, group: TPGroup) -> None:
    d, g = layer.head_dim, part.q_per_kv
    kv0, kv1 = part.kv_heads
    q_rows = torch.arange(kv0 * g * d, kv1 * g * d)
    k_rows = layer.q_size + torch.arange(kv0 * d, kv1 * d)
    v_rows = layer.q_size + layer.kv_size + torch.arange(kv0 * d, kv1 * d)
    layer.qkv_proj = _take(layer.qkv_proj, torch.cat([q_rows, k_rows, v_rows]))
    layer.o_proj = RowParallel(_take(layer.o_proj, cols=slice(int(q_rows[0]), int(q_rows[-1]) + 1)), group)
    i0, i1 = part.intermediate
    gate_up = torch.cat([torch.arange(i0, i1), layer.intermediate + torch.arange(i0, i1)])
    layer.gate_up_proj = _take(layer.gate_up_proj, gate_up)
    layer.down_proj = RowParallel(_take(layer.down_proj, cols=slice(i0, i1)), group)
    layer.n_heads, layer.n_kv = (kv1 - kv0) * g, kv1 - kv0
    layer.q_size, layer.kv_size, layer.intermediate = layer.n_heads * d, layer.n_kv * d, i1 - i0

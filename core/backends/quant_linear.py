"""``QuantLinear``: a weight-only quantized linear on ``kernels/quant_ops.cpp``.

Schemes (``model.quantization``, ``speculative.draft_model_quantization``; see
docs/quantization.md):

* ``int8`` -- symmetric, one fp32 scale per output channel: ``q = round(w / s)``,
  ``s = max|w| / 127``, ``w' = s * q``;
* ``int4`` -- asymmetric, groups of ``INT4_GROUP`` = 32 inputs per output with an fp32 scale and
  min: ``s = (max - min) / 15``, ``q = round((w - min) / s)`` in 0..15, ``w' = s * q + min``;
* ``w8a8_int8`` (draft linears only, SGLang's name) -- ``int8`` weights taking int8 activations
  (``Q8Linear``, integer dot products) whatever ``model.activation_quantization`` is: the draft's
  rounding changes which tokens it proposes, never the output;
* ``gguf`` -- the GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K), kept as they are: each weight is
  dequantized in registers to exactly the fp32 value of the fp32 checkpoint specfw converts the
  file to, so outputs are bit-identical to ``none`` on that checkpoint (``attach_gguf_blocks``
  verifies every tensor at load). A bf16 model keeps the blocks where they round to its bf16
  weights; its linears then compute with the file's values, which are closer than bf16, so its
  outputs differ from ``none`` in bf16. Plain and speculative decoding still agree exactly, since
  both run the same scheme.

Every output is accumulated in fp32 in k order whatever the rows (batch invariant by
construction, like ``KernelLinear``), so greedy speculation stays exact within each scheme.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

SCHEMES = ("none", "int8", "int4", "gguf")
DRAFT_SCHEMES = (*SCHEMES, "unquant", "w8a8_int8")  # w8a8_int8 (SGLang's name): int8 weights and int8 activations, draft linears only
ACTIVATION_SCHEMES = ("none", "int8", "int8_per_token")  # model.activation_quantization (q8_linear.py; w8a8_linear.py: per token)
INT4_GROUP = 32
BLOCK = 16  # outputs per packed block (as cpu_ops' linear)


@dataclass
class QuantWeight:
    """Codes and scales in the kernel's layout (``quant_ops.cpp``)."""

    codes: torch.Tensor  # int8 [NB, K, 16] (bits 8) or uint8 [NB, K/2, 16] (bits 4)
    scale: torch.Tensor  # fp32 [NB, K/G, 16]
    minv: torch.Tensor  # fp32 like scale, or empty
    bits: int
    offset: int  # subtracted from a 4-bit code (8 for Q4_0)
    group: int
    out_features: int
    in_features: int
    fma_dq: bool = False  # every d * q exact in fp32 (exact_products): the kernel dequantizes with one FMA

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minv))


def _blocked(t: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [ceil(N/16), X, 16] (zero padded), as ``cpu_ops.pack``."""
    n = t.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    if nb * BLOCK != n:
        t = torch.cat([t, t.new_zeros(nb * BLOCK - n, t.shape[1])])
    return t.view(nb, BLOCK, t.shape[1]).transpose(1, 2).contiguous()


def pack(codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor | None, bits: int, offset: int, group: int) -> QuantWeight:
    """codes [N, K] (int8 values for bits 8, 0..15 for bits 4), scale/minv [N, K/group]."""
    n, k = codes.shape
    if bits == 8:
        c = _blocked(codes.to(torch.int8))
    else:
        c = _blocked(codes.to(torch.uint8))
        c = (c[:, 0::2, :] | (c[:, 1::2, :] << 4)).contiguous()
    s = _blocked(scale.float())
    m = _blocked(minv.float()) if minv is not None else torch.empty(0)
    return QuantWeight(c, s, m, bits, offset, group, n, k, exact_products(s, bits))


def exact_products(scale: torch.Tensor, bits: int) -> bool:
    """Whether ``d * q`` is exact in fp32 for every scale ``d`` and every code ``q`` (|q| < 2^bits):
    each nonzero scale is a normal number whose significand has at most 24 - bits bits (GGUF's
    fp16 scales: 11; K-quants' fp16 x 6-bit: 17). Then gguf-py's ``d * q`` rounded, ``+ m``
    rounded, is ``fma(q, d, m)``: the product needs no rounding, so both round the same exact sum
    once, and ``quant_ops`` dequantizes with one instruction instead of two."""
    bits_of = scale.float().contiguous().view(torch.int32)
    nonzero = (bits_of & 0x7FFFFFFF) != 0
    exponent = (bits_of >> 23) & 0xFF
    if bool(((exponent == 0) & nonzero).any() | (exponent == 0xFF).any()):  # subnormal, inf or nan
        return False
    significand = (bits_of & 0x7FFFFF) | 0x800000
    low = significand & -significand  # the lowest set bit: the significand has 24 - log2(low) bits
    return bool((low[nonzero] >= (1 << bits)).all())


def _unblocked(t: torch.Tensor, n: int) -> torch.Tensor:
    """[NB, X, 16] -> [N, X] (``_blocked``'s inverse)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]


def unpack(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``pack``'s inverse: codes [N, K], scale [N, K/group], minv or None."""
    c = qw.codes
    if qw.bits == 4:
        c = torch.stack([c & 0x0F, c >> 4], dim=2).reshape(c.shape[0], -1, BLOCK)
    minv = _unblocked(qw.minv, qw.out_features) if qw.minv.numel() else None
    return _unblocked(c, qw.out_features), _unblocked(qw.scale, qw.out_features), minv


def quantize(w: torch.Tensor, scheme: str) -> QuantWeight:
    """An fp32/bf16 weight [N, K] quantized at load (``int8`` or ``int4``)."""
    w = w.detach().float()
    if scheme == "int8":
        s = w.abs().amax(1, keepdim=True) / 127
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(w / s).clamp(-127, 127)
        return pack(q, s, None, 8, 0, w.shape[1])
    if scheme == "int4":
        n, k = w.shape
        g = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(2), g.amax(2)
        s = (hi - lo) / 15
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).view(n, k)
        return pack(q, s, lo, 4, 0, INT4_GROUP)
    raise ValueError(f"quantize: scheme {scheme!r}")


def supports(linear: nn.Module, scheme: str) -> bool:
    k = linear.in_features
    return k % 2 == 0 and (scheme != "int4" or k % INT4_GROUP == 0)


class QuantLinear(nn.Module):
    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None, ops, scheme: str):
        super().__init__()
        self.qw, self.ops, self.scheme = qw, ops, scheme
        self.in_features, self.out_features = qw.in_features, qw.out_features
        self.bias = torch.empty(0) if bias is None else bias.detach().float()

    @classmethod
    def from_linear(cls, linear: nn.Linear, ops, scheme: str) -> "QuantLinear":
        return cls(quantize(linear.weight, scheme), linear.bias, ops, scheme)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 ``[N, K]`` weight the codes stand for."""
        q = self.qw
        return self.ops.dequantize(q.codes, q.scale, q.minv, q.bits, q.offset, q.group, q.in_features, q.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qw
        y = self.ops.qlinear(x.reshape(-1, self.in_features), q.codes, q.scale, q.minv, q.bits, q.offset, q.group, self.out_features, self.bias, q.fma_dq)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme}, {self.qw.nbytes / 2**20:.1f} MiB"


# ---------------------------------------------------------------- GGUF blocks


GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K")  # block types kept as blocks (others stay fp32)


def gguf_blocks(raw: np.ndarray, qtype: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    """One GGUF tensor's raw blocks [N, bytes] -> per-weight codes [N, K], d [N, K/32], m or None,
    bits, offset, with ``w = d * (q - offset) + m`` rounded as gguf-py rounds it. Element j of a Q4
    block is byte j's low nibble, element j + 16 its high one. K-quants (super-blocks of 256 with 8
    sub-blocks of 32): ``d = d_super * sc``, ``m = -(dmin * min)``, products rounded to fp32 as
    gguf-py does; Q5_K's 5-bit codes are stored as 8-bit ones."""
    if qtype in ("Q4_K", "Q5_K"):
        return _k_quant_blocks(raw, qtype, n, k)
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, -1)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        q = torch.from_numpy(raw[..., 2:34].copy().view(np.int8).reshape(n, k))
        return q, d, None, 8, 0
    if qtype in ("Q4_0", "Q4_1"):
        off = 2 if qtype == "Q4_0" else 4
        qs = raw[..., off : off + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if qtype == "Q4_1" else None
        return torch.from_numpy(q), d, m, 4, 8 if qtype == "Q4_0" else 0
    raise ValueError(f"GGUF block type {qtype} is not supported ({', '.join(GGUF_TYPES)})")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes [..., 12]."""
    s = s.reshape(*s.shape[:-1], 3, 4)
    a, b, c = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_quant_blocks(raw: np.ndarray, qtype: str, n: int, k: int):
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, -1)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    sc, mn = _k_scales(raw[..., 4:16])
    dd = d[..., None] * sc.astype(np.float32)  # fp32 products, as gguf-py
    dm = dmin[..., None] * mn.astype(np.float32)
    qs = raw[..., -128:].reshape(n, k // 256, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, k // 256, 8, 32)
    bits = 4
    if qtype == "Q5_K":  # bit 4 of sub-block j's element i: bit j of qh byte i
        qh = raw[..., 16:48].reshape(n, k // 256, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q, bits = q | ((qh & 1) << 4), 8
    codes = torch.from_numpy(q.reshape(n, k).astype(np.int8 if bits == 8 else np.uint8))
    return codes, torch.from_numpy(dd.reshape(n, k // 32).copy()), torch.from_numpy((-dm).reshape(n, k // 32).copy()), bits, 0


def dequantize_reference(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int, offset: int) -> torch.Tensor:
    """gguf-py's arithmetic in torch: d * q in fp32, then + m (two roundings)."""
    n, k = q.shape
    qf = (q.to(torch.int32) - offset).float().view(n, -1, 32)
    w = d[..., None] * qf
    if m is not None:
        w = w + m[..., None]
    return w.view(n, k)


def _reverse_permute(n: int, heads: int) -> torch.Tensor:
    """transformers' reverse_permute_weights (q/k rows of a llama GGUF) as a row index."""
    dim = n // heads // 2
    return torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n)


_NAMES = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}


def attach_gguf_blocks(model: nn.Module, gguf_path, n_heads: int, n_kv_heads: int) -> int:
    """Give each linear of ``model`` whose GGUF tensors are of ``GGUF_TYPES`` a ``gguf_weight``
    (``QuantWeight``) -- only where dequantizing the blocks gives exactly the weight loaded, in the
    loaded dtype (fp32: the same bits; bf16: the blocks' values round to the loaded weight). Else
    the linear keeps its loaded weight and a warning says which. Returns how many got blocks."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    targets: list[tuple[nn.Linear, list[str]]] = []
    for i, layer in enumerate(model.layers):
        for attr, names in _NAMES.items():
            targets.append((getattr(layer, attr), [f"blk.{i}.{n}.weight" for n in names]))
    lm = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    targets.append((model.lm_head, [lm]))
    done = 0
    for linear, names in targets:
        parts = []
        for name in names:
            t = tensors.get(name)
            qtype = t.tensor_type.name if t is not None else "missing"
            if qtype not in GGUF_TYPES:
                parts = None
                break
            n, k = int(t.shape[1]), int(t.shape[0])
            parts.append((name, gguf_blocks(t.data, qtype, n, k)))
        if not parts or len({p[1][3:] for p in parts}) != 1:
            logger.info("gguf: %s keeps its loaded weight (block types %s)", names, [tensors[n].tensor_type.name for n in names if n in tensors])
            continue
        qw = _match(linear.weight.detach(), parts, n_heads, n_kv_heads)
        if qw is None:
            dtype = str(linear.weight.dtype).removeprefix("torch.")
            logger.warning("gguf: %s blocks do not dequantize to the loaded %s weight; the linear keeps that weight", names, dtype)
            continue
        linear.gguf_weight = qw
        done += 1
    return done


def _match(w: torch.Tensor, parts, n_heads: int, n_kv_heads: int) -> QuantWeight | None:
    """The blocks of ``parts`` (row-stacked, q/k rows possibly in GGUF's permuted order) as one
    ``QuantWeight`` if they dequantize to ``w`` rounded to ``w``'s dtype; else None."""
    qs, ds, ms = [], [], []
    row = 0
    for name, (q, d, m, bits, offset) in parts:
        n = q.shape[0]
        target = w[row : row + n]
        row += n
        heads = n_heads if name.endswith("attn_q.weight") else n_kv_heads
        perms = [None] + ([_reverse_permute(n, heads)] if name.endswith(("attn_q.weight", "attn_k.weight")) else [])
        for p in perms:
            qp, dp, mp = (q, d, m) if p is None else (q[p], d[p], m[p] if m is not None else None)
            if torch.equal(dequantize_reference(qp, dp, mp, bits, offset).to(w.dtype), target):
                qs.append(qp), ds.append(dp), ms.append(mp)
                break
        else:
            return None
    if row != w.shape[0]:
        return None
    m = torch.cat(ms) if ms[0] is not None else None
    return pack(torch.cat(qs), torch.cat(ds), m, bits, offset, 32)

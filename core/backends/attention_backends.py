"""``model.attention_backend`` / ``speculative.draft_attention_backend``: which kernels run the
attention of a forward, whatever runs its linears.

* ``auto`` -- the device backend's own: on a CPU specfw's compiled kernel (``kernel_attention``)
  or torch's SDPA plans; on CUDA ``triton`` where Triton imports, else ``torch``;
* ``torch`` -- torch's SDPA plans (``attention.plan_attention``: exact plans run each decode/tree
  row as its own one-row query; today's GPU path);
* ``triton`` -- specfw's Triton kernel (``triton/attention.py``): one program per (row, head) over
  the row's slot list, prompts and extends included; exact by construction. Needs CUDA (or
  ``TRITON_INTERPRET=1``: Triton's interpreter on CPU tensors, for tests);
* ``flashinfer`` -- FlashInfer's paged prefill/decode kernels with page size 1 (a page = a KV
  slot) and a custom mask for tree rows (``flashinfer_attention.py``). Needs CUDA. Not exact in
  the batch-invariant sense (its split-KV scheduling depends on the batch).

``check_attention_backend`` is the startup check (a ``ConfigError`` naming the key).
"""

from __future__ import annotations

import torch

from .base import HeadShape

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")


def resolve(name: str | None, device: torch.device) -> str:
    """``auto`` made concrete for ``device``: ``native`` (the device backend's own plans) on a
    CPU; on CUDA ``triton`` where Triton imports, else ``torch``."""
    from .. import triton as tr

    name = name or "auto"
    if name != "auto":
        return name
    if device.type == "cuda":
        return "triton" if tr.importable() else "torch"
    return "native"


def check_attention_backend(name: str | None, device: torch.device, key: str = "model.attention_backend") -> None:
    from .. import triton as tr
    from ..config import ConfigError

    if name is None:
        return
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(key, f"'{name}' is not one of {list(ATTENTION_BACKENDS)}")
    if name == "triton" and not tr.available(device.type):
        raise ConfigError(key, f"triton: {tr.unavailable_reason(device.type)}; allowed here: auto, torch")
    if name == "flashinfer":
        if device.type != "cuda":
            raise ConfigError(
                key,
                f"flashinfer needs a CUDA device (the model runs on {device}); allowed here: auto, torch" + (", triton" if tr.available(device.type) else ""),
            )
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            raise ConfigError(key, f"flashinfer is not importable ({e}); pip install 'specfw[gpu]'") from e


def named_plan(name: str, seqs, device: torch.device, shape: HeadShape, exact: bool):
    """The attention plan of backend ``name`` (``torch`` | ``triton`` | ``flashinfer``)."""
    if name == "triton":
        return TritonAttentionPlan(seqs, device)
    if name == "flashinfer":
        from .flashinfer_attention import FlashInferPlan

        return FlashInferPlan(seqs, device, shape)
    from .torch_ops import sdpa_plan

    return sdpa_plan(seqs, device, shape, exact)


class TritonAttentionPlan:
    """``triton/attention.py``'s kernel over this forward's ``RowLayout`` (built once on the host,
    moved to the device once, used by every layer)."""

    def __init__(self, seqs, device: torch.device):
        from .row_layout import RowLayout

        self.layout = RowLayout.build(seqs).to(device)
        self.covered = sum(s.q_len for s in seqs)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        from ..triton.attention import row_attention

        q = q.contiguous()
        out = torch.empty_like(q) if self.covered == q.shape[0] else torch.zeros_like(q)
        return row_attention(q, k_cache, v_cache, out, scale, self.layout)

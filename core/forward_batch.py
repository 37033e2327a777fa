"""What one model forward needs: a flattened ragged batch of query tokens and, per sequence,
the KV slots it attends to and how its new tokens see each other.

Built on the host; ``ForwardBatch.to(device)`` moves the per-token tensors a forward computes
with (ids, positions, output slots, logits rows) and leaves the per-sequence metadata
(``seqs``) on the host, where attention plans are made (``specfw.device``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqSpan:
    """One sequence's part of a forward.

    ``kv_slots`` lists every slot the sequence attends to, prefix first, then the slots of
    this forward's ``q_len`` new tokens (in query order). ``tree_mask`` is a ``[q_len, m]`` bool
    matrix (True = may attend, ``m >= q_len``) over the last ``m`` KV entries — usually the new
    tokens themselves (``m == q_len``); a drafter may include earlier drafted nodes. KV entries
    before those are always visible. ``None`` means causal among the new tokens.
    """

    q_start: int
    q_len: int
    kv_slots: torch.Tensor
    tree_mask: torch.Tensor | None = None
    kv_range: tuple[int, int] | None = None  # set when kv_slots is one ascending run [a, b)

    def __post_init__(self):
        n = int(self.kv_slots.numel())
        if n and self.kv_range is None:
            s = self.kv_slots.numpy() if self.kv_slots.device.type == "cpu" else self.kv_slots  # numpy: ~1 us an op, torch ~5
            a, b = int(s[0]), int(s[-1])
            if b - a + 1 == n and (n < 3 or bool((s[1:] - s[:-1] == 1).all())):
                self.kv_range = (a, b + 1)

    @property
    def prefix_len(self) -> int:
        return int(self.kv_slots.numel()) - self.q_len

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """``kv_slots`` on ``device`` (copied once per forward, then reused by every layer)."""
        if self.kv_slots.device == device:
            return self.kv_slots
        cached = getattr(self, "_device_slots", None)
        if cached is None or cached.device != device:
            cached = self.kv_slots.to(device, non_blocking=True)
            self._device_slots = cached
        return cached


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] flattened new tokens of all sequences
    positions: torch.Tensor  # [T] rope positions (depth-based for trees)
    out_slots: torch.Tensor  # [T] KV slots the new tokens are written to
    seqs: list[SeqSpan]
    logits_indices: torch.Tensor | None = None  # rows of the hidden states that need logits; None = all
    capture_layers: tuple[int, ...] = field(default_factory=tuple)  # hidden states entering these layers
    attn_plan: object | None = None  # filled by the model once per forward (backend.plan_attention); called per layer
    # every row's logits are read only for their argmax (first index on ties): the model may return
    # rows whose argmax, and the value there, are the full product's and whose other entries are
    # -inf (Backend.greedy_head); set by the workers for greedy rows without logprobs or penalties
    greedy_only: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> "ForwardBatch":
        """This batch with its per-token tensors on ``device`` (itself when they already are)."""
        if self.input_ids.device == device:
            return self

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        ids, pos, slots, rows = (move(t) for t in (self.input_ids, self.positions, self.out_slots, self.logits_indices))
        return ForwardBatch(ids, pos, slots, self.seqs, rows, self.capture_layers, greedy_only=self.greedy_only)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logits_indices) or T, V]
    hidden: torch.Tensor  # [T, H] final-norm input (last layer output, pre-norm)
    aux_hidden: list[torch.Tensor] = field(default_factory=list)  # per capture layer, [T, H]
    # each logits row's argmax (first index on ties) where the forward found it already (a
    # greedy_only forward's greedy head: Backend.greedy_head), else None
    argmax: list[int] | None = None

    def argmax_tokens(self) -> list[int]:
        """Every logits row's argmax: the one the forward found, else read from the logits."""
        from .sampling import greedy_tokens

        return self.argmax if self.argmax is not None else greedy_tokens(self.logits)

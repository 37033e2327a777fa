"""KV cache: a preallocated pool of token slots, an allocator, and per-request slot tables.

One K and one V tensor per layer, shaped ``[num_slots, num_kv_heads, head_dim]``. A slot
holds the key/value of one token. Requests own ordered lists of slots (``SlotTable``); a
forward writes new tokens' K/V at freshly allocated slots and attention gathers a request's
slots in order. Token-granular slots make tree verification cheap: the accepted path's
slots are appended to the table in path order and the rest are returned to the pool.
"""

from __future__ import annotations

import numpy as np
import torch


class KVPoolExhausted(RuntimeError):
    """Raised when an allocation asks for more slots than are free."""


class SlotAllocator:
    """Free list of slot indices. Slot ``num_slots`` (one past the end) is never handed out:
    it is a scratch slot that padded query positions may write to."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"KV pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # a stack, popped from the end; numpy, not torch: every step allocates right after the
        # forward, when the host's code runs cold (an allocation after 160 MB had streamed through
        # the caches took ~110 us on torch ops, 55-70 us on numpy; a free ~100 us either way;
        # session 66)
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._num_free = num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self._num_free

    def can_alloc(self, n: int) -> bool:
        return n <= self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        if n > self._num_free:
            raise KVPoolExhausted(f"KV pool exhausted: asked for {n} slots, {self._num_free} free of {self.num_slots}")
        start = self._num_free - n
        out = torch.from_numpy(self._free[start : self._num_free][::-1].copy())
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        if self._num_free + n > self.num_slots:
            raise RuntimeError("double free in KV slot allocator")
        host = slots.numpy() if slots.device.type == "cpu" else slots.cpu().numpy()
        self._free[self._num_free : self._num_free + n] = host.reshape(-1)[::-1]
        self._num_free += n


class SlotTable:
    """The ordered KV slots of one sequence (prompt + generated tokens)."""

    def __init__(self, capacity: int = 256):
        self._buf = torch.empty(capacity, dtype=torch.long)
        self.length = 0

    def append(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        need = self.length + n
        if need > self._buf.numel():
            grown = torch.empty(max(need, 2 * self._buf.numel()), dtype=torch.long)
            grown[: self.length] = self._buf[: self.length]
            self._buf = grown
        self._buf[self.length : need] = slots
        self.length = need

    def slots(self) -> torch.Tensor:
        return self._buf[: self.length]

    def truncate(self, length: int) -> torch.Tensor:
        """Drop slots past ``length``; returns the dropped slots (caller frees them)."""
        dropped = self._buf[length : self.length].clone()
        self.length = min(self.length, length)
        return dropped

    def __len__(self) -> int:
        return self.length


def _device_move_available() -> bool:
    from . import triton as tr

    return tr.available("cuda")


class KVPool:
    """Per-layer K/V storage plus the slot allocator."""

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, num_slots: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)  # +1: scratch slot for padding
        # one buffer per K and V, a view per layer: a move of KV entries is one kernel for all layers
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = list(self.k_all.unbind(0)), list(self.v_all.unbind(0))
        self.allocator = SlotAllocator(num_slots)
        self.scratch_slot = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def slots_for_budget(cls, memory_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return int(memory_bytes // cls.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``slots`` on the pool's device (``ForwardBatch.to`` puts ``out_slots`` there)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at ``src`` slots to ``dst`` slots (reads all sources first, so
        the two may overlap). Slot tensors may be host tensors (slot tables live on the host)."""
        src, dst = src.to(self.device, non_blocking=True), dst.to(self.device, non_blocking=True)
        if self.device.type == "cuda" and _device_move_available():
            from .triton.kv_ops import move_kv

            move_kv(self.k_all, self.v_all, src, dst)
            return
        # every layer at once (the slot axis of the one buffer): four ops, not four a layer (the
        # demo's 30 layers made 120 calls, ~0.5 ms a move on a CPU)
        self.k_all.index_copy_(1, dst, self.k_all.index_select(1, src))
        self.v_all.index_copy_(1, dst, self.v_all.index_select(1, src))

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_slots

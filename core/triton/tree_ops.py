"""Greedy tree verification on the device, in Triton: one program per tree walks from the root to
the child whose token is the target's argmax at its parent (the lowest-index such child: the
order ``DraftTree.children`` visits), as far as it goes, and names the bonus token -- the
argmax where the walk stopped. It replaces ``speculative/verify.py``'s host walk on CUDA, where
the argmax would otherwise be copied to the host node by node; ``greedy_walk_reference`` is the
torch reference (the host walk over the same arrays).

Trees are padded to one width ``N``: ``tokens``/``parents``/``best`` [B, N], ``sizes`` [B] (nodes
past a tree's size are ignored; node 0 is the root, ``parents[:, 0]`` is unused).
Returns ``path`` [B, N] (node indices from the root, -1 after the last), ``accepted`` [B] (draft
tokens accepted = path length - 1) and ``bonus`` [B].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _greedy_walk_kernel(tokens, parents, best, sizes, path, accepted, bonus, stride, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    n = tl.load(sizes + b)
    i = tl.arange(0, BLOCK)
    valid = (i < n) & (i > 0)
    tok = tl.load(tokens + b * stride + i, mask=valid, other=-1)
    par = tl.load(parents + b * stride + i, mask=valid, other=-2)
    node = tl.min(tl.zeros([BLOCK], tl.int32), 0)
    depth = tl.min(tl.zeros([BLOCK], tl.int32), 0)
    tl.store(path + b * stride, node)
    for _ in range(BLOCK - 1):  # a miss leaves node where it is, so every later step misses too
        want = tl.load(best + b * stride + node)
        hit = valid & (par == node) & (tok == want)
        child = tl.min(tl.where(hit, i, BLOCK), 0)
        found = child < BLOCK
        depth = depth + found.to(tl.int32)
        tl.store(path + b * stride + depth, child, mask=found)
        node = tl.where(found, child, node)
    tl.store(accepted + b, depth)
    tl.store(bonus + b, tl.load(best + b * stride + node))


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, N = tokens.shape
    i32 = torch.int32
    tokens, parents, best = (t.to(i32).contiguous() for t in (tokens, parents, best))
    sizes = sizes.to(i32).contiguous()
    path = torch.full((B, N), -1, dtype=i32, device=tokens.device)
    accepted = torch.empty(B, dtype=i32, device=tokens.device)
    bonus = torch.empty(B, dtype=i32, device=tokens.device)
    _greedy_walk_kernel[(B,)](tokens, parents, best, sizes, path, accepted, bonus, N, BLOCK=triton.next_power_of_2(max(N, 2)))
    return path, accepted, bonus

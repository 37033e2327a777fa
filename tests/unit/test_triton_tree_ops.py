"""Greedy tree verification in Triton (``triton/tree_ops.py``) against its torch reference and the
host walk the engine uses (``verify_greedy``): random trees, chains, empty drafts, all and none
accepted. Runs under Triton's interpreter on a CPU (conftest), on CUDA where there is one."""

import pytest
import torch

from specfw import triton as tr
from specfw.speculative.tree import build_tree
from specfw.speculative.types import DraftCandidates
from specfw.speculative.verify import greedy_walk_reference, verify_greedy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not tr.available(DEVICE), reason=tr.unavailable_reason(DEVICE))
N = 12


def _trees(gen):
    """(tree, best) pairs: random trees over a 4-token vocabulary (so walks go deep), a chain
    fully accepted, a chain rejected at once, a root alone (empty draft)."""
    out = []
    for k in range(10):
        n = int(torch.randint(1, N, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]  # parents-first
        toks = torch.randint(0, 4, (n,), generator=gen)
        tree = build_tree(7, DraftCandidates(toks, torch.tensor(parents), -torch.arange(n, dtype=torch.float)), n + 1)
        out.append((tree, torch.randint(0, 4, (len(tree),), generator=gen)))
    chain = build_tree(7, DraftCandidates(torch.tensor([1, 2, 3, 1, 2]), torch.tensor([-1, 0, 1, 2, 3]), torch.zeros(5)), 6)
    out.append((chain, torch.tensor([1, 2, 3, 1, 2, 9])))  # all accepted, bonus 9
    out.append((chain, torch.tensor([0, 2, 3, 1, 2, 9])))  # none accepted, bonus 0
    out.append((build_tree(7, DraftCandidates.empty(), 1), torch.tensor([3])))
    return out


def _padded(pairs):
    B = len(pairs)
    tokens, parents, best = (torch.zeros(B, N, dtype=torch.long) for _ in range(3))
    sizes = torch.zeros(B, dtype=torch.long)
    for b, (t, bst) in enumerate(pairs):
        n = len(t)
        tokens[b, :n], parents[b, :n], best[b, :n], sizes[b] = t.tokens, t.parents, bst, n
    return tokens, parents, best, sizes


def test_greedy_walk_matches_the_reference_and_the_host_walk():
    from specfw.triton.tree_ops import greedy_walk

    pairs = _trees(torch.Generator().manual_seed(0))
    tokens, parents, best, sizes = _padded(pairs)
    path, accepted, bonus = greedy_walk(*(t.to(DEVICE) for t in (tokens, parents, best, sizes)))
    ref = greedy_walk_reference(tokens, parents, best, sizes)
    assert torch.equal(path.cpu(), ref[0]) and torch.equal(accepted.cpu(), ref[1]) and torch.equal(bonus.cpu(), ref[2])
    depths = []
    for b, (tree, bst) in enumerate(pairs):
        logits = torch.full((len(tree), 16), -1.0)
        logits[torch.arange(len(tree)), bst] = 1.0
        host = verify_greedy(tree, logits)
        n = int(accepted[b]) + 1
        assert path[b, :n].tolist() == host.accepted_nodes
        assert host.tokens == [int(tree.tokens[i]) for i in path[b, 1:n].tolist()] + [int(bonus[b])]
        depths.append(n - 1)
    assert depths[-3:] == [5, 0, 0] and max(depths[:-3]) >= 2  # all / none accepted, empty draft; some deep walks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh runs it on a GPU)")
def test_verify_greedy_walks_on_the_device_on_cuda(monkeypatch):
    from specfw.speculative import verify

    monkeypatch.setattr(verify, "DEVICE_WALK_MIN_NODES", 2)  # every tree on the device (by default only large ones)
    for tree, bst in _trees(torch.Generator().manual_seed(1)):
        logits = torch.full((len(tree), 16), -1.0)
        logits[torch.arange(len(tree)), bst] = 1.0
        host, dev = verify_greedy(tree, logits), verify_greedy(tree, logits.cuda())
        assert (dev.accepted_nodes, dev.tokens) == (host.accepted_nodes, host.tokens)

"""Default verification: greedy tree walk, stochastic tree sampling with acceptance thresholds
(target-only; thresholds of 1.0 are lossless), and chain rejection sampling with draft probs."""

from __future__ import annotations

import torch

from ..request import Request
from ..sampling import apply_penalties, greedy_tokens, target_probs
from .types import DraftTree, VerifyResult


def processed_logits(req: Request, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """Apply the request's penalties at every node, as if the node's path had been generated."""
    p = req.params
    if not p.has_penalties:
        return logits
    out = torch.empty_like(logits)
    parents = tree.parents.tolist()
    toks = tree.tokens.tolist()
    for i in range(len(tree)):
        path, n = [], i
        while n > 0:
            path.append(toks[n])
            n = parents[n]
        out[i] = apply_penalties(logits[i : i + 1], p, req.prompt_ids, req.output_ids + path[::-1])[0]
    return out


DEVICE_WALK_MIN_NODES = 65  # smaller trees are walked on the host (see verify_greedy)


def verify_greedy(tree: DraftTree, logits: torch.Tensor, argmax: list[int] | None = None) -> VerifyResult:
    """Follow the child whose token equals the target's argmax; the argmax where it stops is the
    bonus. The argmax of every node comes back in one copy and the walk runs on the host; on
    CUDA with Triton installed, trees of ``DEVICE_WALK_MIN_NODES`` nodes or more are walked on the
    device (``triton/tree_ops.py``). Measured on an H200 (bf16 demo model, trees of 8): the verify
    hook with the device walk (its launch, the tree's copies in, three reads back) cost 0.30 ms a
    step; the host walk reads back once, as a plain step's argmax does, and walks 8 nodes in
    microseconds (its time on the H200 is not measured yet). ``argmax``: the rows' argmaxes,
    already read (the worker reads a whole batch's at once): the walk runs on the host."""
    if argmax is None and logits.is_cuda and len(tree) >= DEVICE_WALK_MIN_NODES and _device_walk_available():
        return _verify_greedy_on_device(tree, logits)
    best = argmax if argmax is not None else greedy_tokens(logits)
    toks, first_child, next_sibling = tree.tokens.tolist(), tree.retrieve_next_token.tolist(), tree.retrieve_next_sibling.tolist()
    node, path = 0, [0]
    while True:
        c = first_child[node]  # the children in candidate order (DraftTree.children, on lists)
        while c >= 0 and toks[c] != best[node]:
            c = next_sibling[c]
        if c < 0:
            break
        node = c
        path.append(node)
    return VerifyResult(path, [toks[n] for n in path[1:]] + [best[node]], len(tree) - 1)


def _device_walk_available() -> bool:
    from .. import triton as tr

    return tr.available("cuda")


def _verify_greedy_on_device(tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    from ..triton.tree_ops import greedy_walk

    dev = logits.device
    best = logits.argmax(-1).view(1, -1)
    path, accepted, bonus = greedy_walk(tree.tokens.view(1, -1).to(dev), tree.parents.view(1, -1).to(dev), best, torch.tensor([len(tree)], device=dev))
    n = int(accepted[0]) + 1
    nodes = path[0, :n].tolist()
    toks = tree.tokens.tolist()
    return VerifyResult(nodes, [toks[i] for i in nodes[1:]] + [int(bonus[0])], len(tree) - 1)


def greedy_walk_reference(
    tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``triton/tree_ops.greedy_walk``'s torch reference (host): the same arrays, walked per tree."""
    B, N = tokens.shape
    path = torch.full((B, N), -1, dtype=torch.int32)
    accepted = torch.zeros(B, dtype=torch.int32)
    bonus = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        n, node, nodes = int(sizes[b]), 0, [0]
        while True:
            kids = [c for c in range(1, n) if int(parents[b, c]) == node and int(tokens[b, c]) == int(best[b, node])]
            if not kids:
                break
            node = kids[0]
            nodes.append(node)
        path[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.int32)
        accepted[b], bonus[b] = len(nodes) - 1, int(best[b, node])
    return path, accepted, bonus


def verify_tree_sampling(req: Request, tree: DraftTree, logits: torch.Tensor, threshold_single: float, threshold_acc: float) -> VerifyResult:
    """Target-only tree sampling. At each node one uniform coin walks the children in order
    against the accumulated target probability (inverse-CDF over the siblings): with both
    thresholds at 1.0 the emitted token is an exact sample of the target distribution. A
    rejected child's token is removed from the residual the bonus token is drawn from."""
    toks = tree.tokens.tolist()
    node, path = 0, [0]
    gen = req.generator
    while True:
        probs = target_probs(logits[node : node + 1], req.params)[0]
        coin = float(torch.rand((), generator=gen))
        acc, accepted = 0.0, None
        residual = probs.clone()
        for c in tree.children(node):
            p_tok = float(probs[toks[c]])
            acc += p_tok
            if coin <= acc / threshold_acc or p_tok >= threshold_single:
                accepted = c
                break
            residual[toks[c]] = 0.0
        if accepted is None:
            total = float(residual.sum())
            dist = residual / total if total > 0 else probs
            bonus = int(torch.multinomial(dist, 1, generator=gen))
            return VerifyResult(path, [toks[n] for n in path[1:]] + [bonus], len(tree) - 1)
        node = accepted
        path.append(node)


def verify_chain_rejection(req: Request, tree: DraftTree, logits: torch.Tensor) -> VerifyResult:
    """Leviathan et al. 2023: accept draft x ~ q with prob min(1, p(x)/q(x)); on rejection sample
    from norm(max(0, p - q)); after a fully accepted chain sample the bonus from p."""
    toks = tree.tokens.tolist()
    gen = req.generator
    path = [0]
    for d in range(1, len(tree)):
        p = target_probs(logits[d - 1 : d], req.params)[0]
        q = tree.draft_probs[d - 1].float()
        x = toks[d]
        if float(torch.rand((), generator=gen)) * float(q[x]) <= float(p[x]):
            path.append(d)
            continue
        resid = (p - q).clamp_min(0)
        dist = resid / resid.sum() if float(resid.sum()) > 0 else p
        return VerifyResult(path, [toks[n] for n in path[1:]] + [int(torch.multinomial(dist, 1, generator=gen))], len(tree) - 1)
    p = target_probs(logits[len(tree) - 1 :], req.params)[0]
    return VerifyResult(path, toks[1:] + [int(torch.multinomial(p, 1, generator=gen))], len(tree) - 1)


def verify(
    req: Request,
    tree: DraftTree,
    logits: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    force_greedy: bool = False,
    argmax: list[int] | None = None,
) -> VerifyResult:
    """``logits`` [len(tree), V] on any device: greedy walks read one argmax per node from it
    (or take ``argmax``, read already, where no penalty changes the logits); penalties and
    sampling run on a host copy (the request's generator is a host generator)."""
    if req.params.has_penalties or not (req.params.greedy or force_greedy):
        logits = logits.cpu()
    logits = processed_logits(req, tree, logits)
    if req.params.greedy or force_greedy:
        return verify_greedy(tree, logits, None if req.params.has_penalties else argmax)
    if tree.draft_probs is not None and len(tree) > 1 and tree.is_chain:
        return verify_chain_rejection(req, tree, logits)
    return verify_tree_sampling(req, tree, logits, threshold_single, threshold_acc)

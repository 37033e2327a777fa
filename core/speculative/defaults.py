"""The core's built-in tree building and verification, registered as a plugin whose hooks are
``trylast``: any algorithm runtime that returns a result from these hooks overrides them."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .tree import build_tree
from .verify import verify


@hookimpl(trylast=True)
def specfw_build_tree(ctx, req, candidates, plan):
    return build_tree(req.seq_ids[-1], candidates, plan.size)


@hookimpl(trylast=True)
def specfw_verify(ctx, req, tree, logits, argmax):
    cfg = ctx.config
    return verify(req, tree, logits, cfg.accept_threshold_single, cfg.accept_threshold_acc, ctx.force_greedy, argmax)

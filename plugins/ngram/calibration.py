"""How far the n-gram trie's continuations are right, learned online per depth.

After each drafted step the trie's draft is compared with the tokens the target produced (the
accepted draft tokens and the bonus token, all the target's own): depth d of the draft was
*tried* when the target's first d-1 tokens are a path of it that has children, and *right* when
the target's d-th token is one of those children. Steps that verified only part of the draft
(the draft policy pruned it) are judged the same way: the bonus token is the target's own token
at the first depth not verified, and deeper depths are not judged. So ``log_probs`` (Beta(1, 1)
posterior means, multiplied down the depths) is an unbiased estimate of the chance that a node at
depth d is on the target's path, which the draft policy's confidence pruning reads as the
node's score. The counts are kept per length of the matched context suffix (``window_bucket``):
a continuation of a long match is a quote, one of a single token a guess.
"""

from __future__ import annotations

import math


class DepthCalibration:
    """P(the target's token at depth d is in the draft | the tokens before it were), counted per depth."""

    def __init__(self):
        self.tried: list[int] = []
        self.right: list[int] = []

    def observe(self, chain: list[int], produced: list[int]) -> None:
        """``chain``: the tokens proposed as one chain; ``produced``: the tokens the target produced
        at the same positions (only as many as it produced can be judged)."""
        self.observe_tree(chain, list(range(-1, len(chain) - 1)), produced)

    def observe_tree(self, tokens: list[int], parents: list[int], produced: list[int]) -> None:
        """A drafted tree (``parents[i]``: the index of node i's parent, -1 for the root's children)
        judged along the target's path ``produced``."""
        child = {}
        for i, (p, t) in enumerate(zip(parents, tokens)):
            child.setdefault((p, t), i)
        has_children = set(parents)
        node = -1
        for d, tok in enumerate(produced):
            if node not in has_children:
                return  # the draft ends on the target's path: nothing deeper to judge
            if d == len(self.tried):
                self.tried.append(0)
                self.right.append(0)
            self.tried[d] += 1
            node = child.get((node, tok))
            if node is None:
                return
            self.right[d] += 1

    def log_probs(self, n: int) -> list[float]:
        """Cumulative log-probabilities of the first ``n`` depths."""
        out, total = [], 0.0
        for d in range(n):
            tried, right = (self.tried[d], self.right[d]) if d < len(self.tried) else (0, 0)
            total += math.log((right + 1) / (tried + 2))
            out.append(total)
        return out


def window_bucket(window: int) -> int:
    """The calibration bucket of a matched suffix of ``window`` tokens: 1, 2, 3-4, 5-8, 9+."""
    return min(4, max(0, (window - 1).bit_length()))


BUCKETS = 5

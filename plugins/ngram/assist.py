"""The ngram draft assist (``speculative.draft_assist=ngram``): beside a model-based drafter, the
n-gram cache's continuation of the request's context as one extra chain.

A small draft model predicts the next tokens of the language; the context often says them
outright (code that repeats an identifier, an answer that quotes the question, a target that
repeats itself). The chain is the most recent continuation of the longest matching suffix,
continued where it ends by the shorter matching suffixes' (SGLang's NGRAM matching with breadth
1), as long as the step's budget. Its node scores are calibrated online, so that the draft
policy can weigh them against the drafter's cumulative log-probabilities: after each step the
chain is compared with the tokens the target produced (the accepted tokens and the bonus token,
which are the target's own), and depth d scores ``sum_{j <= d} log P(token j right | tokens
before it right)`` (``calibration.py``, per length of the longest matched context suffix): the
drafter's own candidates should win over a guess.
"""

from __future__ import annotations

import torch

from specfw.sdk import DraftCandidates, hookimpl

from .cache import NgramCache
from .calibration import BUCKETS, DepthCalibration, window_bucket
from .config import NgramConfig


class NgramAssist:
    def __init__(self, ctx):
        self.cache = NgramCache(NgramConfig())  # SGLang's NGRAM defaults: windows 1..12, branch length 18
        self.calibration = [DepthCalibration() for _ in range(BUCKETS)]  # per window_bucket
        self.proposed: dict[str, tuple[int, list[int]]] = {}  # rid → (bucket, the chain proposed this step)

    def _chain(self, req, budget: int) -> tuple[int, list[int]]:
        anchors = self.cache.match(req)
        if not anchors:
            return 0, []
        return window_bucket(anchors[0][1]), self.cache.trie.draft_chain([node for node, _ in anchors], budget)

    @hookimpl
    def specfw_assist_draft(self, ctx, reqs, plan):
        out = []
        for r in reqs:
            bucket, chain = self._chain(r, plan.size - 1)
            if not chain:
                out.append(DraftCandidates.empty())
                continue
            self.proposed[r.rid] = (bucket, chain)
            scores = torch.tensor(self.calibration[bucket].log_probs(len(chain)), dtype=torch.float32)
            out.append(DraftCandidates(torch.tensor(chain, dtype=torch.long), torch.arange(-1, len(chain) - 1, dtype=torch.long), scores))
        return out

    @hookimpl
    def specfw_on_accept(self, ctx, reqs, results, hidden, aux_hidden):
        for r, res in zip(reqs, results):
            bucket, chain = self.proposed.pop(r.rid, (0, None))
            if chain:
                self.calibration[bucket].observe(chain, res.tokens)

    @hookimpl
    def specfw_release(self, ctx, req):
        self.cache.release(req)
        self.proposed.pop(req.rid, None)

    @hookimpl
    def specfw_flush_cache(self, ctx):
        self.cache.clear()  # the depth calibration stays: acceptance rates, not tokens

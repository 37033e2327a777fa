"""'bigram' drafting: find the previous occurrence of the last token in the request's own
sequence and propose the tokens that followed it (prompt lookup with a one-token key)."""

from __future__ import annotations

from dataclasses import dataclass

from specfw.sdk import ConfigError, DraftCandidates, SpecAlgoConfig, TreeShape, hookimpl


@dataclass
class BigramConfig(SpecAlgoConfig):
    min_gap: int = 1  # ignore occurrences closer than this to the end of the sequence

    def auto_shape(self, target_arch: str) -> TreeShape:
        return TreeShape(4, 1, 5)

    def validate(self) -> None:
        super().validate()
        if self.min_gap < 1:
            raise ConfigError("speculative.min_gap", f"must be >= 1, got {self.min_gap}")


class BigramDrafter:
    def __init__(self, ctx):
        self.depth = ctx.shape.num_steps
        self.min_gap = ctx.config.min_gap

    def propose(self, seq: list[int]) -> list[int]:
        last = seq[-1]
        for i in range(len(seq) - 1 - self.min_gap, -1, -1):
            if seq[i] == last:
                return seq[i + 1 : i + 1 + self.depth]
        return []

    @hookimpl
    def specfw_draft(self, ctx, reqs):
        return [DraftCandidates.chain(self.propose(r.seq_ids)) for r in reqs]


@hookimpl
def specfw_register_algorithms(register):
    register("bigram", BigramConfig, BigramDrafter, "example plugin: copy what followed the last token before")

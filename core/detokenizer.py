"""Incremental detokenization with stop strings and safe streaming deltas."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Holds back text that could still turn into a stop string or an incomplete UTF-8 char."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped_by: str | None = None

    def update(self, output_ids: list[int]) -> bool:
        """Re-decode; returns True when a stop string appeared (text is cut before it)."""
        self.text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                self.stopped_by = s
                return True
        return False

    def delta(self, finished: bool) -> str:
        end = len(self.text)
        if not finished:
            end -= self.holdback
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

"""Incremental detokenization with stop strings and safe streaming deltas.

Each update decodes only the tokens after a frozen prefix, so a long generation costs O(new
tokens) per step rather than re-decoding everything. The prefix advances only where decoding is
verified to split cleanly there (whole UTF-8 characters; the same text as decoding across the
cut, which catches tokenizers that strip a leading space from the first decoded token)."""

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
        self.frozen_ids = 0  # output_ids[:frozen_ids] decode to frozen_text, for good
        self.frozen_text = ""

    FREEZE_EVERY = 32  # unfrozen tokens that trigger an attempt to advance the prefix
    KEEP_UNFROZEN = 8  # tokens left after the cut (multi-token characters, merges)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int]) -> bool:
        """Decode the new tokens; returns True when a stop string appeared (text is cut before it)."""
        tail = self._decode(output_ids[self.frozen_ids :])
        if len(output_ids) - self.frozen_ids >= self.FREEZE_EVERY:
            cut = len(output_ids) - self.KEEP_UNFROZEN
            head, rest = self._decode(output_ids[self.frozen_ids : cut]), self._decode(output_ids[cut:])
            if "\ufffd" not in head[-1:] and head + rest == tail:
                self.frozen_text += head
                self.frozen_ids = cut
                tail = rest
        self.text = self.frozen_text + tail
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
        out = self.text[self.sent : end]
        self.sent = end
        return out

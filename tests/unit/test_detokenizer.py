"""Incremental detokenization: the text and the streamed deltas equal a full decode, stop strings
are found across the frozen prefix, and tokenizers whose decode is not concatenative stay right."""

import random

import pytest

from specfw.detokenizer import IncrementalDetokenizer

TEXT = ("Speculative decoding 🚀 drafts tokens, then verifies them — 検証 in one forward. " * 6 + "Émile's café serves crème brûlée; ÷ ≠ ∞. ") * 2


@pytest.fixture(scope="module")
def tok(demo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


def _feed(detok, ids, chunk_sizes):
    out, n, deltas = [], 0, []
    rng = random.Random(0)
    while n < len(ids):
        n = min(len(ids), n + rng.choice(chunk_sizes))
        out = ids[:n]
        if detok.update(out):
            break
        deltas.append(detok.delta(False))
    deltas.append(detok.delta(True))
    return out, "".join(deltas)


@pytest.mark.parametrize("chunks", [[1], [1, 2, 3, 5]])
def test_text_and_deltas_equal_full_decode(tok, chunks):
    ids = tok(TEXT)["input_ids"]
    assert len(ids) > 3 * IncrementalDetokenizer.FREEZE_EVERY
    d = IncrementalDetokenizer(tok, [])
    _, streamed = _feed(d, ids, chunks)
    full = tok.decode(ids, skip_special_tokens=True)
    assert d.text == full and streamed == full
    assert d.frozen_ids > 0  # the prefix did advance: later steps decode only the tail


def test_stop_string_found_after_the_prefix_froze(tok):
    ids = tok(TEXT)["input_ids"]
    stop = "crème"
    d = IncrementalDetokenizer(tok, [stop])
    _, streamed = _feed(d, ids, [1, 4])
    full = tok.decode(ids, skip_special_tokens=True)
    assert d.stopped_by == stop and d.text == full[: full.index(stop)] and streamed == d.text
    assert d.frozen_ids > 0


class LeadingSpaceTokenizer:
    """SentencePiece-like decode: the first piece loses its leading space (not concatenative)."""

    pieces = [" the", " cat", " sat", ".", " on", " a", " mat", "\n"]

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.pieces[i] for i in ids)
        return text[1:] if text.startswith(" ") else text


def test_non_concatenative_decode_stays_exact():
    tok = LeadingSpaceTokenizer()
    ids = [random.Random(1).randrange(len(tok.pieces)) for _ in range(200)]
    d = IncrementalDetokenizer(tok, [])
    _, streamed = _feed(d, ids, [1, 3])
    assert d.text == tok.decode(ids) and streamed == d.text

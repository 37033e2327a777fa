"""Token strings/bytes for logprobs and the OpenAI chat / completions logprob layouts."""

from __future__ import annotations

import functools
import math
import re

from ..sampling import TokenLogprob

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (byte-level BPE token alphabet → byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Raw bytes and display string of single tokens (cached). Only uses read-only tokenizer calls."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = "ByteLevel" in repr(getattr(backend, "decoder", "")) if backend is not None else False
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            b = self._cache[token_id] = self._bytes(token_id)
        return b

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer.convert_ids_to_tokens(token_id)
        if tok is None:
            return b""
        if token_id in self.special:
            return tok.encode()
        m = _HEX_BYTE.match(tok)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level:
            dec = _byte_decoder()
            if all(c in dec for c in tok):
                return bytes(dec[c] for c in tok)
        return tok.replace("\u2581", " ").encode()

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top_n: int) -> list[dict]:
    """OpenAI chat ``logprobs.content`` items."""
    out = []
    for e in entries:
        out.append(
            {
                "token": texts.text(e.token_id),
                "logprob": _finite(e.logprob),
                "bytes": list(texts.bytes(e.token_id)),
                "top_logprobs": [{"token": texts.text(t), "logprob": _finite(lp), "bytes": list(texts.bytes(t))} for t, lp in e.top[:top_n]],
            }
        )
    return out


def completion_logprobs(entries: list[TokenLogprob], texts: TokenTexts, top_n: int, offset: int = 0) -> dict:
    """OpenAI completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset);
    ``offset`` is the completion text length before these tokens (text offsets are relative to
    the start of the completion)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = texts.text(e.token_id)
        tokens.append(s)
        lps.append(_finite(e.logprob))
        offsets.append(offset)
        offset += len(s)
        if top_n:
            top = {}
            for t, lp in e.top[:top_n]:
                top.setdefault(texts.text(t), _finite(lp))
            tops.append(top)
        else:
            tops.append(None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

"""How much text one token can stand for: the bound that lets a long text be judged (or cut)
by its bytes before it is tokenized, for prompts (`prompts.py`) and environment observations
(`envs/base.py`). Tokenizing a few megabytes whole took gigabytes."""

from __future__ import annotations

# A token's most bytes when the tokenizer does not list its vocabulary: more than the longest
# token of common vocabularies (runs of spaces or dashes).
FALLBACK_TOKEN_BYTES = 256


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the text bytes one token of `tokenizer` stands for: the longest entry
    of its vocabulary in UTF-8 (byte-level and sentencepiece spellings only overstate it), or
    FALLBACK_TOKEN_BYTES when it does not list one. So a text of more than n times this many
    bytes is more than n tokens, told without tokenizing it."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max(len(str(token).encode("utf-8", errors="replace")) for token in vocab)
    except Exception:  # no vocabulary to read (a stand-in tokenizer): the generous bound
        return FALLBACK_TOKEN_BYTES
    return max(longest, 1)

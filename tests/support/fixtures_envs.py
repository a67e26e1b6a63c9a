"""Tokenizers for the environment tests: a spy that records every call (to prove environments
encode only their own text and never decode the model's tokens), over a plain character
tokenizer or the tiny model's."""

import pytest


class CharTokenizer:
    """One id per character (its code point): enough for environments, and instant."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


class SpyTokenizer:
    def __init__(self, inner):
        self.inner = inner
        self.encoded: list[str] = []
        self.decoded: list[list[int]] = []

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(text)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, **kwargs):
        self.decoded.append(list(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.fixture
def spy():
    return SpyTokenizer(CharTokenizer())


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from eddyrl.models.tiny import build_tokenizer

    return build_tokenizer()

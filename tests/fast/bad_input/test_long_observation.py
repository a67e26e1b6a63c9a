"""An environment observation far longer than `env.max_observation_tokens`: judged by its
bytes, never tokenized whole; the episode ends as it did (`ended_by` max_observation_tokens),
and every observation that could fit gives the same tokens as tokenizing it whole."""

import asyncio
import random

import pytest

from eddyrl.envs import Action, Environment, EpisodeLimits, Reply
from eddyrl.token_bytes import max_token_bytes


class Counting:
    """A tokenizer that records how many characters it is given at each call."""

    def __init__(self, inner):
        self.inner, self.given = inner, []

    def encode(self, text, add_special_tokens=True):
        self.given.append(len(text))
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens))

    def get_vocab(self):
        return self.inner.get_vocab()


class ByteLevelBPE:
    """A small byte-level BPE (GPT-2 / Qwen's kind), trained here on a few sentences."""

    def __init__(self):
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        self.tokenizer = Tokenizer(models.BPE())
        self.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        corpus = ["the result of the tool is 42", "Traceback (most recent call last):",
                  "    print('hello world')  # ünïcödé and emoji 🙂"] * 50
        self.tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<|endoftext|>"], show_progress=False))

    def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def get_vocab(self):
        return self.tokenizer.get_vocab()


def char_tokenizer():
    from eddyrl.models.tiny import build_tokenizer  # the tiny model's: one token a character

    return build_tokenizer()


class Replies(Environment):
    def __init__(self, texts, **kwargs):
        super().__init__(prompt="p", answer="a", **kwargs)
        self.texts = list(texts)

    async def respond(self, action):
        return Reply(text=self.texts.pop(0), tool="python")


def observe(tokenizer, texts, limit):
    env = Replies(texts, tokenizer=tokenizer,
                  limits=EpisodeLimits(max_observation_tokens=limit, max_turns=100))
    observations = []
    for _ in texts:
        observations.append(asyncio.run(env.step(Action((1,), "turn"))))
        if observations[-1].done:
            break
    return observations


@pytest.mark.parametrize("make", [char_tokenizer, ByteLevelBPE], ids=["char", "byte-level-bpe"])
def test_long_environment_observation_is_cut_by_bytes_before_tokenizing(make):
    """Defect 5 of issue 32: an 8 MB observation was tokenized whole before the limit was
    applied (1 MB per episode peaked at 6.9 GB; 5 MB and 50 MB had the driver killed)."""
    tokenizer = Counting(make())
    limit = 256
    huge = "the result of the tool is 42\n" * 300_000  # 8.7 MB
    first, = observe(tokenizer, [huge], limit)
    assert (first.done, first.ended_by, first.token_ids) == (True, "max_observation_tokens", ())
    assert first.tool.payload_bytes == len(huge)  # still reported whole to the router
    assert all(given <= limit * max_token_bytes(tokenizer) for given in tokenizer.given)
    assert max(tokenizer.given, default=0) < 100_000


@pytest.mark.parametrize("make", [char_tokenizer, ByteLevelBPE], ids=["char", "byte-level-bpe"])
def test_an_observation_that_may_fit_is_tokenized_as_before(make):
    """Pinned to the straightforward path (tokenize whole, then end the episode if it is over
    the episode's tokens left) on texts around the limit, in bytes and in tokens, two turns
    an episode; the tokenizer is never given more than the bound."""
    inner, limit = make(), 40
    bound = limit * max_token_bytes(inner)
    rng = random.Random(0)
    pieces = ["the ", "result ", "42", "\n", "ü", "🙂", "Traceback", " ", "x"]
    texts = ["", "x" * (limit - 1), "x" * limit, "x" * (limit + 1), "x" * bound,
             "x" * (bound + 1), "🙂" * (bound // 4 + 1)]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 3 * limit)))
              for _ in range(60)]
    for first, second in zip(texts, texts[1:] + texts[:1]):
        tokenizer = Counting(inner)
        got = observe(tokenizer, [first, second], limit)
        expected, used = [], 0
        for text in (first, second):
            ids = tuple(inner.encode(text, add_special_tokens=False))
            if used + len(ids) > limit:
                expected.append(("max_observation_tokens", ()))
                break
            used += len(ids)
            expected.append((None, ids))
        assert [(o.ended_by, o.token_ids) for o in got] == expected, (first, second)
        assert all(given <= bound for given in tokenizer.given)

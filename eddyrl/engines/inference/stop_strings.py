"""Stop strings for the engines that run a real model (hf, vllm), defined once so that both stop
at the same token.

A request with `SamplingParams.stop_strings` ends with finish reason "stop" at the first
generated token whose text completes one of the strings. The engine still returns tokens, never
text: exactly the tokens it sampled, up to and including that one (whose text may run past the
string: a string can end inside a token). Only the text of the tokens generated since the request
started counts, not its prompt nor the tokens it resumed with: a multi-turn episode that resumes
from a transcript whose earlier turns ended on the same string is not stopped again at once.

The text is decoded incrementally with the model's own tokenizer, special tokens included: each
new token's text is the difference between decoding a short window that ends with it and the
same window without it (the window keeps a few tokens of left context, so that tokenizers which
join tokens with spaces or merge bytes decode as they would the whole sequence). A token whose
bytes end inside a multi-byte character adds no text until the character completes.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

Decode = Callable[[list[int]], str]

_CONTEXT = 5  # tokens of left context kept when decoding a new token's text
_PARTIAL = "\ufffd"  # what decoding yields for a character whose bytes are not all there yet


class StopStrings:
    """Watches one request's generated tokens for its stop strings."""

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        if any(not s for s in stops):
            raise ValueError(f"stop strings must not be empty: {list(stops)!r}")
        self.stops = tuple(stops)
        self.decode = decode
        self.text = ""  # text of the tokens pushed so far (up to a partial last character)
        self._ids: list[int] = []
        self._prefix = 0  # window start: context tokens whose text is already in `text`
        self._read = 0  # tokens whose text is in `text`

    def push(self, token: int) -> bool:
        """Add the next generated token; True when its text completes a stop string."""
        self._ids.append(token)
        before = self.decode(self._ids[self._prefix:self._read])
        window = self.decode(self._ids[self._prefix:])
        if len(window) <= len(before) or window.endswith(_PARTIAL):
            return False  # no complete new character yet
        start = max(0, len(self.text) - max(map(len, self.stops)) + 1)
        self.text += window[len(before):]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - _CONTEXT)
        return any(self.text.find(s, start) >= 0 for s in self.stops)


@functools.cache
def tokenizer_decode(model_path: str) -> Decode:
    """The model's tokenizer as a decode function (loaded once per process and model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return functools.partial(tokenizer.decode, skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)


def watcher(stops: Sequence[str], model_path: str) -> StopStrings | None:
    """A watcher for a request's stop strings, or None when it has none."""
    return StopStrings(stops, tokenizer_decode(model_path)) if stops else None

"""Stop strings matched on incrementally decoded text (stop_strings.py): pure logic with small
decode functions, milliseconds. The engines' behaviour is in test_engine_contract.py."""

import pytest

from eddyrl.engines.inference.stop_strings import StopStrings


def _bytes_decode(ids):
    """A byte-level tokenizer: token = one byte; a split character decodes to U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def _first_stop(stops, ids, decode=_bytes_decode):
    watch = StopStrings(stops, decode)
    for i, token in enumerate(ids):
        if watch.push(token):
            return i
    return None


def test_stops_at_the_token_that_completes_a_multi_token_string():
    ids = list(b"calc:12+3#done")
    assert _first_stop(["+3#"], ids) == ids.index(ord("#"))
    assert _first_stop(["+3#", "12"], ids) == ids.index(ord("2"))  # whichever completes first
    assert _first_stop(["nope"], ids) is None


def test_a_character_split_over_tokens_counts_once_complete():
    ids = list("é=é!".encode())  # é is two bytes
    assert _first_stop(["é!"], ids) == len(ids) - 1
    assert _first_stop(["=é"], ids) == 4  # the second byte of the second é completes it
    assert _first_stop(["\ufffd"], ids) is None  # a partial character is never text


def test_a_token_whose_text_runs_past_the_string_still_stops():
    vocab = {0: "ab", 1: "c#d", 2: "e"}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    assert _first_stop(["#"], [0, 1, 2], decode) == 1
    assert _first_stop(["bc"], [0, 1, 2], decode) == 1  # across the token boundary


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        StopStrings(["", "x"], _bytes_decode)

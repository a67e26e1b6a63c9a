"""Row formats: where a dataset keeps its prompt and its answer, and how a raw record becomes
the `{"prompt", "answer"}` row the prompt sets use.

Named presets follow the column layouts of public datasets:
- `plain`: `{"prompt": str, "answer": str}`, Eddy's own layout (the built-in task writes it).
- `gsm8k`: openai/gsm8k, `question` and `answer`, where `answer` is the worked solution ending
  in a line `#### <final answer>`; the row's answer is that final answer.
- `dapo_math`: BytedTsinghua-SIA/DAPO-Math-17k (verl's RL layout), `prompt` a list of chat
  messages `[{"role", "content"}]` and the answer at `reward_model.ground_truth`.

`data.fields` overrides a preset's field names; a dotted name (`reward_model.ground_truth`)
looks inside nested objects. A prompt is either a string (sent as one user turn) or a list of
chat messages, kept as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

def _as_is(answer: str) -> str | None:
    return answer


def gsm8k_final_answer(solution: str) -> str | None:
    """The text after the last `####` of a GSM8K solution (None when there is none)."""
    _, sep, tail = solution.rpartition("####")
    return tail.strip() if sep else None


@dataclass(frozen=True, slots=True)
class RowFormat:
    name: str
    prompt_field: str  # dotted path to the prompt: a string or a list of chat messages
    answer_field: str  # dotted path to the answer string
    final_answer: Callable[[str], str | None] = _as_is  # the gold answer inside that string
    answer_rule: str = ""  # what final_answer expects, for its error message


FORMATS: dict[str, RowFormat] = {
    "plain": RowFormat(name="plain", prompt_field="prompt", answer_field="answer"),
    "gsm8k": RowFormat(name="gsm8k", prompt_field="question", answer_field="answer",
                       final_answer=gsm8k_final_answer,
                       answer_rule="final line '#### <answer>'"),
    "dapo_math": RowFormat(name="dapo_math", prompt_field="prompt",
                           answer_field="reward_model.ground_truth"),
}


def row_format(name: str = "plain", prompt_field: str | None = None,
               answer_field: str | None = None) -> RowFormat:
    """The preset `name` with the field names given here in place of its own."""
    fmt = FORMATS[name]
    return replace(fmt, prompt_field=prompt_field or fmt.prompt_field,
                   answer_field=answer_field or fmt.answer_field)


class RowError(ValueError):
    """A bad record; the reader adds the file and row to the message."""


def lookup(record: dict, dotted: str) -> Any:
    """`record["a"]["b"]` for `"a.b"`; RowError naming the field when a step is missing."""
    value: Any = record
    parts = dotted.split(".")
    for depth, key in enumerate(parts):
        if not isinstance(value, dict):
            parent = ".".join(parts[:depth])
            raise RowError(f"field {parent!r} must be an object to hold {dotted!r}, got "
                           f"{type(value).__name__}")
        if key not in value:
            present = ", ".join(map(repr, list(value)[:12])) + (", ..." if len(value) > 12 else "")
            raise RowError(f"missing field {dotted!r} (fields there: {present or 'none'})")
        value = value[key]
    return value


def check_prompt(value: Any, field: str) -> str | list[dict]:
    """A prompt as data files hold it: a non-empty string (one user turn) or a list of chat
    messages `{"role": str, "content": str}` (RowError naming `field` otherwise)."""
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"field {field!r} is empty")
        return value
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else type(value).__name__
        raise RowError(f"field {field!r} must be str or a list of chat messages "
                       f"[{{'role': str, 'content': str}}], got {what}")
    for number, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            raise RowError(f"field {field!r}: message {number} must be an object "
                           f"{{'role', 'content'}}, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "nothing" if key not in message else type(message[key]).__name__
                raise RowError(f"field {field!r}: message {number} needs {key!r} as str, "
                               f"got {got}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _field(record: dict, fmt: RowFormat, role: str) -> Any:
    try:
        return lookup(record, getattr(fmt, f"{role}_field"))
    except RowError as error:
        fits = [other.name for other in FORMATS.values()
                if other.name != fmt.name and _has(record, other.prompt_field)
                and _has(record, other.answer_field)]
        hint = (f"; the row has the fields of format {fits[0]!r}: set data.format={fits[0]}"
                if fits else f"; format {fmt.name!r}: set data.fields.{role} if the rows keep "
                f"the {role} under another name")
        raise RowError(f"{error}{hint}") from None


def _has(record: dict, dotted: str) -> bool:
    try:
        lookup(record, dotted)
    except RowError:
        return False
    return True


def normalize(record: Any, fmt: RowFormat) -> dict:
    """`record` with its prompt and gold answer under "prompt" and "answer" (other fields are
    kept as they are); RowError naming the field on a missing field, a wrong type or an empty
    answer."""
    if not isinstance(record, dict):
        raise RowError(f"expected a JSON object (one per line), got {type(record).__name__}")
    prompt = check_prompt(_field(record, fmt, "prompt"), fmt.prompt_field)
    raw = _field(record, fmt, "answer")
    if not isinstance(raw, str):
        raise RowError(f"field {fmt.answer_field!r} must be str, got {type(raw).__name__}")
    answer = fmt.final_answer(raw)
    if answer is None:
        raise RowError(f"field {fmt.answer_field!r} has no {fmt.answer_rule} "
                       f"(format {fmt.name!r})")
    if not answer.strip():
        raise RowError(f"field {fmt.answer_field!r} is empty")
    return {**record, "prompt": prompt, "answer": answer.strip()}

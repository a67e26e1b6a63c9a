"""Writes the sample datasets next to this file: a few made-up problems in the column layouts of
openai/gsm8k (`question`, `answer` ending in `#### <final>`) and BytedTsinghua-SIA/DAPO-Math-17k
(verl's RL layout: `data_source`, `prompt` as chat messages, `ability`, `reward_model` with
`ground_truth` and `style`, `extra_info`), each as JSON lines and as Parquet.

    python tests/data/make_samples.py     # needs pyarrow for the .parquet files

The rows are written here, not downloaded; tests/fast/tasks/test_datasets.py checks that the shipped
files still hold exactly these rows.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (question, worked solution with GSM8K's <<calculator>> notes, final answer)
PROBLEMS = [
    ("A baker fills 12 trays with 8 rolls each and sells 70 rolls. How many rolls are left?",
     "The baker makes 12 * 8 = <<12*8=96>>96 rolls.\nAfter selling, 96 - 70 = <<96-70=26>>26 "
     "rolls are left.", "26"),
    ("Tom reads 15 pages a day for 6 days, then 20 pages on the seventh day. How many pages "
     "does he read that week?",
     "In six days he reads 15 * 6 = <<15*6=90>>90 pages.\nWith the seventh day it is "
     "90 + 20 = <<90+20=110>>110 pages.", "110"),
    ("A bike costs $240. Mia has saved a quarter of the price. How many more dollars does she "
     "need?",
     "She has saved 240 / 4 = <<240/4=60>>60 dollars.\nShe needs 240 - 60 = <<240-60=180>>180 "
     "more dollars.", "180"),
    ("A garden is 9 meters long and 7 meters wide. A path 1 meter wide runs around the "
     "outside of it. What is the area of the path in square meters?",
     "With the path the outer rectangle is 11 by 9, so 11 * 9 = <<11*9=99>>99 square meters.\n"
     "The garden is 9 * 7 = <<9*7=63>>63 square meters.\nThe path is 99 - 63 = <<99-63=36>>36 "
     "square meters.", "36"),
]

# DAPO-Math-17k's prompt wraps each problem in this instruction (and asks for "Answer:").
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response "
                 "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                 "answer to the problem.\n\n{question}\n\nRemember to put your answer on its own "
                 "line after \"Answer:\".")


def gsm8k_rows() -> list[dict]:
    return [{"question": q, "answer": f"{solution}\n#### {final}"}
            for q, solution, final in PROBLEMS]


def dapo_math_rows() -> list[dict]:
    return [{"data_source": "math_dapo",
             "prompt": [{"content": DAPO_TEMPLATE.format(question=q), "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": final, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"sample-{index:04d}"}}
            for index, (q, _, final) in enumerate(PROBLEMS)]


SAMPLES = {"gsm8k_sample": gsm8k_rows, "dapo_math_sample": dapo_math_rows}


def write_samples(directory: Path = HERE, parquet: bool = True) -> None:
    for name, rows_fn in SAMPLES.items():
        rows = rows_fn()
        with open(directory / f"{name}.jsonl", "w", encoding="utf-8") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
        if parquet:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), directory / f"{name}.parquet")


if __name__ == "__main__":
    write_samples()

"""Issue 34, item 6: what the model writes, where a user reads it. Before: no sampled response
reached the run directory, W&B or TensorBoard; the user loaded the checkpoint by hand. Here
the rows, their file and a resume cutting them; a whole run: test_samples_of_a_run.py."""

import json

from eddyrl.observability.samples import SamplesFile, markdown, sample_rows
from eddyrl.observability.sinks import Sinks
from eddyrl.protocol import GenerationResult, Group, Trajectory


def group(answer, reward):
    g = Group(f"g{answer}", f"add {answer}", answer, [1], 0)
    g.trajectories = [Trajectory(GenerationResult("r", [1], [ord("4"), ord("2")], [0.0, 0.0],
                                                  [0, 0], "stop"), reward=reward)]
    return g


def test_the_first_n_held_out_samples_go_to_samples_jsonl_with_their_step(tmp_path):
    rows = sample_rows([group("42", 1.0), group("7", 0.0), group("9", 0.0)],
                       lambda ids: "".join(map(chr, ids)), 2)
    assert rows == [{"prompt": "add 42", "response": "42", "answer": "42", "reward": 1.0},
                    {"prompt": "add 7", "response": "42", "answer": "7", "reward": 0.0}]
    sink = SamplesFile(tmp_path / "samples.jsonl")
    Sinks([sink]).samples(3, rows)
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(line["step"], line["answer"]) for line in lines] == [(3, "42"), (3, "7")]
    assert markdown(rows).splitlines()[2] == "| add 42 | 42 | 42 | 1 |"


def test_a_resume_cuts_the_samples_of_the_steps_it_takes_again(tmp_path):
    from eddyrl import resume
    from eddyrl.core.run_state import RunState

    (tmp_path / "samples.jsonl").write_text("".join(
        json.dumps({"step": s, "prompt": "p"}) + "\n" for s in (0, 0, 2, 2, 4, 4)))
    point = resume.ResumePoint(tmp_path / "checkpoints" / "step_000002", RunState(
        {"step": 2, "history": [{"step": s} for s in range(3)]}, {}, {}))
    moved_to = resume.begin(point, tmp_path)
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert steps == [0, 0, 2, 2]
    assert (moved_to / "samples.jsonl").read_text().count('"step": 4') == 2

"""Metric sinks: metrics.jsonl, TensorBoard event files (read back), W&B (offline only), and
the `observe` config section's errors."""

import json
import struct
import sys
from pathlib import Path

import pytest

from eddyrl.config import load_config
from eddyrl.errors import ConfigError
from eddyrl.observability import sinks
from eddyrl.observability.config import ObserveConfig

STEPS = [{"step": 0, "eval_accuracy": 0.25, "wall_s": 1.0},
         {"step": 1, "reward_mean": 0.5, "staleness_max": 1, "skipped": False,
          "staleness_counts": {"0": 12, "1": 4}, "elastic_states": {"1": "rollout"},
          "note": "text is left to metrics.jsonl", "wall_s": 3.5}]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from TensorBoard event files: TFRecord frames (length, crc, Event, crc)."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                number = value.simple_value if value.HasField("simple_value") \
                    else value.tensor.float_val[0]
                out.setdefault(value.tag, []).append((event.step, number))
    return out


def test_scalars_flattens_nested_numbers_and_drops_text():
    assert sinks.scalars(STEPS[1]) == {
        "step": 1.0, "reward_mean": 0.5, "staleness_max": 1.0, "skipped": 0.0,
        "staleness_counts/0": 12.0, "staleness_counts/1": 4.0, "wall_s": 3.5}


def test_jsonl_and_tensorboard_sinks_write_every_step(tmp_path):
    if sinks.summary_writer_class() is None:
        pytest.skip("neither tensorboard nor tensorboardX is installed")
    log = sinks.open_sinks(ObserveConfig(), tmp_path)
    assert log.names() == ["MetricsFile", "SamplesFile", "TensorBoardSink"]
    for metrics in STEPS:
        log(metrics)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == STEPS
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["eval_accuracy"] == [(0, 0.25)]
    assert scalars["reward_mean"] == [(1, 0.5)]
    assert scalars["staleness_counts/1"] == [(1, 4.0)]
    assert scalars["wall_s"] == [(0, 1.0), (1, 3.5)]
    assert "note" not in scalars and "step" not in scalars


def test_a_resumed_run_tells_tensorboard_to_drop_the_steps_it_runs_again(tmp_path):
    """After a resume from step 2, steps 3.. run again: the new event file starts with a
    session START at step 3, which makes TensorBoard discard the earlier file's steps >= 3."""
    if sinks.summary_writer_class() is None:
        pytest.skip("neither tensorboard nor tensorboardX is installed")
    try:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event, SessionLog
    (tmp_path / "metrics.jsonl").write_text("")
    log = sinks.open_sinks(ObserveConfig(), tmp_path, resumed_at=2)
    log({"step": 3, "reward_mean": 1.0})
    log.close()
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        events.append(Event.FromString(data[pos + 12:pos + 12 + length]))
        pos += 12 + length + 4
    starts = [e.step for e in events if e.session_log.status == SessionLog.START]
    assert starts == [3]


def test_tensorboard_off_or_missing(tmp_path, monkeypatch):
    assert sinks.open_sinks(ObserveConfig(tensorboard=False), tmp_path).names() == \
        ["MetricsFile", "SamplesFile"]
    monkeypatch.setattr(sinks, "summary_writer_class", lambda: None)
    other = tmp_path / "b"
    other.mkdir()
    assert sinks.open_sinks(ObserveConfig(samples=0), other).names() == ["MetricsFile"]  # auto
    third = tmp_path / "c"
    third.mkdir()
    with pytest.raises(ConfigError, match=r"observe.tensorboard = true needs tensorboard or "
                       r"tensorboardX: pip install 'eddyrl\[observe\]'"):
        sinks.open_sinks(ObserveConfig(tensorboard=True), third)
    # refused before metrics.jsonl exists: the directory is not marked as holding a run
    assert not (third / "metrics.jsonl").exists()


def test_wandb_without_the_package_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match="observe.wandb_project = 'p' needs the wandb "
                       "package"):
        sinks.open_sinks(ObserveConfig(tensorboard=False, wandb_project="p"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_wandb_offline_logs_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = sinks.open_sinks(ObserveConfig(tensorboard=False, wandb_project="eddy-test"),
                           tmp_path, {"seed": 3})
    assert log.names() == ["MetricsFile", "SamplesFile", "WandbSink"]
    run = log.sinks[1].run
    assert run.config["seed"] == 3 and run.name == tmp_path.name
    for metrics in STEPS:
        log(metrics)
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_observe_config_errors_name_the_key():
    config = load_config(overrides=["observe.tensorboard=false", "observe.trace=false"])
    assert config.observe.tensorboard is False and config.observe.trace is False
    with pytest.raises(ConfigError, match="'observe.wandb_entity' = 'me' is set but "
                       "'observe.wandb_project' is not"):
        load_config(overrides=["observe.wandb_entity=me"])
    with pytest.raises(ConfigError, match="'observe.wandb_project' = ' ' is empty"):
        load_config(overrides=["observe.wandb_project=' '"])
    with pytest.raises(ConfigError, match="did you mean 'observe.trace'"):
        load_config(overrides=["observe.traces=false"])


def test_the_wandb_samples_table_has_a_column_per_weighted_reward():
    rows = [{"prompt": "1+1", "response": "2", "answer": "2", "reward": 1.1,
             "rewards": {"correct": 1.0, "format": 0.5}},
            {"prompt": "2+2", "response": "5", "answer": 4, "reward": 0.1,
             "rewards": {"correct": 0.0, "format": 0.5}}]
    columns, data = sinks.samples_table(rows)
    assert columns == ["prompt", "response", "answer", "reward", "reward/correct",
                       "reward/format"]
    assert data[1] == ["2+2", "5", "4", 0.1, 0.0, 0.5]
    plain = [{"prompt": "p", "response": "r", "answer": "a", "reward": 1.0}]
    assert sinks.samples_table(plain) == (["prompt", "response", "answer", "reward"],
                                          [["p", "r", "a", 1.0]])

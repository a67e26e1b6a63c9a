"""Where a run's step metrics go: always `metrics.jsonl`; TensorBoard and W&B when configured
(`observe` section). Each sink takes one step's metrics dict (the controller's `log` callback)
and is closed at the end of the run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError
from ..run_dir import open_append
from .config import ObserveConfig
from .samples import SAMPLES, SamplesFile, markdown


class MetricsFile:
    """Appends one JSON object per line; flushed each step so a crash loses nothing logged."""

    def __init__(self, path: Path) -> None:
        self.file = open_append(path)  # never through a link (run_dir.py)

    def __call__(self, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps(metrics, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def scalars(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers among a step's metrics, nested dicts flattened to `a/b` (env/calls/...,
    staleness_counts/1); text and lists are left to metrics.jsonl."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            out.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):  # bools too: 0 / 1
            out[f"{prefix}{key}"] = float(value)
    return out


def summary_writer_class() -> type | None:
    """TensorBoard's writer: torch's (needs the `tensorboard` package), else tensorboardX's
    (much smaller: protobuf and numpy only); None when neither is installed."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
        return SummaryWriter
    except ImportError:
        pass
    try:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    except ImportError:
        return None


class TensorBoardSink:
    """Every numeric metric as a scalar at its step, in `<run_dir>/tensorboard`. A resumed
    run starts a new event file that tells TensorBoard to drop the earlier file's steps from
    `purge_step` on (they run again), as metrics.jsonl drops their lines."""

    def __init__(self, writer_class: type, log_dir: Path, purge_step: int | None = None
                 ) -> None:
        self.writer = writer_class(log_dir=str(log_dir), purge_step=purge_step)

    def __call__(self, metrics: dict[str, Any]) -> None:
        step = int(metrics.get("step", 0))
        for tag, value in scalars(metrics).items():
            if tag != "step":
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # steps are seconds apart: a crash loses nothing logged

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        self.writer.add_text("samples", markdown(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def samples_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of the W&B samples table: the text columns, the reward, and one column
    per reward of `data.rewards` (`reward/<name>`) when the rows carry their parts."""
    parts = list(dict.fromkeys(name for row in rows for name in (row.get("rewards") or {})))
    columns = ["prompt", "response", "answer", "reward", *(f"reward/{n}" for n in parts)]
    data = [[str(row["prompt"]), str(row["response"]), str(row["answer"]), row["reward"],
             *((row.get("rewards") or {}).get(n) for n in parts)] for row in rows]
    return columns, data


class WandbSink:
    """A W&B run named after the run directory, the resolved config as its config."""

    def __init__(self, config: ObserveConfig, run_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"observe.wandb_project = {config.wandb_project!r} needs the "
                              "wandb package: pip install wandb (or set observe.wandb_project "
                              "= null)") from None
        self.run = wandb.init(project=config.wandb_project, entity=config.wandb_entity,
                              dir=str(run_dir), name=run_dir.name, config=run_config)

    def __call__(self, metrics: dict[str, Any]) -> None:
        values = scalars(metrics)
        step = int(values.pop("step", 0))
        self.run.log(values, step=step)

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(*samples_table(rows))
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """All of a run's sinks as one `log` callback."""

    def __init__(self, sinks: list[Callable[[dict[str, Any]], None]]) -> None:
        self.sinks = sinks

    def __call__(self, metrics: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink(metrics)

    def samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        """Held-out samples to every sink that keeps them (observability/samples.py)."""
        for sink in self.sinks:
            if hasattr(sink, "samples"):
                sink.samples(step, rows)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def names(self) -> list[str]:
        return [type(sink).__name__ for sink in self.sinks]


def open_sinks(config: ObserveConfig, run_dir: Path, run_config: dict[str, Any] | None = None,
               resumed_at: int | None = None) -> Sinks:
    """TensorBoard and W&B as configured, then metrics.jsonl. A sink asked for explicitly whose
    package is missing is a ConfigError raised before metrics.jsonl exists (which would mark
    the directory as holding a run). `resumed_at`: the checkpoint's step a resumed run goes
    on from."""
    sinks: list[Any] = []
    try:
        if config.tensorboard is not False:
            writer = summary_writer_class()
            if writer is not None:
                sinks.append(TensorBoardSink(writer, run_dir / "tensorboard", None
                                             if resumed_at is None else resumed_at + 1))
            elif config.tensorboard:
                raise ConfigError("observe.tensorboard = true needs tensorboard or tensorboardX:"
                                  " pip install 'eddyrl[observe]' (or set observe.tensorboard "
                                  "= false)")
        if config.wandb_project is not None:
            sinks.append(WandbSink(config, run_dir, run_config or {}))
    except BaseException:
        Sinks(sinks).close()
        raise
    files: list[Any] = [MetricsFile(run_dir / "metrics.jsonl")]
    if config.samples:
        files.append(SamplesFile(run_dir / SAMPLES))
    return Sinks([*files, *sinks])

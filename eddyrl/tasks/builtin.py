"""The built-in synthetic tasks that `data.task` names (`tasks/config.py` TASKS), generated
into the run's data folder when no data files are given: how each one's splits are written and
which reward scores it."""

from __future__ import annotations

from pathlib import Path

from . import arith, cipher, tool_task
from .config import ARITH_REWARD, CIPHER_REWARD

# name -> (write_splits(out_dir, seed, train_count, eval_count, config), its config, the reward
# that scores its answers as data.reward_fn names it)
BUILTIN_TASKS = {
    "arith": (arith.write_splits, arith.ArithTaskConfig(), ARITH_REWARD),
    "cipher": (cipher.write_splits, cipher.CipherTaskConfig(), CIPHER_REWARD),
    "tool_add": (tool_task.write_splits, tool_task.ToolTaskConfig(), ARITH_REWARD),
}


def write_builtin_splits(name: str, out_dir: Path, seed: int, train_count: int,
                         eval_count: int) -> tuple[Path, Path]:
    """The built-in task `name`'s train and eval files in `out_dir` (deterministic in seed)."""
    write, config, _ = BUILTIN_TASKS[name]
    return write(out_dir, seed, train_count, eval_count, config)

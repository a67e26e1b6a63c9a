"""Nothing in a checkpoint is loaded with pickle: the controller's run state loads with pickle
switched off, and no module of the package imports pickle or calls `torch.load` without
`weights_only=True`. (The trainer's files: test_no_pickle_trainer_checkpoint.py.)"""

import re
from pathlib import Path

import torch
from pickle_guard import no_pickle  # noqa: F401 (a fixture)

from eddyrl.core import run_state

PACKAGE = Path(__file__).resolve().parents[3] / "eddyrl"


def test_run_state_loads_with_pickle_off(tmp_path, no_pickle):
    meta = {"format": run_state.FORMAT, "step": 1, "seed": 0, "data": {}, "window": {},
            "replay": {}, "next_group_id": 0, "reward_errors": 0, "history": [], "rng": {}}
    state = run_state.RunState(meta, {"step": 1, "groups": {}},
                               {"rng.torch": torch.get_rng_state()})
    run_state.write(tmp_path, state)
    back = run_state.read(tmp_path)
    assert torch.equal(back.tensors["rng.torch"], state.tensors["rng.torch"])


# The user-code pool hands calls and results to the worker processes it started itself over a
# socketpair, by pickle (SECURITY.md: a process worker isolates crashes and hangs of the run's
# own reward and environment code, not hostile code). Nothing there reads a file or a socket
# anyone else can write.
PICKLES_TO_ITS_OWN_CHILDREN = {"usercode"}


def test_the_package_never_unpickles():
    for path in PACKAGE.rglob("*.py"):
        code = path.read_text()
        if path.relative_to(PACKAGE).parts[0] in PICKLES_TO_ITS_OWN_CHILDREN:
            assert not re.search(r"\bopen\(|\.load\(", code), path  # no file, ever
            continue
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib)\b", code, re.M), path
        for call in re.finditer(r"torch\.load\(", code):
            window = code[call.end():call.end() + 300]
            assert "weights_only=True" in window.split(")\n")[0], f"{path}: {window[:80]}"

"""Joining and leaving the default group through the HAL prints nothing: torch 2.13 leaves the
group's default backend type unnamed when a backend plugin is registered (importing FSDP
registers its `fake` one), and its `destroy_process_group` then warned "No backend of type 0"
into every run's progress bar (`Platform._name_default_backend`)."""

import subprocess
import sys

SCRIPT = """
import tempfile, torch.distributed as dist
import torch.distributed.fsdp  # registers torch's `fake` backend plugin: the path that warned
from eddyrl.hal import get_platform
assert dist.Backend._plugins, "no plugin registered: this check would not test the torch path"
platform = get_platform("cpu")
with tempfile.TemporaryDirectory() as folder:
    platform.init_process_group(0, 1, f"file://{folder}/rendezvous", 30, local=True)
    assert dist.group.WORLD._get_backend_name() == "gloo"
    dist.destroy_process_group()
print("left the group")
"""


def test_leaving_the_group_prints_no_backend_warning():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "left the group" in done.stdout
    assert "No backend of type" not in done.stderr, done.stderr

"""Eddy: RL post-training of LLMs, one program on NVIDIA GPUs, Ascend NPUs and CPUs."""

import os as _os

__version__ = "0.1.0"

# Host compute threads sleep when they wait, in every Eddy process (driver, Ray workers, user
# code), unless the user chose otherwise. GNU OpenMP (PyTorch's CPU thread pool) spins a waiting
# thread for a while by default; on a machine doing other work that spinning takes the CPU
# from the thread everyone waits for: with two busy loops beside a 2-core run, a train step
# took a median 12.6 s spinning and 1.26 s with GOMP_SPINCOUNT=0 (0.59 s and 0.58 s on the
# quiet machine; bench/profile_step.py, bench/results/README.md). Set here because OpenMP reads
# it once, when torch is first imported, and every Eddy process imports this package first.
_os.environ.setdefault("GOMP_SPINCOUNT", "0")

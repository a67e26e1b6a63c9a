"""Eddy: RL post-training of LLMs, one program on NVIDIA GPUs, Ascend NPUs and CPUs."""

__version__ = "0.1.0"

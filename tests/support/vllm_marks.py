"""Shared by the vLLM engine tests: whether vLLM is installed, and the mark that skips a test
needing it where it is not."""

import importlib.util

import pytest

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM_INSTALLED, reason="vLLM is not installed")

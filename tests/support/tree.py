"""Where the test tree is, for tests that start processes: those processes import the
helpers of tests/support (`reward_fixtures` names a run's reward) by name, so it goes on their
PYTHONPATH."""

from pathlib import Path

SUPPORT_DIR = str(Path(__file__).resolve().parent)
TESTS_DIR = str(Path(__file__).resolve().parents[1])
REPO_ROOT = str(Path(__file__).resolve().parents[2])

"""The README's two commands are what CI runs and what a user types: keep them in step."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line for line in lines if line.startswith("python3 -m venv .venv")]


def test_readme_has_the_two_commands():
    main_job, tests = _commands()[:2]
    assert main_job.endswith("&& eddy train") and "pip install torch==2.13.0" in main_job
    assert tests.endswith("&& python -m pytest -q -n 2") and "pip install torch==2.13.0" in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    setup, _, test = _commands()[1].rpartition(" && ")
    assert setup in ci and f"\n{test}\n" in ci

"""The ``tensortier`` command as a newcomer meets it: ``python -m tensortier`` (no console script
needed), ``--help`` that says what each command does and what its options default to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tensortier
from tensortier.cli import main

SRC = os.path.dirname(os.path.dirname(tensortier.__file__))  # this tensortier, not an installed one


def _python_m(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "tensortier", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_python_m_tensortier_runs_the_command():
    """It failed: "No module named tensortier.__main__"."""
    done = _python_m("--help")
    assert done.returncode == 0, done.stderr
    assert "usage: tensortier" in done.stdout and "{demo,plan,catalog}" in done.stdout
    done = _python_m("no-such-command")
    assert done.returncode == 2 and "invalid choice" in done.stderr


@pytest.mark.parametrize(
    "command, default",
    [
        (["demo"], "GPT blocks (default: 8)"),
        (["plan"], "blocks (default: 6)"),
        (["catalog", "build"], "(default: 2)"),
    ],
)
def test_each_command_help_says_what_it_does_and_its_defaults(command, default, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert default in out, out
    if len(command) == 1:  # the one-line summary of `tensortier --help`, as the command's own
        assert out.split("options:")[0].strip().endswith(".")

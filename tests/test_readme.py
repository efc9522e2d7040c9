"""README.md as a newcomer's front door: CI runs its install line and test command as written, it stays short,
every `zoo` command it or `zoo quickstart` suggests exists, and the manual's command list names every command and
option the parser has."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from zoo.cli import build_parser
from zoo.cli.app import next_steps
from zoo.config import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _lines_starting(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_readme_has_one_install_line_and_one_test_command() -> None:
    """.ci/run greps these two lines out of README.md: a second one, or none, would make it run something else."""
    assert len(_lines_starting(README, "pip install ")) == 1
    assert len(_lines_starting(README, "pytest ")) == 1


def test_ci_runs_readmes_lines_and_installs_nothing_of_its_own() -> None:
    """CI runs README's install line and test command verbatim and installs the project no other way, so a test that
    needs an extra fails in CI exactly when it fails after a newcomer's install."""
    (install,) = _lines_starting(README, "pip install ")
    (test,) = _lines_starting(README, "pytest ")
    commands = [line.strip() for line in CI.splitlines() if not line.strip().startswith("#")]
    assert [c for c in commands if re.match(r"(python3? -m )?pip3? install", c)] == [install]
    assert [c.split(" 2>&1")[0] for c in commands if c.startswith("pytest")] == [test]


def test_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 200
    for doc in re.findall(r"`(docs/[\w.-]+\.md)`", README):
        assert (ROOT / doc).is_file(), doc


def _zoo_commands(text: str) -> list[list[str]]:
    """The `zoo ...` command lines of a text's code blocks and of its lines, comments dropped."""
    found = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("zoo "):
            found.append(shlex.split(line)[1:])
    return found


SUGGESTED = _zoo_commands(README) + _zoo_commands("\n".join(next_steps(Settings.load(None, "/tmp/zoo-data"))))


@pytest.mark.parametrize("args", SUGGESTED, ids=" ".join)
def test_every_command_readme_and_quickstart_suggest_parses(args: list[str]) -> None:
    """A suggested command that the parser refuses is the first thing a newcomer meets."""
    parser = build_parser()
    parser.exit_on_error = False
    parsed = parser.parse_args(args)
    assert parsed.func is not None


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's long options, and its sub-commands' as `NAME:--option`."""
    found = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            found += [f"{name}:{o}" for name, sub in a.choices.items() for o in _options(sub)]
    return found


def test_the_manual_lists_every_command_and_option() -> None:
    """docs/commands.md's command list is where a user looks an option up: none may be missing from it."""
    manual = (ROOT / "docs" / "commands.md").read_text()
    block = manual.split("```")[1]
    lines = [line.split("#", 1)[0] for line in block.splitlines() if line.startswith("zoo ")]
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name, sub in commands.choices.items():
        text = " ".join(line for line in lines if line.split()[1] == name)
        if not text:
            missing.append(name)
        missing += [f"{name} {o}" for o in _options(sub) if o.split(":")[-1] not in text]
    assert not missing, f"docs/commands.md does not list: {', '.join(missing)}"

"""README.md as a newcomer's front door: CI runs its install line and test command as written, it stays short,
every `zoo` command it or `zoo quickstart` suggests exists, and the manual (docs/commands.md) names every command
and option the parser has, and none it lacks."""

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


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's sub-commands by name (`zoo jobs add`'s `add` under `jobs`), none when it has none."""
    found = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(found[0].choices) if found else {}


MANUAL = (ROOT / "docs" / "commands.md").read_text()


def test_every_command_but_serve_takes_json() -> None:
    """README promises `--json` on every command but `zoo serve`: for scripts, one JSON answer instead of text."""
    lacking = []
    for name, sub in _subcommands(build_parser()).items():
        for verb, leaf in (_subcommands(sub) or {"": sub}).items():
            if "--json" not in [o for a in leaf._actions for o in a.option_strings]:
                lacking.append(f"{name} {verb}".strip())
    assert "all but `zoo serve` take `--json`" in README
    assert lacking == ["serve"]


def test_the_manual_lists_every_command_and_option() -> None:
    """docs/commands.md's command list is where a user looks an option up: no command, sub-command (`zoo jobs add`)
    or option may be missing from it."""
    block = MANUAL.split("```")[1]
    lines = [line.split("#", 1)[0] for line in block.splitlines() if line.startswith("zoo ")]
    missing = []
    for name, sub in _subcommands(build_parser()).items():
        text = " ".join(line for line in lines if line.split()[1] == name)
        if not text:
            missing.append(name)
        missing += [f"{name} {verb}" for verb in _subcommands(sub) if not re.search(rf"(?<![\w-]){verb}(?![\w-])", text)]
        missing += [f"{name} {o}" for o in _options(sub) if o.split(":")[-1] not in text]
    assert not missing, f"docs/commands.md does not list: {', '.join(missing)}"


#: Programs other than zoo whose options the manual quotes (`docker compose run --rm`, `ray start --head`).
OTHER_PROGRAMS = {"python", "python3", "pip", "pytest", "docker", "ray", "curl", "bash", "gunicorn", "nginx", "git"}


def _code(text: str) -> list[str]:
    """The lines of a text's fenced blocks (comments dropped) and its inline code spans."""
    parts = text.split("```")
    found = [line.split("#", 1)[0] for part in parts[1::2] for line in part.splitlines()]
    return found + [span for part in parts[0::2] for span in re.findall(r"`([^`\n]+)`", part)]


def _named_options(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])--[a-z][\w-]*", text)


def test_the_manual_names_no_option_the_parser_lacks() -> None:
    """An option the manual names must be one the parser takes: in a `zoo COMMAND ...` line, one of that command's
    (or a global one); in prose, one of some command's. A renamed or removed option shows up here."""
    parser = build_parser()
    commands = _subcommands(parser)
    global_options = {o for o in _options(parser) if ":" not in o} | {"--help"}
    any_command = global_options | {o.split(":")[-1] for o in _options(parser)}
    wrong = []
    for code in _code(MANUAL):
        words = code.split()
        if not words or words[0] in OTHER_PROGRAMS:
            continue
        allowed = any_command
        if words[0] == "zoo":
            name = next((w for w in words[1:] if w in commands), None)
            allowed = global_options | ({o.split(":")[-1] for o in _options(commands[name])} if name else set())
        wrong += [f"{code.strip()!r}: {o}" for o in _named_options(code) if o not in allowed]
    prose = re.sub(r"`[^`\n]+`", "", "".join(MANUAL.split("```")[0::2]))
    wrong += [f"prose: {o}" for o in _named_options(prose) if o not in any_command]
    assert not wrong, "docs/commands.md names options the parser does not take:\n" + "\n".join(wrong)

"""Every ``fedcond`` command the README, docs/ and experiments/ show runs as written.

Commands are read from fenced code blocks and inline code of the Markdown files, and from comments of
the TOML files. Those that would train run with ``--dry-run`` (every setting checked, the plan
printed, nothing started, nothing written); the rest run for real in a copy of ``experiments/``: ``list``,
``export-partitions`` (digits), ``report`` of a committed results folder (whose regenerated tables
must equal the committed ones). The checkout's record tooling (tools/, not installed) shown as
``python -m tools.reproduction ...`` runs too: its output must equal the committed ``REPRODUCTION.md``
and README byte for byte. A ``report`` of a folder a documented ``compare`` or ``sweep`` would write
first is checked against that command. Templates (``key=value ...``, ``<run folder>``) are not commands.
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from fedcond.tools.cli import main
from tools import reproduction

ROOT = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("run", "compare", "sweep", "report", "list", "settings", "deploy-local", "export-partitions")
#: The checkout's tools (``python -m tools.<name> ...``) whose documented commands run, and their mains.
TOOLS = {"tools.reproduction": reproduction.main}
TRAINS = ("run", "compare", "sweep", "deploy-local")
TEMPLATE = re.compile(r"<[^>]*>|\.\.\.|key=value|KEY=VALUE")
#: How a documented command begins: the installed command, or a module of the checkout's tools.
PROGRAMS = ("fedcond ", "python -m tools.")


def kind_of(command: str) -> str:
    """A fedcond command's subcommand (``report``), or the tools module it runs (``tools.reproduction``)."""
    words = command.split()
    return words[2] if command.startswith("python -m ") else words[1]


def arguments_of(command: str) -> list[str]:
    """The words its main reads: a subcommand's, with the subcommand first; a tools module's."""
    words = shlex.split(command)
    return words[3:] if command.startswith("python -m ") else words[1:]


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in sorted((ROOT / "experiments").rglob("*")):
        if path.suffix in (".md", ".toml") and "results" not in path.relative_to(ROOT).parts:
            found.append(path)
    return found


def _commands_in_lines(lines: list[str]) -> list[str]:
    """``fedcond ...`` and ``python -m tools....`` lines, backslash continuations joined, trailing
    ``# comments`` dropped."""
    commands, pending = [], ""
    for raw in lines:
        line = raw.strip()
        if pending:
            line = pending + " " + line
            pending = ""
        elif not line.startswith(PROGRAMS):
            continue
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        commands.append(re.sub(r"\s+#.*$", "", line).strip())
    return commands


def commands_of(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".toml":
        comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
        return [c[c.index("fedcond ") :] for c in comments if re.search(r"fedcond (" + "|".join(SUBCOMMANDS) + ")", c)]
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL)
    found = [command for block in blocks for command in _commands_in_lines(block.splitlines())]
    outside = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for span in re.findall(r"`((?:fedcond |python -m tools\.)[^`]+)`", outside.replace("\n", " ")):
        # "`fedcond report`" and "`python -m tools.docs`" name a command; only spans with their
        # arguments are commands to run.
        program = 3 if span.startswith("python -m ") else 2
        if len(span.split()) > program or kind_of(span) in ("run", "list", "settings"):
            found.append(span)
    return found


def documented() -> list[tuple[str, str]]:
    pairs = []
    for path in documents():
        for command in commands_of(path):
            if len(command.split()) > 1 and kind_of(command) in (*SUBCOMMANDS, *TOOLS) and not TEMPLATE.search(command):
                pairs.append((str(path.relative_to(ROOT)), command))
    return pairs


DOCUMENTED = documented()


def test_the_docs_show_commands_of_every_kind():
    kinds = {kind_of(command) for _, command in DOCUMENTED}
    assert kinds == {*SUBCOMMANDS, *TOOLS}, kinds


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def produced_by_a_documented_command(document: str, folder: str) -> bool:
    return any(
        where == document and kind_of(command) in ("compare", "sweep") and _option(command.split(), "--out") == folder
        for where, command in DOCUMENTED
    )


#: What a run folder holds beside its history.csv and run.json: never committed, never read by a report.
RUN_STATE = ("checkpoint.pt", "*.log")


#: Commands that write into the checkout (a report's tables, a reproduction, exported partitions): each
#: gets a copy of its own. The others read only, and share one copy per test process: 1,500 files copied
#: and removed again for each of 150 commands cost minutes and GBs of the suite's temporary folder.
WRITES = ("report", "export-partitions", *TOOLS)


def _copy_the_checkout_into(folder: Path) -> Path:
    """Commands run where a user types them, the checkout's root: here a copy of what they read.
    Without the runs' checkpoints, which no documented command reads (a --dry-run plans from run.json):
    a checkout that has run the sweeps holds hundreds of MB of them."""
    shutil.copytree(ROOT / "experiments", folder / "experiments", ignore=shutil.ignore_patterns(*RUN_STATE))
    shutil.copy(ROOT / "README.md", folder / "README.md")  # the reproduction rewrites its verdict lines
    return folder


def _state_of(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="session")
def shared_copy(tmp_path_factory) -> Path:
    return _copy_the_checkout_into(tmp_path_factory.mktemp("checkout"))


def _where_it_runs(command: str, shared_copy: Path, tmp_path: Path) -> Path:
    return _copy_the_checkout_into(tmp_path) if kind_of(command) in WRITES else shared_copy


@pytest.mark.parametrize(("document", "command"), DOCUMENTED, ids=[f"{d}: {c}" for d, c in DOCUMENTED])
def test_a_documented_command_runs_as_written(document, command, shared_copy, tmp_path, monkeypatch, capsys):
    checkout = _where_it_runs(command, shared_copy, tmp_path)
    monkeypatch.chdir(checkout)
    # A Flower home of its own: `fedcond stop-superlink` must not end the user's local SuperLink.
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    before = _state_of(checkout)
    words = arguments_of(command)
    subcommand = kind_of(command)
    if subcommand in TRAINS:
        words.append("--dry-run")
    elif subcommand == "export-partitions":
        words[words.index("--out") + 1] = str(checkout / "partitions")
    elif subcommand == "report":
        folder = words[1]
        if not Path(folder).is_dir():
            assert produced_by_a_documented_command(document, folder), f"{folder} is neither committed nor written"
            return
    status = TOOLS[subcommand](words) if subcommand in TOOLS else main(words)
    printed = capsys.readouterr()
    assert status == 0, printed.err
    if subcommand not in WRITES:  # a dry run, a list, the settings: nothing written where they ran
        assert _state_of(checkout) == before, f"{command} wrote into the checkout"
    if subcommand == "report":  # the committed tables are what their data says
        for name in ("summary.md", "tables.md"):
            committed = ROOT / words[1] / name
            if committed.is_file():
                assert (Path(words[1]) / name).read_text() == committed.read_text(), f"{words[1]}/{name} is stale"
    if subcommand == "tools.reproduction":
        out = words[words.index("--out") + 1]
        written = [out] + [words[words.index("--readme") + 1]] * ("--readme" in words)
        for path in written:
            assert Path(path).read_text() == (ROOT / path).read_text(), f"{path} does not regenerate byte-identical"


COMMITTED = sorted(path.parent for path in (ROOT / "experiments" / "results").glob("*/experiment.json"))


@pytest.mark.slow
@pytest.mark.parametrize("folder", COMMITTED, ids=lambda path: path.name)
def test_every_committed_results_folder_regenerates_its_tables_from_its_runs(folder, tmp_path, capsys):
    """``fedcond report`` over a copy of the folder gives back its committed tables word for word:
    every number in them comes from the runs' history.csv and run.json beside them."""
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(*RUN_STATE))
    main(["report", str(copy)])  # 1 where the folder lists runs that did not finish: still reported
    capsys.readouterr()
    for name in ("metrics.csv", "summary.md", "tables.md"):
        if (folder / name).is_file():
            assert (copy / name).read_text() == (folder / name).read_text(), f"{folder.name}/{name} is stale"

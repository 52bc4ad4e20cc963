"""Every run knows the code it ran: run.json's commit and uncommitted changes, and the reports' notes."""

import json
import subprocess
from pathlib import Path

from fedcond.config import RunConfig
from fedcond.records.history import RunRecorder
from fedcond.records.provenance import CODE, checkout_code, code_version, describe
from fedcond.tools.report import provenance_lines

ROOT = Path(__file__).resolve().parents[1]


def git(folder: Path, *arguments: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *arguments], capture_output=True, text=True, check=True).stdout


def test_the_commit_and_uncommitted_changes_of_the_code_paths_alone(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "fedcond").mkdir()
    (tmp_path / "fedcond" / "model.py").write_text("WIDTH = 1\n")
    (tmp_path / "notes.md").write_text("a\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    commit = git(tmp_path, "rev-parse", "HEAD").strip()
    assert checkout_code(tmp_path) == {"commit": commit, "dirty": False}
    (tmp_path / "notes.md").write_text("b\n")  # docs and results change no run
    (tmp_path / "fedcond" / "new_results.csv").write_text("x\n")  # untracked: not code a run imports
    assert checkout_code(tmp_path) == {"commit": commit, "dirty": False}
    (tmp_path / "fedcond" / "model.py").write_text("WIDTH = 2\n")
    assert checkout_code(tmp_path) == {"commit": commit, "dirty": True}
    assert describe(checkout_code(tmp_path)) == commit[:7] + "+changes"
    # Not a checkout's top (an install from a wheel inside some other repository, or none at all).
    assert checkout_code(tmp_path / "fedcond") == {"commit": None, "dirty": None}
    assert describe(None) == "unknown"


def test_a_run_records_its_code_and_a_resume_its_own(tmp_path):
    expected = git(ROOT, "rev-parse", "HEAD").strip()
    assert code_version()["commit"] == expected and isinstance(code_version()["dirty"], bool)
    config = RunConfig(results_dir=str(tmp_path), run_name="r")
    folder = tmp_path / "r"
    folder.mkdir()
    RunRecorder(folder, config, {}, 1, []).close()
    info = json.loads((folder / "run.json").read_text())
    assert info[CODE] == code_version()
    info[CODE] = {"commit": "0" * 40, "dirty": False}  # as if made by an older commit
    (folder / "run.json").write_text(json.dumps(info))
    RunRecorder.reopen(folder, config, 1, [], {"from_round": 1}).close()
    resumed = json.loads((folder / "run.json").read_text())
    assert resumed[CODE] == {"commit": "0" * 40, "dirty": False} and resumed["resumed"][-1][CODE] == code_version()


def rows(code_by_run: dict[tuple[str, str], str]) -> list[dict[str, str]]:
    return [
        {"method": method, "seed": seed, "round": "1", "accuracy": "0.5", "code": code}
        for (method, seed), code in code_by_run.items()
    ]


def test_a_table_says_when_its_runs_come_from_several_versions_or_uncommitted_code():
    same = rows({("fedavg", "0"): "a1b2c3d", ("oracle", "0"): "a1b2c3d"})
    assert provenance_lines(same) == []
    assert provenance_lines(rows({("fedavg", "0"): "", ("oracle", "0"): ""})) == []  # older runs: nothing known
    mixed = rows({("fedavg", "0"): "a1b2c3d", ("oracle", "0"): "e4f5a6b+changes", ("oracle", "1"): ""})
    assert provenance_lines(mixed) == [
        "These runs come from 3 versions of the code (run.json's code): a1b2c3d: fedavg seed 0; "
        "e4f5a6b+changes: oracle seed 0; unknown (recorded before runs knew their commit): oracle seed 1.",
        "Made from code with uncommitted changes: oracle seed 0.",
    ]

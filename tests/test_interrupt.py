"""An interruption is never data: Ctrl+C (SIGINT to the whole process group, as a terminal sends it) or
SIGTERM stops a compare without recording the round under way, leaves no process and no ``running``
run.json, and the same command resumes to the uninterrupted history (``fedcond.stopping``).

The slow test starts a small digits compare (``tests/interrupted_compare.py``) in a
session of its own and stops it at three moments, each reached deterministically: while Ray starts
(SIGTERM to the compare alone, as ``kill`` sends it), mid-round (Ctrl+C to the group; a worker dies
by the signal before the compare handles it), and while a checkpoint is written (Ctrl+C); the unit
tests check the rule itself in this process.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fedcond import stopping
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.methods import run_config
from fedcond.federation.participation import FIT, RoundParticipation
from fedcond.records.checkpoint import CHECKPOINT_FILE, Checkpoint, load_checkpoint, save_checkpoint
from fedcond.records.history import RoundRecord, RunRecorder, mark_stopped, run_status
from fedcond.tools.experiment import STOPPED, PlannedRun, run_one
from tests.interrupted_compare import PAUSE_RUN, PAUSES, SIGNALLED

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["compare", "--dataset", "digits", "--methods", "fedavg", "--num-clusters", "2",
           "--clients-per-cluster", "2", "--rounds", "3", "local-epochs=1"]  # fmt: skip
RUNS = ("method-fedavg_seed-0",)
# Every process a compare of this test starts inherits it: none may be left behind unseen.
MARK = "FEDCOND_TEST_INTERRUPT"
TIMES = ("seconds", "elapsed_seconds")  # the only columns a resumed run's history may differ in


@pytest.fixture
def no_stop_under_way():
    """A stop requested by a unit test is over when it ends (the event is process-wide)."""
    stopping.STOPPING.clear()
    yield
    stopping.STOPPING.clear()
    stopping.SIGTERM_RECEIVED.clear()


# -- the rule, in this process -----------------------------------------------------------------------
def row(number: int) -> RoundRecord:
    return RoundRecord(round=number, accuracy=0.5, loss=1.0, train_loss=1.0, seconds=1.0, elapsed_seconds=1.0,
                       bytes_down=0, bytes_up=0)  # fmt: skip


def test_once_a_stop_is_requested_no_failure_row_run_json_or_checkpoint_is_recorded(tmp_path, no_stop_under_way):
    config = run_config({"results-dir": str(tmp_path), "run-name": "run", "verbose": False, "live-curves": False})
    folder = tmp_path / "run"
    folder.mkdir()
    recorder = RunRecorder(folder, config, {}, 2)
    record = row(1)
    recorder.add(record)
    save_checkpoint(folder, Checkpoint(1, [record]))
    participation = RoundParticipation(2, [0, 1])
    stopping.request()
    with pytest.raises(stopping.Interrupted):
        participation.fail(FIT, 0, "ActorDiedError: the actor died")
    assert participation.counts()["clients_failed"] == 0
    with pytest.raises(stopping.Interrupted):
        recorder.add(row(2))
    with pytest.raises(stopping.Interrupted):
        recorder.add_events("failures", [{"round": 2}])
    with pytest.raises(stopping.Interrupted):
        save_checkpoint(folder, Checkpoint(2, [record]))
    assert load_checkpoint(folder).round == 1 and not (folder / f".{CHECKPOINT_FILE}.tmp").exists()
    assert [row["round"] for row in csv.DictReader((folder / "history.csv").open())] == ["1"]
    mark_stopped(folder)
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "stopped" and info["failures"] == []
    assert run_status(folder) == STOPPED
    recorder.close()


def test_a_write_in_progress_when_the_stop_comes_ends_before_the_run_says_stopped(tmp_path, no_stop_under_way):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"status": "running"}))
    writing, release = threading.Event(), threading.Event()

    def write() -> None:
        with stopping.committing("run.json"):
            writing.set()
            release.wait(5)
            (folder / "run.json").write_text(json.dumps({"status": "running", "late": True}))

    writer = threading.Thread(target=write)
    writer.start()
    writing.wait(5)
    stopping.request()
    marker = threading.Thread(target=mark_stopped, args=(folder,))
    marker.start()
    time.sleep(0.2)
    assert json.loads((folder / "run.json").read_text())["status"] == "running"  # it waits for the write
    release.set()
    writer.join()
    marker.join()
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "stopped" and info["late"] is True


class DeadWorker:
    """A node whose Ray worker died (as Flower's grid proxy words it), or whose client raised."""

    cid = "node"

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def fit(self, ins: object, timeout: object, group_id: object) -> None:
        raise ValueError(f"Message contains an Error (reason: {self.reason}). It originated during client-side ...")


ACTOR_DIED = "<class 'ray.exceptions.ActorDiedError'>:<'The actor died unexpectedly before finishing this task.'>"
CLIENT_RAISED = "<class 'flwr.clientapp.client_app.ClientAppException'>:<'Message: CUDA out of memory'>"


def test_a_dead_worker_seen_just_before_the_stop_is_the_stops_and_a_clients_own_error_stays_a_failure(
    no_stop_under_way, monkeypatch
):
    monkeypatch.setattr(stopping, "SETTLE_SECONDS", 1.0)
    with stopping.handlers(), stopping.remote_clients():
        # The worker died by the signal; this process requests the stop a moment later.
        participation = RoundParticipation(2, [0, 1])
        threading.Timer(0.2, stopping.request).start()
        started = time.monotonic()
        with pytest.raises(stopping.Interrupted):
            PartitionProxy(DeadWorker(ACTOR_DIED), 0, participation, FIT).fit(None, None, None)  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.9 and participation.counts()["clients_failed"] == 0
        stopping.STOPPING.clear()
        # No stop comes: a worker that died on its own is a failure, once the moment has passed.
        with pytest.raises(ValueError):
            PartitionProxy(DeadWorker(ACTOR_DIED), 1, participation, FIT).fit(None, None, None)  # type: ignore[arg-type]
        # A client that raised is its own failure, recorded at once.
        started = time.monotonic()
        with pytest.raises(ValueError):
            PartitionProxy(DeadWorker(CLIENT_RAISED), 0, participation, FIT).fit(None, None, None)  # type: ignore[arg-type]
        assert time.monotonic() - started < 0.5
    assert participation.counts()["clients_failed"] == 2
    assert [failure.reason for failure in participation.failures][1] == "CUDA out of memory"


def test_a_stop_makes_the_run_stopped_whatever_the_runner_raises_or_returns(tmp_path, no_stop_under_way):
    planned = PlannedRun("run", RunConfig(), {})

    def interrupted(config: RunConfig) -> None:
        raise KeyboardInterrupt

    def errs_during_the_stop(config: RunConfig) -> None:
        stopping.request()
        raise RuntimeError("Simulation Runtime crashed.")

    def returns_during_the_stop(config: RunConfig) -> None:
        stopping.request()

    for runner in (interrupted, errs_during_the_stop, returns_during_the_stop):
        stopping.STOPPING.clear()
        (tmp_path / "run").mkdir(exist_ok=True)
        (tmp_path / "run" / "run.json").write_text(json.dumps({"status": "running"}))
        with pytest.raises(KeyboardInterrupt):
            run_one(runner, planned, tmp_path)
        assert run_status(tmp_path / "run") == STOPPED, runner.__name__

    def fails(config: RunConfig) -> None:
        raise FedcondError("a genuine failure")

    stopping.STOPPING.clear()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"status": "running"}))
    run_one(fails, planned, tmp_path)
    assert run_status(tmp_path / "run") == "failed: a genuine failure"


# -- Ctrl+C to a real compare ------------------------------------------------------------------------
def compare(tmp_path: Path, out: Path, moment: str = "none", pause_run: str = "") -> subprocess.Popen[str]:
    """The compare of COMMAND into ``out``, in a session of its own (its process group: Ray's too)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), MARK: str(out), PAUSES: str(tmp_path / "pauses"),
                   PAUSE_RUN: pause_run, "FLWR_HOME": str(tmp_path / "flwr")}  # fmt: skip
    (tmp_path / "pauses").mkdir(exist_ok=True)
    log = (tmp_path / f"{out.name}-{moment}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.interrupted_compare", moment, *COMMAND, "--out", str(out)],
        cwd=tmp_path, env=environment, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def output(tmp_path: Path, out: Path, moment: str) -> str:
    return (tmp_path / f"{out.name}-{moment}.log").read_text()


def left_behind(out: Path, group: int) -> list[str]:
    """Live processes the compares into ``out`` started: in the compare's process group, or carrying MARK."""
    found = []
    for process in psutil.process_iter(["environ", "name", "status"], ad_value=None):
        try:
            ours = (process.info["environ"] or {}).get(MARK) == str(out) or os.getpgid(process.pid) == group
        except (ProcessLookupError, PermissionError):
            continue
        if ours and process.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            found.append(f"{process.pid} {process.info['name']}")
    return found


#: How a stop reaches a compare: a terminal's Ctrl+C (SIGINT to its whole process group, Ray's
#: processes included), or ``kill`` / a scheduler (SIGTERM to its process alone); the exit status of each.
CTRL_C, KILL = "ctrl-c", "kill"
EXIT_STATUS = {CTRL_C: 130, KILL: 143}


def interrupt(tmp_path: Path, out: Path, moment: str, pause_run: str = "", how: str = CTRL_C) -> str:
    """Run the compare to ``moment``, stop it there (``how``), and check how it ends: its exit status
    with its one line, nothing left within 30 s, no run.json ``running``; its output."""
    process = compare(tmp_path, out, moment, pause_run)
    paused = tmp_path / "pauses" / moment
    deadline = time.monotonic() + 300
    while not paused.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert paused.exists(), f"{moment} never reached:\n{output(tmp_path, out, moment)[-3000:]}"
    if how == CTRL_C:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGTERM)
    (tmp_path / "pauses" / SIGNALLED).touch()
    try:
        returncode = process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"{moment}: the compare did not stop within 120 s of its {how}")
    (tmp_path / "pauses" / SIGNALLED).unlink()
    text = output(tmp_path, out, moment)
    assert returncode == EXIT_STATUS[how], f"{moment}: exit {returncode}\n{text[-3000:]}"
    assert "fedcond: stopped (Ctrl+C or SIGTERM)" in text and "run the same command again" in text
    deadline = time.monotonic() + 30
    while left_behind(out, process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_behind(out, process.pid) == [], moment
    statuses = {run: run_status(out / "runs" / run) for run in RUNS}
    assert "running" not in statuses.values(), statuses
    return text


def rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "history.csv").open() as handle:
        return [{key: value for key, value in row.items() if key not in TIMES} for row in csv.DictReader(handle)]


def failures(folder: Path) -> list[object]:
    return json.loads((folder / "run.json").read_text())["failures"]


@pytest.mark.slow
@pytest.mark.ray
def test_a_stop_while_ray_starts_mid_round_and_while_a_checkpoint_is_written_records_nothing_and_resumes(tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "out"
    uninterrupted = compare(tmp_path, straight)  # the history to resume to, meanwhile
    (run,) = (out / "runs" / name for name in RUNS)

    # 1. While Ray starts (its GCS up, its raylet not yet), by SIGTERM to the compare alone (as `kill`
    # or a scheduler sends it): nothing ran, nothing is left, Ray's processes included.
    interrupt(tmp_path, out, "ray-start", how=KILL)
    assert run_status(run) == STOPPED and not (run / CHECKPOINT_FILE).exists()

    # 2. Mid-round: partition 0's worker dies in round 2's fit, seen before the compare handles its
    # Ctrl+C. Round 2 is dropped: no failure, no row of it, the checkpoint still round 1's.
    interrupt(tmp_path, out, "fit-2")
    assert run_status(run) == STOPPED and load_checkpoint(run).round == 1
    assert failures(run) == [] and all(row["round"] == "1" for row in rows(run))
    assert all(row["clients_failed"] == "0" for row in rows(run))

    # 3. While the resumed run writes round 2's checkpoint: the round it ends is dropped too.
    interrupt(tmp_path, out, "checkpoint-2")
    assert run_status(run) == STOPPED
    assert load_checkpoint(run).round == 1 and not (run / f".{CHECKPOINT_FILE}.tmp").exists()
    assert all(int(row["round"]) < 2 for row in rows(run))

    # The same command again resumes to the uninterrupted history, failure counts included.
    resumed = compare(tmp_path, out)
    assert resumed.wait(timeout=600) == 0, output(tmp_path, out, "none")[-3000:]
    assert uninterrupted.wait(timeout=600) == 0, output(tmp_path, straight, "none")[-3000:]
    reference = straight / "runs" / run.name
    assert run_status(run) == "finished"
    assert rows(run) == rows(reference) and failures(run) == [] == failures(reference)
    notes = json.loads((run / "run.json").read_text())["resumed"]
    # Resumed twice: after the mid-round stop and after the checkpoint one (stopped before round 1
    # ended, the first stop left no checkpoint, so the run after it started afresh).
    assert len(notes) == 2 and all(note["previous_status"] == STOPPED for note in notes), notes


def test_each_compare_tags_its_processes_anew_and_leaves_the_callers_tag_as_it_was(tmp_path, monkeypatch):
    """A stop ends the processes carrying its compare's tag: a tag inherited from whoever started the
    compare (a process that ran one before, a compare beside it) would end theirs too."""
    from fedcond.tools import cli

    seen: list[str] = []
    monkeypatch.setattr(cli, "run_experiment", lambda *args, **kwargs: seen.append(os.environ[cli.STOP_TAG_VARIABLE]))
    monkeypatch.setattr(cli, "report", lambda out: 0)
    monkeypatch.setenv(cli.STOP_TAG_VARIABLE, "another-compare")
    for name in ("a", "b"):
        assert cli.main(["compare", "--methods", "fedavg", "--out", str(tmp_path / name), "num-server-rounds=1"]) == 0
    assert len(seen) == 2 and "another-compare" not in seen and seen[0] != seen[1]
    assert os.environ[cli.STOP_TAG_VARIABLE] == "another-compare"

"""Ctrl+C at a dozen moments of a small compare: how it stops, what it leaves, and how it resumes.

    python benchmarks/interrupt_trials.py --out results/interrupt             # 12 trials, then the table
    python benchmarks/interrupt_trials.py --out DIR --trials 0,5               # some of them
    python benchmarks/interrupt_trials.py --out DIR --table                    # the table, from DIR

A trial starts ``fedcond compare`` (digits, ``fedavg,conditional``, 2 clusters x 2 clients, 4 rounds)
in a session of its own and sends SIGINT to its whole process group, as a terminal's Ctrl+C does, at
one moment: while Ray starts (its GCS process is up), or so many seconds after the run's Ray actors
appeared (they take the clients' messages from then on), in the first run or the second. Then it
checks what issue 65 asks of a stop: the exit status (130, or 1 with one line saying why), the
processes of the compare left 30 s after it exited (its process group, and every process carrying
this script's mark in its environment), that no ``run.json`` says ``running``, and that the same
command run again exits 0 with histories equal to an uninterrupted compare's (every column of
``history.csv`` but the two timing ones, and no failures in ``run.json``). The moment a signal hits
is what the clock gives (no hooks: the product as users run it); each row says what was under way.

Results go to ``OUT/trials.json`` (one entry per trial) and ``OUT/trials.md`` (the table); each
trial's folder and output stay in ``OUT/trial-<n>/``, the uninterrupted compare in ``OUT/straight``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["compare", "--dataset", "digits", "--methods", "fedavg,conditional", "--num-clusters", "2",
           "--clients-per-cluster", "2", "--rounds", "4"]  # fmt: skip
RUNS = ("method-fedavg_seed-0", "method-conditional_seed-0")
TIMES = ("seconds", "elapsed_seconds")
MARK = "FEDCOND_INTERRUPT_TRIAL"
#: Trial by trial: (run 0 or 1, what to wait for, then seconds more). ``ray``: its Ray's GCS process is
#: up; ``actors``: its Ray actors appeared (they start, then take the clients' messages before round
#: 1); ``row``: its history.csv has round 1's row (written in round 2, with evaluate-in-fit).
MOMENTS: list[tuple[int, str, float]] = [
    (0, "ray", 0.0), (0, "actors", 3.0), (0, "row", 0.0), (0, "row", 1.5), (0, "row", 3.0), (0, "row", 4.5),
    (1, "ray", 0.0), (1, "actors", 3.0), (1, "row", 0.0), (1, "row", 1.5), (1, "row", 3.0), (1, "row", 4.5),
]  # fmt: skip
ANCHORS = {"ray": "while its Ray starts", "actors": "its actors up", "row": "round 1's row written"}


@dataclass
class Trial:
    number: int
    moment: str
    exit_status: int
    last_line: str
    left_after_30s: int
    running_run_json: int
    under_way: str
    resumed_exit_status: int
    resumed_equal: bool
    detail: str = ""


def environment(out: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), MARK: str(out), "FLWR_HOME": str(out.parent / "flwr")}


def start(out: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "fedcond.tools.cli", *COMMAND, "--out", str(out)], cwd=out.parent,
            env=environment(out), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def ours(out: Path, group: int) -> list[psutil.Process]:
    """Live processes of the compare into ``out``: in its process group, or carrying its mark."""
    found = []
    for process in psutil.process_iter(["environ", "status"], ad_value=None):
        try:
            mine = (process.info["environ"] or {}).get(MARK) == str(out) or os.getpgid(process.pid) == group
        except (ProcessLookupError, PermissionError):
            continue
        if mine and process.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
            found.append(process)
    return found


def named(processes: list[psutil.Process], name: str) -> list[psutil.Process]:
    found = []
    for process in processes:
        try:
            if name in process.name() or name in " ".join(process.cmdline()[:2]):
                found.append(process)
        except psutil.Error:
            continue
    return found


def wait_for_moment(process: subprocess.Popen[bytes], out: Path, run: int, anchor: str, after: float) -> bool:
    """Wait for ``anchor`` of run ``run`` (``MOMENTS``), then ``after`` seconds; False when the compare
    ended first. A later run's Ray is the one that starts once the runs before it finished and their
    Ray was shut down."""
    earlier_gone = run == 0
    while process.poll() is None:
        processes = ours(out, process.pid)
        if not earlier_gone:
            finished = all(run_status(out / "runs" / name) == "finished" for name in RUNS[:run])
            earlier_gone = finished and not named(processes, "gcs_server")
        elif (
            (anchor == "ray" and named(processes, "gcs_server"))
            or (anchor == "actors" and named(processes, "ClientAppActor"))
            or (anchor == "row" and history(out / "runs" / RUNS[run]))
        ):
            time.sleep(after)
            return process.poll() is None
        time.sleep(0.05)
    return False


def run_status(folder: Path) -> str:
    try:
        return str(json.loads((folder / "run.json").read_text()).get("status", "missing"))
    except (OSError, ValueError):
        return "missing"


def history(folder: Path) -> list[dict[str, str]]:
    try:
        with (folder / "history.csv").open() as handle:
            return [{key: value for key, value in row.items() if key not in TIMES} for row in csv.DictReader(handle)]
    except FileNotFoundError:
        return []


def under_way(out: Path) -> str:
    """What the stop left: the run that says ``stopped``, its last checkpoint and the failures its
    run.json records; else which runs had finished (the stop came between runs, or after them)."""
    import torch

    for number, name in enumerate(RUNS, start=1):
        folder = out / "runs" / name
        if run_status(folder) != "stopped":
            continue
        checkpoint = folder / "checkpoint.pt"
        done = int(torch.load(checkpoint, weights_only=True)["round"]) if checkpoint.exists() else 0
        failures = len(json.loads((folder / "run.json").read_text()).get("failures", []))
        saved = f"checkpoint of round {done}" if done else "no checkpoint yet"
        return f"run {number} stopped: {saved}, {failures} failures recorded"
    finished = [
        str(number) for number, name in enumerate(RUNS, start=1) if run_status(out / "runs" / name) == "finished"
    ]
    if len(finished) == len(RUNS):
        return "no run stopped: both had finished their rounds"
    return f"no run stopped: between runs (run {', '.join(finished)} finished)" if finished else "no run started"


def trial(number: int, base: Path, straight: Path) -> Trial:
    run, anchor, after = MOMENTS[number]
    moment = f"run {run + 1}, {ANCHORS[anchor]}" + (f" + {after:g} s" if after else "")
    folder = base / f"trial-{number}"
    out, log = folder / "out", folder / "output.log"
    folder.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    process = start(out, log)
    if not wait_for_moment(process, out, run, anchor, after):
        return Trial(number, moment, process.wait(), "", 0, 0, "finished before the moment", -1, False, "missed")
    os.killpg(process.pid, signal.SIGINT)
    try:
        status = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        status = -9
    deadline = time.monotonic() + 30
    while ours(out, process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = ours(out, process.pid)
    for leftover in left:  # counted, then ended: the next trial starts clean
        leftover.kill()
    lines = [line for line in log.read_text().splitlines() if line.startswith("fedcond:")]
    running = sum(run_status(out / "runs" / name) == "running" for name in RUNS)
    interrupted = under_way(out)
    resumed = start(out, log).wait(timeout=1200)
    equal = all(
        run_status(out / "runs" / name) == "finished"
        and history(out / "runs" / name) == history(straight / "runs" / name)
        and json.loads((out / "runs" / name / "run.json").read_text())["failures"] == []
        for name in RUNS
    )
    return Trial(number, moment, status, lines[-1] if lines else "", len(left), running, interrupted, resumed, equal,
                 "; ".join(f"{p.pid}" for p in left))  # fmt: skip


def table(trials: list[Trial]) -> str:
    rows = [
        "| trial | moment (SIGINT to the group) | exit | what the stop left | left after 30 s | run.json running | "
        "rerun exit | resumed = uninterrupted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in sorted(trials, key=lambda t: t.number):
        rows.append(
            f"| {t.number} | {t.moment} | {t.exit_status} | {t.under_way} | {t.left_after_30s} | "
            f"{t.running_run_json} | {t.resumed_exit_status} | {'yes' if t.resumed_equal else 'NO'} |"
        )
    return "\n".join(rows)


HEADER = (
    "# Ctrl+C at a dozen moments of a compare\n\n"
    f"`python benchmarks/interrupt_trials.py`: `fedcond {' '.join(COMMAND)}` in a session of its own, SIGINT to its "
    "process group at each moment; then the same command again, compared with an uninterrupted compare "
    '(`history.csv` but its time columns, and `run.json`\'s failures). "left after 30 s": processes of the '
    "group, or carrying the trial's mark, alive 30 s after the compare exited.\n\n"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--trials", default=",".join(map(str, range(len(MOMENTS)))), help="e.g. 0,5")
    parser.add_argument("--table", action="store_true", help="print the table of OUT's trials, run nothing")
    arguments = parser.parse_args()
    base = arguments.out.resolve()
    record = base / "trials.json"
    done = {t["number"]: Trial(**t) for t in json.loads(record.read_text())} if record.exists() else {}
    if not arguments.table:
        base.mkdir(parents=True, exist_ok=True)
        straight = base / "straight"
        unfinished = not all(run_status(straight / "runs" / name) == "finished" for name in RUNS)
        if unfinished and start(straight, base / "straight.log").wait() != 0:
            print(f"the uninterrupted compare failed; see {base / 'straight.log'}", file=sys.stderr)
            return 1
        for number in (int(part) for part in arguments.trials.split(",")):
            done[number] = trial(number, base, straight)
            print(table([done[number]]).splitlines()[-1], flush=True)
            record.write_text(json.dumps([asdict(t) for t in sorted(done.values(), key=lambda t: t.number)], indent=1))
    text = table(list(done.values()))
    (base / "trials.md").write_text(HEADER + text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-round history and the run's results folder (``history.csv``, ``run.json``).

One folder per run, written as the run goes: an interrupted run leaves every finished round on disk.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import platform
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from fedcond import stopping
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.records import locks
from fedcond.records.live_curves import EVENT_FILE_PREFIX, LIVE_CURVES, LiveCurves
from fedcond.records.provenance import CODE, code_version

HISTORY_COLUMNS = (
    "round", "accuracy", "loss", "train_loss", "seconds", "elapsed_seconds", "bytes_down", "bytes_up", "ari",
    "heldout_accuracy", "epsilon", "clients_asked", "clients_answered", "clients_failed", "clients_timed_out",
    "clients_evaluated",
    "worst_accuracy", "p10_accuracy", "accuracy_std",
    "heldout_worst_accuracy", "heldout_p10_accuracy", "heldout_accuracy_std", "heldout_adapted_accuracy",
    "drifted_accuracy", "validation_accuracy", "heldout_validation_accuracy",
)  # fmt: skip
#: The fairness columns (fedcond.records.metrics.Spread), for the training clients and then the held-out ones.
SPREAD_COLUMNS = (
    "worst_accuracy", "p10_accuracy", "accuracy_std", "heldout_worst_accuracy", "heldout_p10_accuracy",
    "heldout_accuracy_std",
)  # fmt: skip
#: The validation columns (``validation-fraction``): the round's model on the training clients' and the
#: held-out clients' validation shares, NaN without validation.
VALIDATION_COLUMNS = ("validation_accuracy", "heldout_validation_accuracy")
#: The score's name in memory: every column above that says "accuracy" holds the task's score, which
#: on a regression task is RMSE (``DatasetSpec.metric``) and is written and shown under that name.
SCORE = "accuracy"


def column_on_disk(column: str, metric: str) -> str:
    """A history or tidy column as files and reports name it: ``worst_accuracy`` -> ``worst_rmse``."""
    return column.replace(SCORE, metric)


def row_on_disk(row: dict[str, Any], metric: str) -> dict[str, Any]:
    return row if metric == SCORE else {column_on_disk(key, metric): value for key, value in row.items()}


def row_in_memory(row: dict[str, str], metric: str) -> dict[str, str]:
    """A row read from a file of a ``metric`` task with the score columns under their in-memory names."""
    return row if metric == SCORE else {key.replace(metric, SCORE): value for key, value in row.items()}


def dataset_metric(dataset: str) -> str:
    """The score's name for ``dataset`` (accuracy; a regression task's rmse); accuracy for names not known."""
    from fedcond.data.datasets import DATASETS

    spec = DATASETS.get(dataset)
    return spec.metric if spec is not None else SCORE


PACKAGES = ("fedcond", "flwr", "torch", "torchvision", "numpy", "scikit-learn", "ray")


@dataclass(frozen=True)
class RoundRecord:
    """What one round produced, aggregated over clients (sample-weighted means)."""

    round: int
    accuracy: float
    loss: float
    train_loss: float
    seconds: float
    elapsed_seconds: float
    bytes_down: int
    bytes_up: int
    cluster_accuracy: dict[int, float] = field(default_factory=dict)
    # Adjusted Rand Index of the clients' model choices against the true clusters (IFCA), else NaN.
    ari: float = float("nan")
    # Sample-weighted accuracy of the held-out clients (never trained), NaN when there are none.
    heldout_accuracy: float = float("nan")
    # Sample-level DP: the largest cumulative epsilon (at dp-delta) any client reported this round;
    # NaN without sample-level DP, inf when only the fingerprint is private (docs/privacy.md).
    epsilon: float = float("nan")
    # Who took part (fedcond.federation.participation): answered + failed + timed out = asked.
    clients_asked: int = 0
    clients_answered: int = 0
    clients_failed: int = 0
    clients_timed_out: int = 0
    # The training clients whose evaluations make the round's score: all of them, or (clients-per-round
    # between evaluate-every rounds) the sample that scored it, less any whose evaluation did not come.
    clients_evaluated: int = 0
    # Fairness over the clients that evaluated (fedcond.records.metrics.Spread): the worst client's accuracy,
    # the 10th percentile and the standard deviation, each client counting once; NaN when none did.
    worst_accuracy: float = float("nan")
    p10_accuracy: float = float("nan")
    accuracy_std: float = float("nan")
    # The same over the held-out clients (newcomers).
    heldout_worst_accuracy: float = float("nan")
    heldout_p10_accuracy: float = float("nan")
    heldout_accuracy_std: float = float("nan")
    # The held-out clients' accuracy after newcomer-steps local steps on the model they were served
    # (fedcond.newcomers), sample-weighted; NaN without newcomer-steps.
    heldout_adapted_accuracy: float = float("nan")
    # The drifting clients' sample-weighted accuracy (fedcond.data.drift), every round; NaN without drift.
    drifted_accuracy: float = float("nan")
    # With validation-fraction: the same model's sample-weighted accuracy on the training clients' and
    # the held-out clients' validation shares (what settings are chosen on); NaN without.
    validation_accuracy: float = float("nan")
    heldout_validation_accuracy: float = float("nan")

    @staticmethod
    def columns(num_clusters: int) -> list[str]:
        """The ``history.csv`` header: the fixed columns, then one accuracy column per cluster."""
        return [*HISTORY_COLUMNS, *(f"accuracy_cluster_{cluster}" for cluster in range(num_clusters))]

    def progress_line(self, num_rounds: int, metric: str = SCORE) -> str:
        """The one terminal line a round prints (``metric``: what the score is, ``DatasetSpec.metric``)."""
        held = f"  held-out {self.heldout_accuracy:.4f}" if not math.isnan(self.heldout_accuracy) else ""
        epsilon = f"  epsilon {self.epsilon:.3g}" if not math.isnan(self.epsilon) else ""
        # Said only when someone did not answer: a full round needs no remark.
        missing = self.clients_asked - self.clients_answered
        answered = f"  answered {self.clients_answered}/{self.clients_asked}" if missing > 0 else ""
        return (
            f"round {self.round:>3}/{num_rounds}  {metric} {self.accuracy:.4f}  loss {self.loss:.4f}{held}{epsilon}"
            f"{answered}  "
            f"{self.seconds:5.1f} s"
        )

    def as_row(self, num_clusters: int) -> dict[str, Any]:
        row: dict[str, Any] = {column: getattr(self, column) for column in HISTORY_COLUMNS}
        for cluster in range(num_clusters):
            row[f"accuracy_cluster_{cluster}"] = self.cluster_accuracy.get(cluster, float("nan"))
        return row


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def default_run_name(config: RunConfig) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (
        f"{config.method}-{config.dataset}-{config.scenario}-k{config.num_clusters}"
        f"-n{config.clients_per_cluster}-s{config.seed}-{stamp}"
    )


def results_base(config: RunConfig) -> Path:
    """The folder run folders go in: ``results-dir``, else ``./results``; absolute."""
    return (Path(config.results_dir).expanduser() if config.results_dir else Path.cwd() / "results").resolve()


def unused_run_folder(config: RunConfig) -> Path:
    """Where this run's folder goes: absolute, and never an existing run's folder."""
    base = results_base(config)
    name = config.run_name or default_run_name(config)
    folder, suffix = base / name, 1
    while folder.exists():
        suffix += 1
        folder = base / f"{name}-{suffix}"
    return folder


def results_folder(config: RunConfig) -> Path:
    """The run's own folder, created."""
    folder = unused_run_folder(config)
    folder.mkdir(parents=True)
    return folder


def run_status(folder: Path) -> str:
    """``finished``, ``failed: <reason>``, ``stopped: <how>`` (Ctrl+C or SIGTERM: ``mark_stopped``),
    ``running`` (killed before it could say) or ``missing``."""
    try:
        info = json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):
        return "missing"
    status = str(info.get("status", "missing"))
    return f"{status}: {info['error']}" if "error" in info else status


# Settings holding paths: run.json records them relative to the run's folder, never this machine's.
PATH_KEYS = ("results-dir", "data-dir")
# Resuming a run (fedcond.records.checkpoint): the settings are here, beside the run folder they name, so
# that the tools may name them without importing torch.
RESUME = Option(
    "resume", "", "a run folder to continue from its last finished round, with the settings its run.json records"
)
CHECKPOINT_EVERY = Option(
    "checkpoint-every",
    1,
    "save the checkpoint every this many rounds and after the last (a resume goes on from the last one "
    "saved): for runs of thousands of short rounds with a large server state, where saving it costs more "
    "than the round",
    minimum=1,
)
#: Settings a resumed run may give differently from the recorded ones: none of them changes a number
#: the run computes (num-server-rounds only says how far it goes: past the last finished round).
FREE_ON_RESUME = (
    RESUME.key, *PATH_KEYS, "run-name", "verbose", "node-timeout", "num-server-rounds", CHECKPOINT_EVERY.key,
    LIVE_CURVES.key,
)  # fmt: skip
# How a run was started, not what it computes: run.json records resumes apart ("resumed").
UNRECORDED_KEYS = (RESUME.key,)
#: Where a run that failed with an unexpected exception (not a ``FedcondError``) keeps its traceback.
TRACEBACK_FILE = "traceback.txt"
# Held by the process running the run in a folder (a resume of a run still going is refused).
RUN_LOCK = ".fedcond-run.lock"
# What run.json says of how a run ended; a resumed run is running again until it says anew.
OUTCOME_KEYS = (
    "status", "error", "finished", "rounds_completed", "final_accuracy", "final_heldout_accuracy", "final_rmse",
    "final_heldout_rmse", "final_loss", "final_class_accuracy",
    "total_seconds",
)  # fmt: skip


def portable_config(config: RunConfig, folder: Path) -> dict[str, Any]:
    """``config``'s mapping with its paths relative to ``folder`` (unset paths stay empty)."""
    mapping = {key: value for key, value in config.to_mapping().items() if key not in UNRECORDED_KEYS}
    for key in PATH_KEYS:
        if mapping.get(key):
            mapping[key] = os.path.relpath(Path(mapping[key]).expanduser().resolve(), folder.resolve())
    return mapping


class RunRecorder:
    """Writes ``run.json`` at the start and end of a run, and a ``history.csv`` row per round.

    Holds the folder's lock (``RUN_LOCK``) until the run finishes or fails, so that nothing resumes
    a run that is still going; ``history`` are rounds finished before (a resumed run's).
    """

    def __init__(
        self,
        folder: Path,
        config: RunConfig,
        details: dict[str, Any],
        num_clusters: int,
        history: Sequence[RoundRecord] = (),
    ) -> None:
        self.folder = folder
        self.num_clusters = num_clusters
        self.metric = dataset_metric(config.dataset)
        self.curves: LiveCurves | None = None
        self.verbose = config.verbose
        try:
            self._lock: TextIO | None = locks.acquire(folder / RUN_LOCK)
        except locks.Held as held:
            raise FedcondError(f"{folder} is in use by another run (process {held.holder}); wait for it") from None
        self.records: list[RoundRecord] = list(history)
        self._info: dict[str, Any] = {
            "config": portable_config(config, folder),
            # The settings as the run used them; the paths among them as seen from this folder, so the
            # folder can move between machines (fedcond report and resume read them so).
            "config_paths": {key: "relative to this run's folder" for key in PATH_KEYS},
            **details,
            "versions": package_versions(),
            CODE: code_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "status": "running",
            # Every client that did not answer an instruction, and why (fedcond.federation.participation).
            "failures": [],
            # What the score columns of history.csv hold (rmse on a regression task, lower is better).
            "metric": self.metric,
        }
        self._write_info()
        # Written whole and renamed: a resumed run's history is the checkpoint's, never a later row
        # of the attempt that stopped between writing its row and its checkpoint.
        temporary = self.folder / f".{self.history_path.name}.tmp"
        with temporary.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, self.columns)
            writer.writeheader()
            writer.writerows(self.row(record) for record in self.records)
        os.replace(temporary, self.history_path)
        if LIVE_CURVES.of(config):
            # A resumed run's earlier rounds are drawn already, unless its first attempt drew nothing.
            drawn = any(path.name.startswith(EVENT_FILE_PREFIX) for path in folder.iterdir())
            self.curves = LiveCurves(folder, self._info["config"], self.metric)
            for record in () if drawn else self.records:
                self.curves.add(record)

    @property
    def columns(self) -> list[str]:
        """``history.csv``'s header, the score's columns under the task's metric."""
        return [column_on_disk(column, self.metric) for column in RoundRecord.columns(self.num_clusters)]

    def row(self, record: RoundRecord) -> dict[str, Any]:
        return row_on_disk(record.as_row(self.num_clusters), self.metric)

    @classmethod
    def reopen(
        cls, folder: Path, config: RunConfig, num_clusters: int, history: Sequence[RoundRecord], note: dict[str, Any]
    ) -> RunRecorder:
        """Continue the run of ``folder`` after ``history``: run.json keeps what it said of the run
        (when it started, its scenario...), drops how it ended, and adds ``note`` to ``resumed``."""
        previous = json.loads((folder / "run.json").read_text())
        kept = {key: value for key, value in previous.items() if key not in (*OUTCOME_KEYS, "config", "versions", CODE)}
        kept["resumed"] = [*previous.get("resumed", []), {**note, "versions": package_versions(), CODE: code_version()}]
        earlier_traceback = folder / TRACEBACK_FILE
        if earlier_traceback.exists():  # the stopped attempt's, kept apart from any of this one
            earlier_traceback.replace(folder / f"traceback-before-resume-{len(kept['resumed'])}.txt")
        recorder = cls(folder, config, kept, num_clusters, history)
        recorder._info["versions"] = previous.get("versions", recorder._info["versions"])
        # The code of the attempt that started the run; each resume's is in its note.
        recorder._info[CODE] = previous.get(CODE)
        recorder._info["started"] = previous.get("started", recorder._info["started"])
        recorder._write_info()
        return recorder

    @property
    def first_train_loss(self) -> float:
        """The first finite mean training loss of the rounds recorded so far (NaN: none yet): a
        regression task's scale for divergence (``fedcond.model.training.check_not_diverged``)."""
        return next((record.train_loss for record in self.records if math.isfinite(record.train_loss)), math.nan)

    @property
    def history_path(self) -> Path:
        return self.folder / "history.csv"

    def add(self, record: RoundRecord) -> None:
        # Never a row once a stop is under way: the round it closes may miss clients the stop ended.
        with stopping.committing(f"round {record.round}'s history row"):
            self.records.append(record)
            with self.history_path.open("a", newline="") as handle:
                csv.DictWriter(handle, self.columns).writerow(self.row(record))
        if self.curves is not None:
            self.curves.add(record)

    def finish(self, extra: dict[str, Any] | None = None) -> None:
        last = self.records[-1] if self.records else None
        self._info.update(
            status="finished",
            finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            rounds_completed=len(self.records),
            **row_on_disk(
                {
                    "final_accuracy": last.accuracy if last else None,
                    # None rather than NaN: run.json stays strict JSON when there are no held-out clients.
                    "final_heldout_accuracy": None
                    if last is None or math.isnan(last.heldout_accuracy)
                    else last.heldout_accuracy,
                    # With validation-fraction (else absent): what settings are chosen on.
                    **{
                        f"final_{column}": getattr(last, column)
                        for column in VALIDATION_COLUMNS
                        if last is not None and not math.isnan(getattr(last, column))
                    },
                },
                self.metric,
            ),
            final_loss=last.loss if last else None,
            total_seconds=last.elapsed_seconds if last else None,
            **(extra or {}),
        )
        self._write_info()
        self.close()

    def note(self, key: str, value: Any) -> None:
        """Set ``run.json``'s ``key`` to ``value`` now (a result that is not a round's row)."""
        self._info[key] = value
        self._write_info()

    def add_events(self, key: str, entries: list[dict[str, Any]]) -> None:
        """Append ``entries`` to ``run.json``'s list ``key`` (``failures``, ``membership``) at once, so
        a run that stops later still shows them."""
        if entries:
            self._info.setdefault(key, []).extend(entries)
            self._write_info()

    def fail(self, reason: str) -> None:
        """Mark the run as stopped by an error (finished rounds stay in history.csv)."""
        self._info.update(status="failed", error=reason, rounds_completed=len(self.records))
        self._write_info()
        self.close()

    def close(self) -> None:
        """Let go of the folder (the run has ended, one way or another)."""
        if self.curves is not None:
            self.curves.close()
            self.curves = None
        if self._lock is not None:
            locks.release(self._lock)
            self._lock = None

    def _write_info(self) -> None:
        # Never once a stop is under way: the stop's own line (mark_stopped) would be written over.
        with stopping.committing("run.json"):
            write_run_info(self.folder, self._info)


def write_run_info(folder: Path, info: dict[str, Any]) -> None:
    """``folder/run.json``, written whole and renamed: a write that fails (a full disk) leaves the
    previous run.json as it was, never an empty or half-written one that no later command can read."""
    temporary = folder / ".run.json.tmp"
    try:
        temporary.write_text(json.dumps(info, indent=2, default=str) + "\n")
        os.replace(temporary, folder / "run.json")
    finally:
        temporary.unlink(missing_ok=True)


def open_run(
    config: RunConfig, scenario: Any, method: str, summary: str, conditioned: bool, extra: dict[str, Any] | None = None
) -> RunRecorder:
    """Create a run's folder and ``run.json`` (method, scenario, model size, conditioning) and, when
    ``config.verbose``, print its header; what the ServerApp and the pooled protocol both do first.

    ``scenario`` is a ``fedcond.data.scenarios.Scenario`` (not imported here: scenarios import history's
    neighbours, and this module stays at the bottom of the core).
    """
    from fedcond.data.scenarios import format_summary
    from fedcond.model.networks import build_run_model, count_parameters

    folder = results_folder(config)
    details = {
        "method": {"name": method, "summary": summary, "conditioned": conditioned},
        **(extra or {}),
        "scenario": scenario.summary(),
        "model_parameters": count_parameters(build_run_model(config, scenario.num_classes, conditioned)),
        "conditioning": (
            {"fingerprint": config.fingerprint, "conditioning": config.conditioning} if conditioned else None
        ),
    }
    recorder = RunRecorder(folder, config, details, scenario.num_clusters)
    if config.verbose:
        print(f"fedcond: {method} on {config.dataset} {config.scenario}", flush=True)
        print(format_summary(details["scenario"]), flush=True)
        print(f"fedcond: results folder {folder}", flush=True)
    return recorder


def reopen_run(
    config: RunConfig, folder: Path, num_clusters: int, history: Sequence[RoundRecord], note: dict[str, Any]
) -> RunRecorder:
    """Continue the run in ``folder`` after the rounds of ``history`` (see ``RunRecorder.reopen``)."""
    recorder = RunRecorder.reopen(folder, config, num_clusters, history, note)
    if config.verbose:
        # The note's round: with evaluate-in-fit the checkpoint's last round may still await its row.
        print(f"fedcond: resuming {folder} from round {note['from_round']} of {config.num_server_rounds}", flush=True)
        if note.get("restarted_on_clients"):
            print(f"fedcond: starting afresh (kept on clients): {note['restarted_on_clients']}", flush=True)
    return recorder


def error_line(error: BaseException) -> str:
    """The one line ``run.json`` and the terminal show for ``error``: a ``FedcondError``'s message
    (it names the fix), else the exception's type and message, never a traceback."""
    text = str(error) if isinstance(error, FedcondError) else f"{type(error).__name__}: {error}"
    return " ".join(text.split()) or type(error).__name__


def mark_failed(folder: Path, reason: str, status: str = "failed") -> None:
    """Record ``reason`` as the end of the run in ``folder`` (``status``: ``failed``, or
    ``STOPPED_STATUS`` for a stop from outside) when nothing else did: its run.json says ``running``
    (it stopped without saying why) or is missing (it stopped before writing one)."""
    try:
        info = json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):
        info = {}
    if info.get("status") in ("finished", "failed", STOPPED_STATUS):
        return
    info.update(status=status, error=reason)
    if status == STOPPED_STATUS:
        info.update(stopped=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    folder.mkdir(parents=True, exist_ok=True)
    write_run_info(folder, info)


#: run.json's status of a run that a stop (Ctrl+C, SIGTERM) ended before it finished.
STOPPED_STATUS = "stopped"
#: ... and what it says of the stop (``run_status``: ``stopped: <this>``).
STOPPED_REASON = "by Ctrl+C or SIGTERM before it finished; the same command resumes it from its last checkpoint"


def mark_stopped(folder: Path, reason: str = STOPPED_REASON) -> None:
    """Record that a stop ended the run in ``folder`` (unless it finished): status ``stopped``, its
    rounds those of its last checkpoint, which a rerun resumes from. Written once no write of the
    run's own is in progress, and (``fedcond.stopping``) none comes after it."""
    with stopping.commit_lock():
        try:
            info = json.loads((folder / "run.json").read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("status") == "finished":
            return
        info.update(status=STOPPED_STATUS, error=reason, stopped=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        folder.mkdir(parents=True, exist_ok=True)
        write_run_info(folder, info)


@contextlib.contextmanager
def failures_recorded(recorder: RunRecorder) -> Iterator[RunRecorder]:
    """Run the body; any exception marks the run failed with a one-line reason (``error_line``) and
    goes on up, so ``run.json`` never stays ``running``. An unexpected exception's traceback goes to
    ``traceback.txt`` beside it. On success, with ``verbose``, say where the results are."""
    try:
        yield recorder
    except Exception as error:
        # An error that comes once a stop is under way is the stop's doing (Ray shut down under the
        # round): the run is stopped, not failed (``mark_stopped``), and resumes.
        stopping.check(f"the run's error ({error_line(error)})")
        if not isinstance(error, FedcondError):
            (recorder.folder / TRACEBACK_FILE).write_text("".join(traceback.format_exception(error)))
        recorder.fail(error_line(error))
        raise
    finally:
        recorder.close()
    if recorder.verbose:
        print(f"fedcond: finished; history.csv and run.json written to {recorder.folder}", flush=True)

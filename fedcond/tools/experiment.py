"""Experiments: a grid of runs (settings x methods x seeds), run one by one, resumable, collected tidy.

An experiment is fixed run-config ``settings`` plus grid ``axes``; every combination of axis values
is one run. ``fedcond compare`` is the special case whose only axes are ``method`` and ``seed``;
``fedcond sweep`` reads the axes (and the tables to render) from a TOML grid file. Each run gets
its own folder under ``OUT/runs/`` (``history.csv`` + ``run.json``), named from its axis values, so
rerunning the same command skips every run whose folder says ``finished`` and resumes an interrupted
one from its checkpoint (``prepare_folder``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import json
import math
import re
import shutil
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from fedcond import stopping
from fedcond.config import RunConfig, canonical_record, value_before_it_existed
from fedcond.errors import FedcondError
from fedcond.records import locks
from fedcond.records.history import (
    CHECKPOINT_EVERY,
    PATH_KEYS,
    RESUME,
    RUN_LOCK,
    SCORE,
    SPREAD_COLUMNS,
    STOPPED_REASON,
    STOPPED_STATUS,
    VALIDATION_COLUMNS,
    column_on_disk,
    dataset_metric,
    error_line,
    mark_failed,
    mark_stopped,
    row_in_memory,
    row_on_disk,
    run_status,
)
from fedcond.records.live_curves import LIVE_CURVES
from fedcond.records.provenance import CODE
from fedcond.records.provenance import describe as describe_code

# Every tidy row names the scenario it came from, so results of several experiments concatenate.
SETTING_COLUMNS = ("dataset", "scenario", "num-clusters", "clients-per-cluster", "data-fraction", "rotations")
# Which variant of the conditional method a run is: the paper's numbers exist for one of them only,
# so every tidy row names it (runs recorded before these settings existed ran the defaults).
VARIANT_COLUMNS = ("fingerprint", "conditioning")
VARIANT_DEFAULTS = {key: getattr(RunConfig(), key) for key in VARIANT_COLUMNS}
#: How many fingerprint entries a conditioned run read: a column of metrics.csv only where some run
#: of the folder read another number than the default (the appendix's first eigenvector, its EMNIST
#: table's 1-8), so that the paper's lookup can tell those runs apart.
FINGERPRINT_DIM, FINGERPRINT_DIM_DEFAULT = "fingerprint_dim", RunConfig().fingerprint_dim
RUN_COLUMNS = ("method", "seed")
#: metrics.csv's column naming the code each run came from (``run_code``).
CODE_COLUMN = "code"
METRIC_COLUMNS = (
    "round", "accuracy", "loss", "seconds", "bytes_down", "bytes_up", "ari", "train_loss", "elapsed_seconds",
)  # fmt: skip
# Written when a run's history has them (added by later features); never required.
OPTIONAL_METRIC_COLUMNS = (
    "heldout_accuracy", "clients_asked", "clients_answered", "clients_failed", "clients_timed_out", "clients_evaluated",
    *SPREAD_COLUMNS,
    "heldout_adapted_accuracy", "drifted_accuracy", *VALIDATION_COLUMNS,
)  # fmt: skip
# Settings that say where a run lives, how chatty it is, where it resumes from or how often it saves
# its checkpoint, not what it computes: a sweep may change them in a folder of finished runs.
PLACEMENT_KEYS = (*PATH_KEYS, "run-name", "verbose", RESUME.key, CHECKPOINT_EVERY.key, LIVE_CURVES.key)
EXPERIMENT_FILE = "experiment.json"
# Held by the compare or sweep working in the folder (``experiment_lock``).
LOCK_FILE = ".fedcond.lock"
METRICS_FILE = "metrics.csv"
#: metrics.csv's per-class columns (a final round's row of a run with per-class-accuracy).
CLASS_PREFIX = "class:"


def class_column(name: str) -> str:
    return CLASS_PREFIX + name


Runner = Callable[[RunConfig], None]


@dataclass(frozen=True)
class TableSpec:
    """A table in the paper's layout: ``rows`` down, ``columns`` across, ``groups`` side by side."""

    columns: tuple[str, ...] = ()
    groups: str | None = None
    rows: str = "method"
    title: str = ""
    #: A per-class table instead (runs with per-class-accuracy): these classes down, each value of
    #: ``rows`` (with ``columns`` and ``groups``) across; cells the final accuracy on that class.
    classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannedRun:
    """One run of an experiment: its folder name, its settings and its value on every axis."""

    name: str
    config: RunConfig
    labels: dict[str, str]
    #: Rounds an interrupted attempt finished, which this one resumes after (``config`` says ``resume``).
    rounds_done: int = 0


@dataclass
class Experiment:
    """Fixed settings, grid axes (kebab-case run-config keys, or bundles of them) and tables."""

    settings: dict[str, Any]
    axes: dict[str, list[Any]]
    tables: list[TableSpec] = field(default_factory=list)
    title: str = ""
    kind: str = "sweep"
    #: Methods a selection (``competitors``) named that cannot run these settings, with the reason
    #: (``plan`` fills it and takes them off the method axis; never a method asked for by name).
    left_out: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "title": self.title,
            "settings": self.settings,
            "axes": self.axes,
            # A per-class table says so; the others are written as before classes existed.
            "tables": [
                {key: value for key, value in table.__dict__.items() if key != "classes" or value}
                for table in self.tables
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Experiment:
        tables = [TableSpec(**{**table, "columns": tuple(table["columns"]), "classes": tuple(table.get("classes", ()))})
                  for table in data.get("tables", [])]  # fmt: skip
        return cls(dict(data["settings"]), dict(data["axes"]), tables, data.get("title", ""), data.get("kind", "sweep"))

    @property
    def setting_axes(self) -> list[str]:
        """The settings a tidy row names: the standard ones, then any other axis of this grid."""
        extra = [axis for axis in self.axes if axis not in (*SETTING_COLUMNS, *RUN_COLUMNS)]
        return [*SETTING_COLUMNS, *extra]

    @property
    def method_axes(self) -> list[str]:
        """Axes other than ``method`` whose bundles name a method (a ``variant`` axis): in a report
        their labels tell runs apart, as methods do, rather than scenario points."""
        return [
            axis for axis, values in self.axes.items()
            if axis != "method" and any(isinstance(value, Mapping) and "method" in value for value in values)
        ]  # fmt: skip

    @property
    def point_axes(self) -> list[str]:
        """The settings that make a scenario point of a report: ``setting_axes`` but the method axes."""
        return [axis for axis in self.setting_axes if axis not in self.method_axes]


def column_name(axis: str) -> str:
    """The tidy file's column for a run-config key or grid axis (snake_case, like history.csv)."""
    return axis.replace("-", "_")


class Selected(str):
    """A method name that came from a selection (``--methods competitors``), not from the user by name:
    ``plan`` may leave it out where its checks refuse the run's settings, saying why."""

    selection: str

    def __new__(cls, name: str, selection: str) -> Selected:
        named = super().__new__(cls, name)
        named.selection = selection
        return named


def expand_methods(values: Sequence[Any] | str) -> list[Any]:
    """Method names, in the given order; ``all`` stands for every federated method of the paper's
    comparison, ``variants`` for our named variants (``recommended``) and ``pooled`` for the three
    pooled references (the paper's own protocol), each in the registry's order.

    A method value may also be a bundle, ``{ label = "recommended", method = "conditional",
    fingerprint = "class-mean", ... }``: a named variant whose label is its name in every table.
    """
    from fedcond.federation.methods import METHOD_SELECTIONS, get_method, method_names

    entries = [values] if isinstance(values, str) else list(values)
    expanded: list[Any] = []
    for entry in entries:
        if isinstance(entry, Mapping):
            if "method" not in entry or "label" not in entry:
                raise FedcondError(f"a method bundle needs 'label' and 'method' keys, got {dict(entry)}")
            get_method(str(entry["method"]))
            expanded.append(dict(entry))
        elif str(entry) in METHOD_SELECTIONS:
            expanded += [Selected(name, str(entry)) for name in method_names(str(entry)) if name not in expanded]
        else:
            get_method(str(entry))  # unknown names stop here with the list of known ones
            if str(entry) not in expanded:
                expanded.append(str(entry))
    return expanded


def parse_list(text: str, what: str) -> list[str]:
    """``a,b,c`` into its non-empty parts; an empty list is an error naming ``what``."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise FedcondError(f"{what} is empty; give a comma-separated list")
    return parts


def parse_seeds(text: str) -> list[int]:
    try:
        return [int(part) for part in parse_list(text, "--seeds")]
    except ValueError:
        raise FedcondError(f"--seeds takes comma-separated integers like 0,1,2 (got '{text}')") from None


def read_grid_file(path: Path, profile: str | None = None) -> Experiment:
    """A grid file: ``title``, ``[settings]``, ``[grid]``, ``[[table]]`` and ``[profiles.NAME]``.

    A profile's keys replace grid axes of the same name, or else fixed settings. A profile with
    ``extends = "OTHER"`` starts from profile OTHER's keys (so a variant of a profile names only
    what differs).
    """
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise FedcondError(f"no grid file {path}; see experiments/README.md for the ones that exist") from None
    except tomllib.TOMLDecodeError as error:
        raise FedcondError(f"{path} is not valid TOML ({error}); fix the file") from None
    known = ("title", "paper", "paper-tables", "settings", "grid", "table", "profiles")
    unknown = set(data) - set(known)
    if unknown:
        raise FedcondError(f"{path}: unknown sections {sorted(unknown)}; use {', '.join(known)}")
    settings = dict(data.get("settings", {}))
    axes = {key: value if isinstance(value, list) else [value] for key, value in data.get("grid", {}).items()}
    profiles = data.get("profiles", {})
    if profile is not None:
        for key, value in profile_keys(path, profiles, profile).items():
            if key in axes:
                axes[key] = value if isinstance(value, list) else [value]
            else:
                settings[key] = value
    tables = []
    for table in data.get("table", []):
        columns = table.get("columns", [])
        tables.append(
            TableSpec(
                columns=tuple([columns] if isinstance(columns, str) else columns),
                groups=table.get("groups"),
                rows=table.get("rows", "method"),
                title=table.get("title", ""),
                classes=tuple(str(name) for name in table.get("classes", ())),
            )
        )
    title = titled_with_profiles(str(data.get("title", path.stem)), [profile] if profile else [])
    experiment = Experiment(settings, axes, tables, title, "sweep")
    check_experiment(experiment)
    return experiment


def profile_keys(path: Path, profiles: Mapping[str, Any], profile: str) -> dict[str, Any]:
    """A profile's keys, after those of the profiles it ``extends`` (a chain, never a loop)."""
    chain: list[str] = []
    while profile not in chain:
        if profile not in profiles:
            choices = ", ".join(profiles) or "none"
            raise FedcondError(f"{path} has no profile '{profile}' (profiles: {choices})")
        chain.append(profile)
        base = profiles[profile].get("extends")
        if base is None:
            break
        profile = str(base)
    else:
        loop = " -> ".join([*chain, profile])
        raise FedcondError(f"{path}: profiles {loop} extend each other in a loop; end the chain")
    keys: dict[str, Any] = {}
    for name in reversed(chain):
        keys.update({key: value for key, value in profiles[name].items() if key != "extends"})
    return keys


def check_experiment(experiment: Experiment) -> None:
    """Axes must be non-empty and tables must name axes; methods are checked against the registry."""
    for axis, values in experiment.axes.items():
        if not values:
            raise FedcondError(f"grid axis '{axis}' has no values; give at least one")
    if "method" in experiment.axes:
        experiment.axes["method"] = expand_methods(experiment.axes["method"])
    for table in experiment.tables:
        for axis in (*table.columns, *([table.groups] if table.groups else []), table.rows):
            if axis not in experiment.axes:
                raise FedcondError(f"table axis '{axis}' is not a grid axis; grid axes: {', '.join(experiment.axes)}")


def axis_label(value: Any) -> str:
    """How an axis value shows in names and tables (a bundle shows its ``label``)."""
    if isinstance(value, Mapping):
        return str(value.get("label") or ",".join(f"{k}={v}" for k, v in value.items()))
    return str(value)


def _settings_of(axis: str, value: Any) -> dict[str, Any]:
    """A plain axis sets its own key; a bundle (an inline table) sets several keys together."""
    if isinstance(value, Mapping):
        return {key: item for key, item in value.items() if key != "label"}
    return {axis: value}


def _folder_name(labels: Mapping[str, str]) -> str:
    """``axis-value`` parts joined by ``_``; a value's other characters become single hyphens, none at
    its ends (a label "Global (pooled-global)" gives ``variant-Global-pooled-global``)."""
    parts = [f"{axis}-{re.sub(r'[^A-Za-z0-9._+-]+', '-', value).strip('-')}" for axis, value in labels.items()]
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", "_".join(parts)) or "run"


def _with_comparison_server_optimiser(given: dict[str, Any], comparison_wide: set[str]) -> dict[str, Any]:
    """``given`` without the server optimiser the whole comparison was given (``comparison_wide``: the
    keys of compare's settings, a grid's [settings], that no axis value of this point set again) where
    this point's method has no server average to step (local, gossip, DAC, pFedHN, the pooled
    references): a comparison's FedAvgM is every averaging arm's, the same tool for each
    (docs/comparisons.md), and no tool for an arm without one. Given to such a method by name (a
    bundle, or one run) it is still refused."""
    from fedcond.federation.methods import get_method
    from fedcond.model.server_optimiser import OPTIONS as SERVER_OPTIMISER

    optimiser = {option.key for option in SERVER_OPTIMISER} & comparison_wide
    if not optimiser or get_method(str(given.get("method", RunConfig.method))).server_step_refusal is None:
        return given
    return {key: value for key, value in given.items() if key not in optimiser}


def plan(experiment: Experiment, base: Mapping[str, Any], runs_dir: Path) -> list[PlannedRun]:
    """Every combination of axis values as a checked run (no data is loaded here)."""
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import get_method, run_config

    planned = []
    axes = list(experiment.axes.items())
    refused: dict[str, str] = {}
    # A method's own setting given to the whole comparison is for the methods on its axis that read it.
    on_axis = [
        str(value["method"] if isinstance(value, Mapping) else value) for value in experiment.axes.get("method", [])
    ]
    compared = frozenset(option.key for name in on_axis for option in get_method(name).options)
    for combination in itertools.product(*(values for _, values in axes)):
        given = dict(experiment.settings)
        labels = {}
        comparison_wide = set(experiment.settings)
        for (axis, _), value in zip(axes, combination, strict=True):
            point = _settings_of(axis, value)
            given.update(point)
            comparison_wide -= set(point)
            labels[axis] = axis_label(value)
        given = _with_comparison_server_optimiser(given, comparison_wide)
        name = _folder_name(labels)
        values = {**base, **given, "results-dir": str(runs_dir), "run-name": name, "verbose": False}
        config = run_config(values, given)
        method = dict(zip((axis for axis, _ in axes), combination, strict=True)).get("method")
        try:
            check_run(config, compared_options=compared)
        except FedcondError as refusal:
            if not isinstance(method, Selected):
                raise
            refused[method] = f"{method} (from --methods {method.selection}) cannot run here: {refusal}"
            continue
        planned.append(PlannedRun(name, config, labels))
    # A selected method refused at every point leaves the axis (and experiment.json); one refused at
    # some points only stops the plan, as a method asked for by name would.
    planned_methods = {run.config.method for run in planned}
    partly = [method for method in refused if method in planned_methods]
    if partly:
        raise FedcondError(refused[partly[0]])
    if refused:
        experiment.left_out.update(refused)
        experiment.axes["method"] = [value for value in experiment.axes["method"] if value not in refused]
    names = [run.name for run in planned]
    if len(set(names)) != len(names):
        raise FedcondError("two grid points get the same folder name; give bundles distinct 'label' values")
    return planned


def comparable_config(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in mapping.items() if key not in PLACEMENT_KEYS}


def with_later_settings(recorded: Mapping[str, Any], planned: RunConfig) -> dict[str, Any]:
    """A finished run's recorded settings, with each setting added to fedcond after it ran at the
    value its default resolves to for that run, or at the value the setting declares for runs made
    before it existed (a run made before ``channels-last`` existed ran in the default layout, though
    CIFAR's default is now channels-last). A run planned with another value still differs from it."""
    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config

    recorded = canonical_record(recorded)  # e.g. channels-last's false, recorded when it was a yes/no setting
    missing = [key for key in planned.to_mapping() if key not in recorded]
    if not missing:
        return recorded
    declared = default_config()
    at_defaults = run_config({**planned.to_mapping(), **{key: declared[key] for key in missing if key in declared}})
    resolved = at_defaults.resolved().to_mapping()
    before = {key: value_before_it_existed(key) for key in missing}
    later = {key: resolved[key] if before[key] is None else before[key] for key in missing if key in resolved}
    return {**later, **recorded}


def prepare_folder(run: PlannedRun, runs_dir: Path, stream: TextIO) -> PlannedRun | None:
    """What this run's folder asks for: None when it holds a finished run of exactly these settings
    (nothing to do); else the run to do.

    An unfinished run (killed: ``running``; or ``failed``) with a checkpoint is resumed after its
    last finished round, in its folder: for a method whose state is all on the server, the numbers
    are those of an uninterrupted run. It is started afresh instead (its folder removed) when it
    has no checkpoint (it stopped before finishing round 1), when its method keeps state on the
    clients (Ditto, Local: a resume would restart their models, and a table must not mix that in),
    or when the checkpoint cannot be used (the line printed says why). A finished run of
    *different* settings is an error rather than something to mix in silently; so is a folder that
    another process is running a run in.
    """
    from fedcond.federation.methods import get_method
    from fedcond.records.checkpoint import check_resume, checkpoint_path

    folder = runs_dir / run.name
    if not folder.exists():
        return run
    status = run_status(folder)
    if status == "finished":
        recorded = with_later_settings(json.loads((folder / "run.json").read_text())["config"], run.config)
        wanted = comparable_config(run.config.resolved().to_mapping())
        differing = sorted(key for key, value in wanted.items() if recorded.get(key) != value)
        if differing:
            raise FedcondError(
                f"{folder} holds a finished run with other settings ({', '.join(differing)}); "
                "use another --out folder, or delete that run folder to redo it"
            )
        return None
    holder = locks.holder_of(folder / RUN_LOCK)
    if holder is not None:
        raise FedcondError(f"{folder} is in use by another run (process {holder}); wait for it or stop it first")
    lost_on_clients = get_method(run.config.method).state_lost_on_resume
    if checkpoint_path(folder).exists() and not lost_on_clients:
        resumed = RESUME.set(run.config, str(folder))
        try:
            checkpoint = check_resume(resumed)
        except FedcondError as error:
            print(f"fedcond: {run.name}: cannot resume ({error}); running it again from round 1", file=stream)
        else:
            return dataclasses.replace(run, config=resumed, rounds_done=checkpoint.round)
    shutil.rmtree(folder)
    return run


class Progress:
    """Prints which run and which round is going, with the estimated time left, by watching
    the run's ``history.csv`` grow (the run itself stays unaware of being watched).

    The estimate is the rounds still to run times the mean round (the history's own ``seconds``),
    plus each run not yet started times the mean set-up (a run's wall time beyond its rounds': data,
    fingerprints, Flower and Ray starting), so neither a slow start nor a run that failed early
    (its unrun rounds leave the count) skews it.
    """

    def __init__(self, pending: Sequence[PlannedRun], stream: TextIO, interval: float = 1.0) -> None:
        self.rounds_left = sum(run.config.num_server_rounds - run.rounds_done for run in pending)
        self.runs_to_start = len(pending)
        self.rounds_timed = 0
        self.round_seconds = 0.0
        #: Each finished run's wall time beyond its rounds' own.
        self.set_ups: list[float] = []
        self.stream = stream
        self.interval = interval

    def eta(self, current_set_up: float) -> str:
        """The time left, while a run whose set-up took ``current_set_up`` so far goes on."""
        if self.rounds_timed == 0:
            return "estimating time left"
        per_round = self.round_seconds / self.rounds_timed
        per_run = sum(self.set_ups) / len(self.set_ups) if self.set_ups else current_set_up
        left = self.rounds_left * per_round + self.runs_to_start * per_run
        return f"about {format_duration(left)} left"

    def watch(self, run: PlannedRun, folder: Path, position: str, work: Callable[[], None]) -> None:
        """Run ``work`` while printing a line for every new round of ``run``."""
        stop = threading.Event()
        started = time.monotonic()
        rounds = run.config.num_server_rounds
        metric = dataset_metric(run.config.dataset)
        self.runs_to_start -= 1
        ran = {"rounds": 0, "seconds": 0.0}

        def report() -> None:
            # A resumed run's history starts with the rounds finished before: those are not news.
            seen, finished = run.rounds_done, False
            while not finished:
                # One last read after the run returns: its final rounds may land between polls.
                finished = stop.wait(self.interval)
                rows = read_history(folder / "history.csv", metric)
                for row in rows[seen:]:
                    seconds = float(row["seconds"])
                    self.rounds_left -= 1
                    self.rounds_timed += 1
                    self.round_seconds += seconds
                    ran["rounds"] += 1
                    ran["seconds"] += seconds
                    set_up = max(0.0, time.monotonic() - started - ran["seconds"])
                    print(
                        f"  {position} {run.name}: round {row['round']}/{rounds} {metric} "
                        f"{float(row['accuracy']):.4f} | {self.eta(set_up)}",
                        file=self.stream,
                        flush=True,
                    )
                seen = max(seen, len(rows))

        watcher = threading.Thread(target=report, daemon=True)
        watcher.start()
        try:
            work()
        finally:
            stop.set()
            watcher.join()
            # The rounds a failed run never ran will not run: they leave the count.
            self.rounds_left -= rounds - run.rounds_done - ran["rounds"]
            self.set_ups.append(max(0.0, time.monotonic() - started - ran["seconds"]))


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def read_history(path: Path, metric: str = SCORE) -> list[dict[str, str]]:
    """A run's ``history.csv`` rows, the score's columns (``metric``: the run's, rmse on a regression
    task) under their in-memory names (``fedcond.records.history.SCORE``)."""
    try:
        with path.open(newline="") as handle:
            return [row_in_memory(row, metric) for row in csv.DictReader(handle)]
    except FileNotFoundError:
        return []


def check_data(planned: Sequence[PlannedRun]) -> None:
    """Load and split each distinct scenario once, so missing files or tiny clients stop us early."""
    from fedcond.data.scenarios import scenario_for

    for run in planned:
        scenario_for(run.config)


def describe_plan(experiment: Experiment, base: Mapping[str, Any], out: Path) -> str:
    """What a sweep would do: every run with its client count, and which are finished already."""
    from fedcond.federation.sampling import clients_per_round

    runs_dir = (out / "runs").resolve()
    planned = plan(experiment, base, runs_dir)
    lines = [f"left out: {reason}" for reason in experiment.left_out.values()]
    for run in planned:
        done = run_status(runs_dir / run.name) == "finished"
        sample = clients_per_round(run.config)
        sampled = f", {sample} trained a round" if sample < run.config.num_training_clients else ""
        lines.append(f"{'done' if done else 'todo'}  {run.name}  ({run.config.num_clients} clients{sampled}, "
                     f"{run.config.num_server_rounds} rounds)")  # fmt: skip
    # A client-round is one client's training in one round: a sample's size a round, held-out clients none.
    client_rounds = sum(clients_per_round(run.config) * run.config.num_server_rounds for run in planned)
    lines.append(f"{len(planned)} runs, {client_rounds} client-rounds of training in all")
    return "\n".join(lines)


def run_experiment(
    experiment: Experiment, base: Mapping[str, Any], out: Path, runner: Runner, stream: TextIO, parallel: int = 1
) -> list[PlannedRun]:
    """Run every unfinished grid point in order; returns the plan. Failures are recorded, not fatal.

    With ``parallel`` > 1, that many runs at a time, each in a process of its own (``runner`` must be
    a module-level function: the in-process runner), started in grid order; a line as each ends."""
    runs_dir = (out / "runs").resolve()
    planned = plan(experiment, base, runs_dir)  # every run is checked before anything is written
    for reason in experiment.left_out.values():
        print(f"fedcond: left out {reason}", file=stream, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    # Held from before the first unfinished run folder is deleted until the last run ends.
    with experiment_lock(out):
        record_experiment(experiment, out)
        pending = [todo for run in planned if (todo := prepare_folder(run, runs_dir, stream)) is not None]
        skipped = len(planned) - len(pending)
        resumed = sum(1 for run in pending if run.rounds_done)
        print(
            f"fedcond: {len(planned)} runs in {out}: {skipped} finished before, {len(pending)} to run"
            + (f" ({resumed} resumed from their checkpoint)" if resumed else ""),
            file=stream,
            flush=True,
        )
        check_data(pending)
        if parallel > 1:
            run_in_parallel(pending, runs_dir, runner, stream, parallel)
            return planned
        progress = Progress(pending, stream)
        for index, run in enumerate(pending, start=1):
            position = f"[{index}/{len(pending)}]"
            resuming = f", resumed after round {run.rounds_done}" if run.rounds_done else ""
            print(f"fedcond: {position} {run.name} ({run.config.num_clients} clients{resuming})", file=stream,
                  flush=True)  # fmt: skip
            progress.watch(run, runs_dir / run.name, position, lambda run=run: run_one(runner, run, runs_dir))
            status = run_status(runs_dir / run.name)
            if status != "finished":
                print(f"fedcond: {position} {run.name} did not finish ({status})", file=stream, flush=True)
    return planned


def _worker_setup(threads: int) -> None:
    """A parallel run's process: its share of the cores, so that the runs do not fight over them (the
    in-process runner keeps Flower's log lines off the terminal itself: ``cli.run_without_ray``).
    SIGTERM (the stopping sweep ends its processes so) stops its run as Ctrl+C does: ``stopped``."""
    import signal

    import torch

    torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def run_in_parallel(
    pending: Sequence[PlannedRun], runs_dir: Path, runner: Runner, stream: TextIO, parallel: int
) -> None:
    """``pending`` runs, ``parallel`` at a time in fresh processes (spawned: no CUDA or thread state
    inherited), in order; each failure is recorded in its folder, as ``run_one`` does."""
    import concurrent.futures
    import multiprocessing
    import os

    # OMP_NUM_THREADS, where set, says how many threads each process takes (several sweeps at once).
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(1, (os.cpu_count() or 1) // parallel)
    context = multiprocessing.get_context("spawn")
    started = time.monotonic()
    pool = concurrent.futures.ProcessPoolExecutor(parallel, context, _worker_setup, (threads,))
    try:
        futures = {pool.submit(run_one, runner, run, runs_dir): run for run in pending}
        for done, future in enumerate(concurrent.futures.as_completed(futures), start=1):
            run = futures[future]
            try:
                future.result()
            except Exception as error:  # the worker process died (run_one records every error it sees)
                mark_failed(runs_dir / run.name, error_line(error))
            status = run_status(runs_dir / run.name)
            rows = read_history(runs_dir / run.name / "history.csv", dataset_metric(run.config.dataset))
            final = f", {float(rows[-1]['accuracy']):.4f} at round {rows[-1]['round']}" if rows else ""
            print(
                f"fedcond: [{done}/{len(pending)}] {run.name} {status}{final} "
                f"({format_duration(time.monotonic() - started)} since the start)",
                file=stream,
                flush=True,
            )
    except (KeyboardInterrupt, SystemExit):
        # A stop: no run starts after it, and the runs going on are not waited for (the caller ends
        # their processes, which then say stopped: _worker_setup).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


@contextlib.contextmanager
def experiment_lock(out: Path) -> Iterator[None]:
    """Hold ``out`` for this process: a second compare or sweep on it is refused with one line.

    Another invocation would resume or delete this one's unfinished (running) run folders and write
    into the same files. A lock whose holder died is taken over (``fedcond.records.locks``).
    """
    try:
        handle = locks.acquire(out / LOCK_FILE)
    except locks.Held as held:
        raise FedcondError(
            f"{out} is in use by another fedcond compare or sweep (process {held.holder}); wait for it to "
            "finish or stop it, or choose another --out"
        ) from None
    try:
        yield
    finally:
        locks.release(handle)


#: What ``run_status`` says of a run whose compare or sweep was stopped (Ctrl+C, SIGTERM) while it ran.
STOPPED = f"{STOPPED_STATUS}: {STOPPED_REASON}"


def run_one(runner: Runner, run: PlannedRun, runs_dir: Path) -> None:
    """Run one grid point; whatever it raises is recorded as its failure, and the grid goes on.

    A stop (Ctrl+C, SIGTERM: ``fedcond.stopping``) is no failure: the run says ``stopped`` (never
    ``running``, never ``failed``), the grid stops, and the same command resumes the run from its last
    checkpoint. So is an error that comes while a stop is under way (Ray shut down under the run), and a
    runner that returns during one (Flower's threads ended before the main thread's interrupt)."""
    folder = runs_dir / run.name
    try:
        runner(run.config)
    except Exception as error:
        if stopping.requested():
            mark_stopped(folder)
            raise KeyboardInterrupt from error
        mark_failed(folder, error_line(error))
        return
    except (KeyboardInterrupt, SystemExit):
        # Nothing of the run's own is written after this (fedcond.stopping), whatever raised it.
        stopping.quiet()
        mark_stopped(folder)
        raise
    if stopping.requested():
        mark_stopped(folder)
        raise KeyboardInterrupt
    # A run that returned without saying how it ended (no run.json: it stopped before writing one;
    # or still "running") failed, its error on the terminal: not "not run yet", nor left "running".
    mark_failed(runs_dir / run.name, "the run ended without finishing; see the error printed above this line")


PROFILES_SUFFIX = re.compile(r" \(profiles? (?P<names>[^()]+)\)$")


def titled_with_profiles(title: str, profiles: list[str]) -> str:
    """A grid's title naming the profiles its folder ran: "T (profile a)", "T (profiles a and b)"."""
    if not profiles:
        return title
    names = profiles[0] if len(profiles) == 1 else ", ".join(profiles[:-1]) + " and " + profiles[-1]
    return f"{title} (profile{'s' * (len(profiles) > 1)} {names})"


def merged_title(before: str, now: str) -> str:
    """The title of a folder a sweep of another profile of the same grid extends: both profiles
    named (a title that is not a profile's, or another grid's, is replaced by the new one)."""
    old, new = PROFILES_SUFFIX.search(before), PROFILES_SUFFIX.search(now)
    if old is None or new is None or before[: old.start()] != now[: new.start()]:
        return now
    listed = [name for match in (old, new) for name in re.split(r", | and ", match["names"])]
    return titled_with_profiles(now[: new.start()], list(dict.fromkeys(listed)))


def record_experiment(experiment: Experiment, out: Path) -> None:
    """Keep the experiment's definition beside its results (``fedcond report`` redraws from it).

    A folder holding an experiment with other fixed settings is refused (its tidy file would mix two
    designs); the same settings with more axis values (methods, seeds, K...) extend it.
    """
    path = out / EXPERIMENT_FILE
    data = experiment.to_json()
    if path.exists():
        existing = json.loads(path.read_text())
        # The folder's experiment is every axis value ever run into it: a sweep of a subset (a
        # profile, fewer methods) adds to it, and the report covers all of it. A bundle whose label
        # a new bundle of other settings takes is replaced by it: the label names the run's folder,
        # which holds one run (a finished run of the old settings is refused, prepare_folder).
        for axis, values in existing.get("axes", {}).items():
            new = data["axes"].get(axis, [])
            by_label = {axis_label(value): value for value in new}
            merged = [by_label.get(axis_label(value), value) for value in values]
            data["axes"][axis] = [*merged, *(value for value in new if value not in merged)]
        before, now = existing.get("settings", {}), data["settings"]
        differing = sorted(
            key for key in before.keys() | now.keys() if before.get(key) != now.get(key) and key not in PLACEMENT_KEYS
        )
        if differing or existing.get("kind") != data["kind"]:
            changed = ", ".join(differing) or f"a {existing.get('kind')}, not a {data['kind']}"
            raise FedcondError(
                f"{out} holds another experiment (changed: {changed}); choose another --out, "
                "or widen only the methods and seeds to extend it"
            )
        data["title"] = merged_title(str(existing.get("title", "")), str(data["title"]))
    path.write_text(json.dumps(data, indent=2) + "\n")


def load_experiment(out: Path) -> Experiment:
    try:
        return Experiment.from_json(json.loads((out / EXPERIMENT_FILE).read_text()))
    except FileNotFoundError:
        raise FedcondError(f"{out} holds no {EXPERIMENT_FILE}; point at a compare or sweep --out folder") from None


def finished_runs(experiment: Experiment, out: Path) -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """Every finished run under ``out/runs``: its folder, its run.json, and the columns that name it in
    metrics.csv (settings, method label, seed, code; no round's metrics)."""
    runs_dir = (out / "runs").resolve()
    for run in plan(experiment, {}, runs_dir):
        folder = runs_dir / run.name
        if run_status(folder) != "finished":
            continue
        info = json.loads((folder / "run.json").read_text())
        config = info["config"]
        named: dict[str, Any] = {column_name(key): config[key] for key in SETTING_COLUMNS}
        named.update({key: config.get(key, VARIANT_DEFAULTS[key]) for key in VARIANT_COLUMNS})
        named[FINGERPRINT_DIM] = config.get("fingerprint-dim", FINGERPRINT_DIM_DEFAULT)
        named.update({column_name(axis): run.labels[axis] for axis in experiment.setting_axes if axis in run.labels})
        # A method bundle (a named variant) is known by its label, not by its base method.
        named.update({"method": run.labels.get("method", config["method"]), "seed": config["seed"]})
        named[CODE_COLUMN] = run_code(info)
        yield folder, info, named


def tidy_rows(experiment: Experiment, out: Path) -> Iterator[dict[str, Any]]:
    """One row per (grid point, round) of every finished run under ``out/runs``."""
    for folder, info, named in finished_runs(experiment, out):
        history = read_history(folder / "history.csv", dataset_metric(info["config"]["dataset"]))
        # The final round's row also carries each class's accuracy, where the run scored them.
        classes = info.get("final_class_accuracy", {}).get("participants", {})
        for number, row in enumerate(history, start=1):
            tidy: dict[str, Any] = dict(named)
            tidy.update({column: row.get(column, "") for column in METRIC_COLUMNS})
            tidy.update({column: row[column] for column in OPTIONAL_METRIC_COLUMNS if column in row})
            if number == len(history):
                tidy.update({class_column(name): cell["accuracy"] for name, cell in classes.items()})
            yield tidy


def run_code(info: dict[str, Any]) -> str:
    """The code a run came from, as a table's note names it (``fedcond.records.provenance.describe``): its
    first attempt's, then each resume's where it differs (``a1b2c3d>e4f5a6b``); empty for a run
    recorded before runs knew their commit."""
    attempts = [info.get(CODE), *(note.get(CODE) for note in info.get("resumed", []))]
    if all(attempt is None for attempt in attempts):
        return ""
    return ">".join(dict.fromkeys(describe_code(attempt) for attempt in attempts))


def write_metrics(experiment: Experiment, out: Path) -> Path:
    """``metrics.csv``: tidy, one row per (settings, method, seed, round)."""
    rows = list(tidy_rows(experiment, out))
    # An optional column earns its place only where some run measured it (not NaN throughout).
    optional = [c for c in OPTIONAL_METRIC_COLUMNS if any(math.isfinite(as_float(row.get(c, ""))) for row in rows)]
    settings = list(map(column_name, experiment.setting_axes))
    variants = [column for column in VARIANT_COLUMNS if column not in settings]  # a grid may sweep them
    if FINGERPRINT_DIM not in settings and any(row[FINGERPRINT_DIM] != FINGERPRINT_DIM_DEFAULT for row in rows):
        variants.append(FINGERPRINT_DIM)
    columns = [*settings, *variants, *RUN_COLUMNS, *METRIC_COLUMNS, *optional]
    # Where some run knows its code (every run since provenance was recorded; older tables unchanged).
    columns += [CODE_COLUMN] * any(row[CODE_COLUMN] for row in rows)
    columns += list(dict.fromkeys(key for row in rows for key in row if key.startswith(CLASS_PREFIX)))
    # A regression task's rows name their score columns rmse (fedcond.records.history.column_on_disk).
    metrics = sorted({dataset_metric(str(row["dataset"])) for row in rows} - {SCORE})
    columns += [column_on_disk(column, metric) for metric in metrics for column in columns if SCORE in column]
    rows = [row_on_disk(row, dataset_metric(str(row["dataset"]))) for row in rows]
    path = out / METRICS_FILE
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, columns, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def failed_runs(experiment: Experiment, out: Path) -> list[tuple[str, str]]:
    """(run, status) of every grid point that started and has not finished (not those never started)."""
    runs_dir = (out / "runs").resolve()
    statuses = ((run.name, run_status(runs_dir / run.name)) for run in plan(experiment, {}, runs_dir))
    return [(name, status) for name, status in statuses if status not in ("finished", "missing")]


def runs_not_started(experiment: Experiment, out: Path) -> list[str]:
    """Grid points with no run folder yet (a sweep of a subset, or one stopped early)."""
    runs_dir = (out / "runs").resolve()
    return [run.name for run in plan(experiment, {}, runs_dir) if run_status(runs_dir / run.name) == "missing"]


def as_float(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def script_data_dir(description: str, holding: str) -> str:
    """The ``--data-dir`` of a script of experiments/ (else ``$FEDCOND_DATA_DIR``); its usage error
    names both when neither is given."""
    import argparse
    import os

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data-dir", default=os.environ.get("FEDCOND_DATA_DIR", ""), help=f"folder holding {holding}")
    arguments = parser.parse_args()
    if not arguments.data_dir:
        parser.error(f"give --data-dir or set FEDCOND_DATA_DIR to the folder holding {holding}")
    return str(arguments.data_dir)

"""The ``fedcond`` command: run, compare and deploy client-conditional federated learning on Flower.

``fedcond run method=fedavg num-server-rounds=20`` is ``flwr run`` with the node count, Ray
resources, offline environment and an absolute results folder filled in for you; ``compare`` and
``sweep`` run many configurations as in-process simulations and report them; ``deploy-local``
runs the same app on real SuperLink and SuperNode processes. Every setting is validated (data
files included) before Flower starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from fedcond import stopping
from fedcond.config import RunConfig
from fedcond.data.scenarios import forget_loaded_data
from fedcond.errors import FedcondError
from fedcond.federation.methods import run_config
from fedcond.records.history import RESUME, run_status
from fedcond.tools import deploy, local_superlink
from fedcond.tools.experiment import (
    Experiment,
    column_name,
    describe_plan,
    expand_methods,
    failed_runs,
    load_experiment,
    parse_list,
    parse_seeds,
    read_grid_file,
    run_experiment,
    runs_not_started,
    write_metrics,
)
from fedcond.tools.flwr_commands import (
    OFFLINE_ENVIRONMENT,
    app_directory,
    default_config,
    executable,
    flower_environment,
    parse_assignments,
    prepare,
    read_overrides,
    run_folder,
    run_settings,
    to_run_config_string,
    unfinished,
)
from fedcond.tools.processes import descendants, end_processes, tagged


def default_gpus_per_client() -> float:
    """A share of the GPU per virtual client where CUDA exists (Ray hides GPUs from 0-GPU actors)."""
    import torch

    return 0.25 if torch.cuda.is_available() else 0.0


def describe_run(config: RunConfig) -> str:
    """What a ``--dry-run`` says it would start (every setting checked; the data is read when it starts)."""
    return (
        f"fedcond: dry run: {config.method} on {config.dataset} {config.scenario}, {config.num_clusters} clusters x "
        f"{config.clients_per_cluster + config.held_out_clients} clients ({config.num_clients} nodes), "
        f"{config.num_server_rounds} rounds; every setting checked, nothing started (the data is read when it runs)"
    )


def run(
    assignments: Sequence[str],
    cpus_per_client: int,
    gpus_per_client: float | None,
    override_file: str | None = None,
    dry_run: bool = False,
    stop_superlink: bool = False,
) -> int:
    """``fedcond run``: ``flwr run`` with the node count, resources, offline environment and an absolute
    results folder filled in. The terminal shows fedcond's own lines; Flower's full output goes to
    ``flower.log`` in the run's folder, which also gets ``convergence.png``. Flower's local SuperLink
    stays up for the next run unless ``stop_superlink``; its PID is in the run's folder either way."""
    if dry_run:
        planned = run_settings(assignments, override_file)
        if not is_pooled(planned):
            app_directory()  # the Flower app `flwr run` is given: a dry run refuses where the run would
        print(describe_run(planned))
        return 0
    config, overrides = prepare(assignments, override_file)
    if is_pooled(config):
        # The paper's centralised protocol has no federation to start: it trains right here.
        from fedcond.pooled import run_pooled

        folder = run_folder(overrides)
        try:
            run_pooled(run_config({**default_config(), **overrides}, overrides))
        except FedcondError:
            raise  # main prints it as one line
        except Exception:  # recorded (run.json failed, traceback.txt beside it): one line here
            print(f"fedcond: error: the run failed ({run_status(folder)}); see {folder}", file=sys.stderr)
            return 1
        print(closing_summary(folder), flush=True)
        return 0
    # The check above decoded the dataset; `flwr run` and its actors load their own, and this process
    # only waits for them: its copy would sit in memory for the whole run.
    forget_loaded_data()
    gpus = default_gpus_per_client() if gpus_per_client is None else gpus_per_client
    federation = (
        f"num-supernodes={config.num_clients} client-resources-num-cpus={cpus_per_client} "
        f"client-resources-num-gpus={gpus}"
    )
    command = [executable("flwr"), "run", str(app_directory()), "--stream", "--run-config",
               to_run_config_string(overrides), "--federation-config", federation]  # fmt: skip
    environment = flower_environment()
    # flwr's local SuperLink keeps the cwd it starts in; a neutral one keeps it out of the source tree.
    flwr_home = local_superlink.flower_home(environment)
    # flwr run would hand the run to a running local SuperLink of another environment as it is.
    local_superlink.check_reusable(flwr_home, environment, Path(executable("flower-superlink")))
    flwr_home.mkdir(parents=True, exist_ok=True)
    # This home's own local SuperLink ports: never another home's SuperLink on Flower's default ones.
    environment.update(local_superlink.ports_of(flwr_home, environment))
    folder = run_folder(overrides)
    resuming = bool(RESUME.of(config))
    print(f"fedcond: {config.method} on {config.num_clients} clients, results in {folder}"
          + (" (resumed)" if resuming else ""), flush=True)  # fmt: skip
    # The ServerApp creates the run's folder: Flower's output waits beside it until then.
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f".{folder.name}.flower.log"
    # The convergence plot is drawn as soon as the ServerApp says it finished, while Flower shuts its
    # processes down (about a second less at the end of every run).
    plotted = threading.Event()

    def plot_early() -> None:
        with contextlib.suppress(Exception):  # else drawn at the end, where an error says what it is
            draw_convergence_plot(folder)
            plotted.set()

    plotter = threading.Thread(target=plot_early, daemon=True)
    returncode = stream_filtered(command, environment, flwr_home, log, on_finished=plotter.start)
    if plotter.ident is not None:
        plotter.join()
    if folder.is_dir():
        log = log.replace(flower_log_path(folder) if resuming else folder / FLOWER_LOG)
    reason = unfinished(folder, config.num_server_rounds)
    if reason is not None:
        print(f"fedcond: error: the run did not finish (status: {reason}); Flower's output is in {log}",
              file=sys.stderr)  # fmt: skip
    else:
        print(closing_summary(folder, plotted=plotted.is_set()), flush=True)
    print(superlink_line(folder, flwr_home, stop_superlink), flush=True)
    return (returncode or 1) if reason is not None else returncode


def superlink_line(folder: Path, flwr_home: Path, stop: bool) -> str:
    """Record the local SuperLink that served the run in its folder, stop it if asked, and say which."""
    process = local_superlink.record(folder, flwr_home)
    if process is None:
        return "fedcond: Flower's local SuperLink is not running"
    if stop:
        local_superlink.terminate(process)
        return f"fedcond: stopped Flower's local SuperLink (PID {process.pid}), as --stop-superlink asked"
    return (f"fedcond: Flower's local SuperLink (PID {process.pid}, {local_superlink.RECORD_FILE}) stays up so the "
            "next run starts sooner; fedcond stop-superlink ends that one alone")  # fmt: skip


def stop_superlink() -> int:
    """``fedcond stop-superlink``: end the local SuperLink of this Flower home (FLWR_HOME) only."""
    home = local_superlink.flower_home(flower_environment())
    pid = local_superlink.stop(home)
    print(f"fedcond: stopped Flower's local SuperLink of {home} (PID {pid})" if pid is not None
          else f"fedcond: no local SuperLink of {home} is running")  # fmt: skip
    return 0


FLOWER_LOG = "flower.log"


def flower_log_path(folder: Path) -> Path:
    """Where a resumed attempt's Flower output goes: beside the earlier attempts', never over them."""
    attempt = 1
    while (folder / f"flower-resume-{attempt}.log").exists():
        attempt += 1
    return folder / f"flower-resume-{attempt}.log"


# The lines of fedcond's own that `fedcond run` shows: its messages and one line per round.
OWN_LINE = re.compile(r"^(fedcond:|round +\d+/\d+|scenario |  cluster |  samples per client)")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


FINISHED_LINE = "fedcond: finished;"  # fedcond.records.history's last line of a run that finished


def stream_filtered(
    command: Sequence[str],
    environment: dict[str, str],
    cwd: Path,
    log: Path,
    on_finished: Callable[[], None] | None = None,
) -> int:
    """Run ``command``, every output line to ``log``, fedcond's own lines also to the terminal;
    ``on_finished`` is called once, when the ServerApp says the run finished."""
    finished = False
    with log.open("w") as handle:
        process = subprocess.Popen(list(command), env=environment, cwd=cwd, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")  # fmt: skip
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            text = ANSI_ESCAPE.sub("", line).rstrip()
            if OWN_LINE.match(text):
                print(text, flush=True)
            if on_finished is not None and not finished and text.startswith(FINISHED_LINE):
                finished = True
                on_finished()
        return process.wait()


def draw_convergence_plot(folder: Path) -> None:
    """``convergence.png`` from the run's history (nothing when it has no rounds)."""
    from fedcond.records.history import dataset_metric
    from fedcond.tools.experiment import read_history
    from fedcond.tools.report import convergence_plot

    config = json.loads((folder / "run.json").read_text())["config"]
    history = read_history(folder / "history.csv", dataset_metric(config["dataset"]))
    rows = [{**row, "method": config["method"], "seed": str(config["seed"])} for row in history]
    if rows:
        title = f"{config['method']} on {config['dataset']} {config['scenario']}, K={config['num-clusters']}"
        convergence_plot(rows, folder / "convergence.png", title)


def closing_summary(folder: Path, plotted: bool = False) -> str:
    """The final numbers, and ``convergence.png`` (unless ``plotted``: drawn already)."""
    if not plotted:
        draw_convergence_plot(folder)
    info = json.loads((folder / "run.json").read_text())
    metric = info.get("metric", "accuracy")
    held = info.get(f"final_heldout_{metric}")
    return (
        f"fedcond: finished {info.get('rounds_completed')} rounds in {info.get('total_seconds') or 0:.0f} s: "
        f"{metric} {info.get(f'final_{metric}') or float('nan'):.4f}"
        + (f", held-out {held:.4f}" if held is not None else "")
        + f"\nfedcond: {folder}: "
        + ", ".join(sorted(path.name for path in folder.iterdir() if not path.name.startswith(".")))
    )


def simulation_runner(cpus_per_client: float, gpus_per_client: float | None) -> Callable[[RunConfig], None]:
    """Runs one configuration as an in-process Flower simulation (ServerApp thread, Ray clients)."""
    from fedcond.pooled import run_pooled
    from fedcond.tools.simulation import simulate

    gpus = default_gpus_per_client() if gpus_per_client is None else gpus_per_client
    for name, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    # Ray's C++ failure handler would meet SIGTERM with a stack dump and an abort; without it, SIGTERM
    # stops the sweep as Ctrl+C does (fedcond.stopping's handler, put back after ray.init: run_and_report).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

    def run_one(config: RunConfig) -> None:
        # A failure of either kind is recorded by the experiment (run_one), which goes on.
        if is_pooled(config):
            run_pooled(config)
            return
        # Flower's and Ray's lines go to the run's own log, beside its folder until the ServerApp
        # has made it (a resumed run's folder exists: its log goes in beside the earlier ones').
        folder = Path(config.results_dir, config.run_name)
        resuming = bool(RESUME.of(config))
        log = flower_log_path(folder) if resuming else folder.parent / f".{folder.name}.flower.log"
        try:
            simulate(config, cpus_per_client=cpus_per_client, gpus_per_client=gpus, quiet=True, log=log)
        finally:
            if not resuming and log.exists():  # a run that failed before its folder existed gets one for it
                folder.mkdir(parents=True, exist_ok=True)
                log.replace(folder / FLOWER_LOG)

    return run_one


def run_without_ray(config: RunConfig) -> None:
    """``--runner in-process``: one configuration in this process, one client at a time, without Ray
    or a SuperLink (``fedcond.tools.in_process``), for a machine without Ray (a lent GPU). Module-level,
    so that ``--parallel`` can hand it to its worker processes."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    from fedcond.pooled import run_pooled
    from fedcond.tools.in_process import run_in_process

    if is_pooled(config):
        run_pooled(config)
        return
    level = FLOWER_LOGGER.level
    FLOWER_LOGGER.setLevel(logging.ERROR)  # the sweep prints the rounds; Flower's INFO lines would bury them
    try:
        run_in_process(config)
    finally:
        FLOWER_LOGGER.setLevel(level)


def is_pooled(config: RunConfig) -> bool:
    """True for the paper's centralised protocol (``pooled-*`` methods), which runs without Flower."""
    from fedcond.federation.methods import get_method

    return get_method(config.method).protocol == "pooled"


def run_and_report(experiment: Experiment, base: dict[str, object], out: Path, arguments: argparse.Namespace) -> int:
    """Run what is not finished yet, then write metrics.csv and the reports; 1 if any run failed."""
    if arguments.dry_run:
        print(describe_plan(experiment, base, out))
        return 0
    if arguments.parallel < 1:
        raise FedcondError(f"--parallel must be at least 1 (got {arguments.parallel})")
    if arguments.parallel > 1 and arguments.runner != "in-process":
        raise FedcondError(
            "--parallel runs several runs at once in processes of their own, which only the in-process runner "
            "can (each Flower simulation starts its own Ray); add --runner in-process or drop --parallel"
        )
    if arguments.runner == "in-process":
        runner: Callable[[RunConfig], None] = run_without_ray
    else:
        runner = simulation_runner(arguments.cpus_per_client, arguments.gpus_per_client)
    # Every process this one starts (Ray's, --parallel's) carries the tag, so that a stop finds them all.
    # A new tag for each compare, never one inherited: a compare started beside another (by a process
    # that ran one before) must not end the other's processes when it stops.
    inherited = os.environ.get(STOP_TAG_VARIABLE)
    os.environ[STOP_TAG_VARIABLE] = f"{os.getpid()}-{uuid.uuid4().hex}"
    # Ctrl+C and SIGTERM stop the compare or sweep (fedcond.stopping), the report included: installed
    # before Ray starts, so that no run records what a stop did to it.
    try:
        with stopping.handlers():
            try:
                run_experiment(experiment, base, out, runner, sys.stdout, arguments.parallel)
                return report(out)
            except (KeyboardInterrupt, SystemExit) as stop:
                sigterm = stopping.SIGTERM_RECEIVED.is_set() or not isinstance(stop, KeyboardInterrupt)
                leave_stopped(143 if sigterm else 130)
    finally:
        if inherited is None:
            os.environ.pop(STOP_TAG_VARIABLE, None)
        else:
            os.environ[STOP_TAG_VARIABLE] = inherited


#: The environment variable that tags every process a compare or sweep starts (``leave_stopped``).
STOP_TAG_VARIABLE = "FEDCOND_STOP_TAG"


def leave_stopped(status: int) -> NoReturn:
    """Say how to go on, end every process this one started (Ray's), and exit now with ``status``.

    The run that was stopped says ``stopped`` in its run.json and resumes from its checkpoint
    (``run_one``); nothing after the stop was recorded (``fedcond.stopping``). Flower's ServerApp thread
    may wait, without a timeout, for replies that the stopped simulation will never send, and the
    interpreter would wait for that thread at exit forever: this exits without joining it
    (``os._exit``), once everything this process owes is written and flushed."""
    stopping.quiet()  # a second Ctrl+C or SIGTERM does not cut this short
    print(
        "fedcond: stopped (Ctrl+C or SIGTERM); the round under way is dropped, finished runs and each run's "
        "checkpointed rounds are kept: run the same command again to resume",
        file=sys.stderr,
        flush=True,
    )
    # Found before Ray's shutdown orphans them: a stop in the middle of Ray's start leaves processes
    # that its shutdown does not know of; the tag finds those whose parent has gone already.
    tag = os.environ.get(STOP_TAG_VARIABLE, "")
    started = descendants([os.getpid()]) | (tagged(tag, STOP_TAG_VARIABLE) if tag else set())
    with contextlib.suppress(Exception):
        from fedcond.tools.simulation import stop_ray

        stop_ray()
    late = descendants([os.getpid()]) | (tagged(tag, STOP_TAG_VARIABLE) if tag else set())
    end_processes((started | late) - {os.getpid()}, grace=5.0)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)


def report(out: Path) -> int:
    """(Re)write ``metrics.csv`` and the reports of a compare or sweep folder, and print them."""
    from fedcond.tools.report import render

    experiment = load_experiment(out)
    write_metrics(experiment, out)
    failures = failed_runs(experiment, out)
    text = render(out, experiment.title, experiment.kind, experiment.tables,
                  [column_name(axis) for axis in experiment.point_axes], failures,
                  int(experiment.settings.get("drift-round", 0)),
                  [column_name(axis) for axis in experiment.method_axes])  # fmt: skip
    print(text)
    print(f"fedcond: metrics.csv and reports written to {out}")
    not_started = runs_not_started(experiment, out)
    if not_started:
        print(f"fedcond: {len(not_started)} planned run(s) not run yet; run the same sweep again to run them")
    if failures:
        print(f"fedcond: error: {len(failures)} run(s) did not finish; see summary.md", file=sys.stderr)
        return 1
    return 0


def display_path(path: Path) -> str:
    """A path as the user would type it from here: relative to the working directory when inside it,
    so a generated file names no machine's absolute paths."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def reproduction(folders: Sequence[str], out: str, notes: str | None) -> int:
    """``fedcond reproduction``: every folder's results beside the paper's, under a link to the notes.
    (This repository's own report, with the paper's claims and their verdicts, is written from a
    checkout by ``python -m tools.reproduction``.)"""
    from fedcond.tools.report import reproduction_markdown, reproduction_notes

    out_path = Path(out)
    notes_path = reproduction_notes(out_path, Path(notes) if notes else None)
    command = " ".join(
        ["fedcond reproduction", *map(display_path, map(Path, folders)), "--out", display_path(out_path)]
        + (["--notes", display_path(notes_path)] if notes else [])
    )
    text = reproduction_markdown([Path(folder) for folder in folders], notes_path, command, out_path.parent)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text)
    print(f"fedcond: {out_path} written from {len(folders)} results folder(s) and {notes_path}")
    return 0


#: What moved out of the installed fedcond into this repository's record tooling (tools/, run from a
#: checkout): an option users and old docs still type, and the one-line answer it now gets.
MOVED_OPTIONS = {
    ("settings", "write"): (
        "fedcond settings --write is gone from the installed fedcond: from a checkout, python -m tools.docs "
        "regenerates pyproject.toml's [tool.flwr.app.config], docs/settings.md and the method tables"
    ),
    ("reproduction", "claims"): (
        "fedcond reproduction --claims is gone from the installed fedcond: from a checkout, "
        "python -m tools.reproduction FOLDERS --out FILE --claims FILE writes the report with the claims' verdicts"
    ),
    ("reproduction", "readme"): (
        "fedcond reproduction --readme is gone from the installed fedcond: from a checkout, "
        "python -m tools.reproduction FOLDERS --out FILE --readme README.md also rewrites the README's verdicts"
    ),
}


def add_reproduction_arguments(parser: argparse.ArgumentParser) -> None:
    """The results folders, the report and its notes: ``fedcond reproduction``'s arguments, which the
    repository's ``python -m tools.reproduction`` extends with the claims."""
    parser.add_argument("folders", nargs="+", metavar="DIR", help="compare or sweep --out folders")
    parser.add_argument("--out", required=True, metavar="FILE", help="e.g. experiments/REPRODUCTION.md")
    parser.add_argument(
        "--notes",
        metavar="FILE",
        help="the hand-written discussion the report links to (default: reproduction-notes.md beside --out)",
    )


def add_moved_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of ``command`` that moved to tools/: still read (with or without a value), never
    shown, so that ``main`` answers them with the new command instead of argparse's generic error."""
    for moved_command, option in MOVED_OPTIONS:
        if moved_command == command:
            parser.add_argument(f"--{option}", nargs="?", const=True, default=None, help=argparse.SUPPRESS)


def refuse_moved_options(arguments: argparse.Namespace) -> None:
    for (command, option), message in MOVED_OPTIONS.items():
        if arguments.command == command and getattr(arguments, option, None) is not None:
            raise FedcondError(message)


def compare(arguments: argparse.Namespace) -> int:
    """``fedcond compare``: every listed method (and seed) on one scenario."""
    flags = {
        "dataset": arguments.dataset,
        "scenario": arguments.scenario,
        "num-clusters": arguments.num_clusters,
        "clients-per-cluster": arguments.clients_per_cluster,
        "num-server-rounds": arguments.rounds,
    }
    settings = {
        **read_overrides(arguments.settings, arguments.config),
        **{key: value for key, value in flags.items() if value is not None},
    }
    for key in ("method", "seed"):
        if key in settings:
            raise FedcondError(f"compare takes methods and seeds from --methods and --seeds, not {key}=")
    axes: dict[str, list[object]] = {
        "method": list(expand_methods(parse_list(arguments.methods, "--methods"))),
        "seed": list(parse_seeds(arguments.seeds)),
    }
    experiment = Experiment(settings, axes, title=arguments.title or "fedcond compare", kind="compare")
    return run_and_report(experiment, default_config(), Path(arguments.out), arguments)


def sweep(arguments: argparse.Namespace) -> int:
    """``fedcond sweep GRID``: every point of a grid file, with tables in the paper's layout."""
    experiment = read_grid_file(Path(arguments.grid), arguments.profile)
    experiment.settings.update(parse_assignments(arguments.settings))
    return run_and_report(experiment, default_config(), Path(arguments.out), arguments)


def add_resource_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpus-per-client", type=int, default=1, help="Ray CPUs per virtual client (default 1)")
    parser.add_argument(
        "--gpus-per-client", type=float, default=None, help="GPU share per virtual client (0.25 with CUDA, else 0)"
    )


def add_experiment_commands(commands: argparse._SubParsersAction) -> None:
    compare_parser = commands.add_parser(
        "compare", help="several methods (and seeds) on one scenario: metrics.csv, summary.md, convergence.png"
    )
    compare_parser.add_argument("settings", nargs="*", help="any other run-config setting, e.g. data-fraction=0.1")
    compare_parser.add_argument("--dataset")
    compare_parser.add_argument("--scenario")
    compare_parser.add_argument("--num-clusters", type=int, metavar="K")
    compare_parser.add_argument("--clients-per-cluster", type=int, metavar="N")
    compare_parser.add_argument("--rounds", type=int, metavar="R", help="federated rounds (num-server-rounds)")
    compare_parser.add_argument(
        "--methods",
        default="all",
        help="comma-separated method names, or all (default: the paper's eight), variants, competitors, pooled",
    )
    compare_parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    compare_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    compare_parser.add_argument("--title", help="title of summary.md and the plot")
    sweep_parser = commands.add_parser("sweep", help="a grid file of runs: metrics.csv, tables.md, figures")
    sweep_parser.add_argument("grid", help="grid file, e.g. experiments/e1-k-sweep.toml")
    sweep_parser.add_argument("settings", nargs="*", help="fixed settings to add, e.g. data-dir=/data")
    sweep_parser.add_argument("--profile", help="a [profiles.NAME] of the grid file, e.g. quick")
    for experiment_parser in (compare_parser, sweep_parser):
        experiment_parser.add_argument("--out", required=True, metavar="DIR", help="results folder; rerun to resume")
        experiment_parser.add_argument("--dry-run", action="store_true", help="list the runs (and which are done)")
        experiment_parser.add_argument(
            "--runner",
            choices=("flower", "in-process"),
            default="flower",
            help="flower: each run a Flower simulation on Ray (default); in-process: the round loop and every "
            "client in this process, one client at a time, no Ray (a GPU machine without Ray; no SecAgg+)",
        )
        experiment_parser.add_argument(
            "--parallel",
            type=int,
            default=1,
            metavar="N",
            help="with --runner in-process: N runs at a time, each in its own process (a GPU takes several)",
        )
        add_resource_flags(experiment_parser)
    report_parser = commands.add_parser("report", help="redraw the tables and figures of a compare or sweep folder")
    report_parser.add_argument("out", metavar="DIR")
    reproduction_parser = commands.add_parser(
        "reproduction", help="one Markdown report: hand-written notes, then every folder's results beside the paper's"
    )
    add_reproduction_arguments(reproduction_parser)
    add_moved_options(reproduction_parser, "reproduction")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedcond", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run one Flower simulation: fedcond run key=value ...")
    run_parser.add_argument("settings", nargs="*", help="run-config overrides, e.g. method=fedavg num-clusters=5")
    run_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    run_parser.add_argument("--dry-run", action="store_true", help="check every setting and say what would start")
    run_parser.add_argument(
        "--stop-superlink", action="store_true", help="stop Flower's local SuperLink after the run (else it stays up)"
    )
    add_resource_flags(run_parser)
    add_experiment_commands(commands)
    commands.add_parser("stop-superlink", help="stop Flower's local SuperLink of this FLWR_HOME (no other)")
    commands.add_parser("list", help="list methods, datasets, scenarios, fingerprints and conditionings")
    settings_parser = commands.add_parser("settings", help="every setting: key, default, who reads it, meaning")
    add_moved_options(settings_parser, "settings")
    deploy_parser = commands.add_parser(
        "deploy-local",
        help="one run on a real SuperLink and SuperNodes, separate processes on 127.0.0.1 (TLS, authenticated nodes)",
    )
    deploy_parser.add_argument("settings", nargs="*", help="run-config overrides, e.g. num-clusters=3")
    deploy_parser.add_argument("--nodes", type=int, help="SuperNodes to start (num-clusters x clients-per-cluster)")
    deploy_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    deploy_parser.add_argument(
        "--insecure", action="store_true", help="plain HTTP instead of TLS, no node authentication (local trials)"
    )
    deploy_parser.add_argument(
        "--keys", metavar="DIR", help="keep the SuperNodes' new key pairs in DIR (default: deleted afterwards)"
    )
    deploy_parser.add_argument("--dry-run", action="store_true", help="check every setting and say what would start")
    supernode_parser = commands.add_parser(
        "supernode",
        help="flower-supernode with its node config and files checked first, hints for Flower's refusals, "
        "and a stop that ends everything it started (every argument is flower-supernode's)",
    )
    supernode_parser.add_argument("arguments", nargs=argparse.REMAINDER, help="flower-supernode's arguments")
    submit_parser = commands.add_parser(
        "submit",
        help="a deployed run: every setting checked, then flwr run CONNECTION --stream; exits 0 only when the run "
        "completed, else 1 with the reason",
    )
    submit_parser.add_argument("connection", help="the SuperLink connection of your Flower configuration, e.g. fl")
    submit_parser.add_argument("settings", nargs="*", help="run-config settings, e.g. num-clusters=3 results-dir=/abs")
    submit_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    submit_parser.add_argument("--app", metavar="DIR", help="the app to submit (default: this fedcond)")
    export_parser = commands.add_parser("export-partitions", help="write every client's data to partition-<id>.npz")
    export_parser.add_argument("settings", nargs="*", help="run-config overrides that shape the split")
    export_parser.add_argument("--out", required=True, metavar="DIR", help="folder for the partition files")
    export_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["supernode"] and words[1:2] not in (["-h"], ["--help"]):
        # flower-supernode's own options follow: argparse would take them for fedcond's.
        arguments = argparse.Namespace(command="supernode", arguments=words[1:])
    elif words[:1] and words[0] in commands.choices:
        # Settings may come anywhere among the options (`--out X fingerprint=class-mean`), as users
        # write them: each command's own parser reads its words intermixed (the top-level parser
        # cannot: argparse does not intermix across subcommands).
        arguments = commands.choices[words[0]].parse_intermixed_args(words[1:])
        arguments.command = words[0]
    else:
        arguments = parser.parse_args(words)
    try:
        refuse_moved_options(arguments)
        if arguments.command == "list":
            return list_choices()
        if arguments.command == "stop-superlink":
            return stop_superlink()
        if arguments.command == "settings":
            return print_settings()
        if arguments.command in ("compare", "sweep"):
            return compare(arguments) if arguments.command == "compare" else sweep(arguments)
        if arguments.command == "report":
            return report(Path(arguments.out))
        if arguments.command == "reproduction":
            return reproduction(arguments.folders, arguments.out, arguments.notes)
        if arguments.command == "submit":
            from fedcond.tools.submit import submit

            return submit(arguments.connection, arguments.settings, arguments.config, arguments.app)
        if arguments.command == "supernode":
            from fedcond.tools.supernode import run_supernode

            return run_supernode(arguments.arguments)
        if arguments.command in ("deploy-local", "export-partitions"):
            if arguments.command == "export-partitions":
                return deploy.export_partitions_command(arguments.settings, arguments.out, arguments.config)
            return deploy.deploy_local(
                arguments.settings, arguments.nodes, arguments.insecure, arguments.config, arguments.keys,
                arguments.dry_run,
            )  # fmt: skip
        return run(
            arguments.settings,
            arguments.cpus_per_client,
            arguments.gpus_per_client,
            arguments.config,
            arguments.dry_run,
            arguments.stop_superlink,
        )
    except FedcondError as error:
        print(f"fedcond: error: {error}", file=sys.stderr)
        return 2


def print_settings() -> int:
    """``fedcond settings``: the table of every setting (a checkout's ``python -m tools.docs`` writes
    its two copies, pyproject.toml's block and docs/settings.md)."""
    from fedcond.tools.settings import settings

    for row in settings():
        print(f"{row.key:34} {row.default!r:12} {row.owner:24} {row.help}")
    return 0


def list_choices() -> int:
    from fedcond.data.datasets import DATASETS
    from fedcond.data.scenarios import SCENARIOS
    from fedcond.federation.methods import registry
    from fedcond.fingerprint.fingerprints import FINGERPRINTS
    from fedcond.model.conditioning import MECHANISMS

    methods = registry().values()
    print("methods:   " + ", ".join(f"{m.name} ({m.summary})" for m in methods if not (m.variant_of or m.competitor)))
    print("variants:  " + ", ".join(
        f"{m.name} (= {m.variant_of} with " + " ".join(f"{key}={value}" for key, value in m.fixed_settings) + ")"
        for m in methods if m.variant_of
    ))  # fmt: skip
    print("competitors: " + ", ".join(f"{m.name} ({m.summary})" for m in methods if m.competitor))
    print("datasets:  " + ", ".join(DATASETS))
    print("scenarios: " + ", ".join(SCENARIOS))
    print("fingerprints: " + ", ".join(FINGERPRINTS) + "; conditionings: " + ", ".join(MECHANISMS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``fedcond`` command: run, compare and deploy client-conditional federated learning on Flower.

``fedcond run method=fedavg num-server-rounds=20`` is ``flwr run`` with the node count, Ray
resources, offline environment and an absolute results folder filled in for you; ``compare`` and
``sweep`` run many configurations as in-process simulations and report them; ``deploy-local``
runs the same app on real SuperLink and SuperNode processes. Every setting is validated (data
files included) before Flower starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
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
    write_metrics,
)
from fedcond.history import run_status, unused_run_folder

# flwr 1.42 checks for updates, posts telemetry and rebuilds the app's environment per run unless
# told not to; all three fail or mislead on a machine without internet.
OFFLINE_ENVIRONMENT = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    # A single-machine simulation needs no network: this makes the local Ray bind to loopback.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def app_directory() -> Path:
    """The Flower app (the folder whose pyproject.toml declares it): the source checkout."""
    folder = Path(__file__).resolve().parent.parent
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file() or "tool" not in tomllib.loads(pyproject.read_text()):
        raise FedcondError(f"no Flower app at {folder}; install fedcond from a source checkout (pip install -e .)")
    return folder


def parse_assignments(assignments: Sequence[str]) -> dict[str, object]:
    """``key=value`` words into run-config values (TOML literals; bare words are strings)."""
    values: dict[str, object] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise FedcondError(f"'{assignment}' is not key=value; write e.g. method=fedavg")
        try:
            values[key.strip()] = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = raw.strip()
    return values


def default_config() -> dict[str, object]:
    return tomllib.loads((app_directory() / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def to_run_config_string(values: dict[str, object]) -> str:
    """Flower's ``--run-config`` syntax: space-separated TOML assignments, strings quoted."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


def read_override_file(path: str | None) -> dict[str, object]:
    """An experiment file: a flat TOML table of run-config keys (the format ``flwr run`` takes too)."""
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FedcondError(f"no experiment file {path}; see experiments/README.md for the ones that exist") from None
    except tomllib.TOMLDecodeError as error:
        raise FedcondError(f"{path} is not valid TOML ({error}); fix the file") from None


def read_overrides(assignments: Sequence[str], override_file: str | None) -> dict[str, object]:
    """An experiment file's settings, then the command line's ``key=value`` words over them."""
    return {**read_override_file(override_file), **parse_assignments(assignments)}


def prepare(assignments: Sequence[str], override_file: str | None = None) -> tuple[RunConfig, dict[str, object]]:
    """Validate everything (data files included) before Flower starts, and fill the results folder."""
    from fedcond.methods import check_held_out, get_method
    from fedcond.scenarios import scenario_for, validate_without_data

    overrides = read_overrides(assignments, override_file)
    config = RunConfig.from_mapping({**default_config(), **overrides})
    validate_without_data(config)
    check_held_out(get_method(config.method), config)
    scenario_for(config)  # loads the data and splits it: missing or corrupt files stop here
    # The folder is named here, so that this process can tell afterwards whether the run finished.
    folder = unused_run_folder(config)
    overrides["results-dir"] = str(folder.parent)
    overrides["run-name"] = folder.name
    if config.data_dir:
        overrides["data-dir"] = str(config.resolved_data_dir())
    return config, overrides


def default_gpus_per_client() -> float:
    """A share of the GPU per virtual client where CUDA exists (Ray hides GPUs from 0-GPU actors)."""
    import torch

    return 0.25 if torch.cuda.is_available() else 0.0


def run(
    assignments: Sequence[str], cpus_per_client: int, gpus_per_client: float | None, override_file: str | None = None
) -> int:
    config, overrides = prepare(assignments, override_file)
    gpus = default_gpus_per_client() if gpus_per_client is None else gpus_per_client
    flwr = str(Path(sys.executable).with_name("flwr"))
    if not Path(flwr).is_file():
        flwr = shutil.which("flwr") or "flwr"
    federation = (
        f"num-supernodes={config.num_clients} client-resources-num-cpus={cpus_per_client} "
        f"client-resources-num-gpus={gpus}"
    )
    command = [flwr, "run", str(app_directory()), "--stream", "--run-config", to_run_config_string(overrides),
               "--federation-config", federation]  # fmt: skip
    environment = {**os.environ, **OFFLINE_ENVIRONMENT}
    # flwr starts `flower-superlink` by name: make this environment's scripts findable unactivated.
    scripts = str(Path(sys.executable).parent)
    environment["PATH"] = os.pathsep.join([scripts, environment.get("PATH", "")])
    # flwr's local SuperLink keeps the cwd it starts in; a neutral one keeps it out of the source tree.
    flwr_home = Path(environment.get("FLWR_HOME", Path.home() / ".flwr"))
    flwr_home.mkdir(parents=True, exist_ok=True)
    folder = Path(str(overrides["results-dir"]), str(overrides["run-name"]))
    print(f"fedcond: {config.num_clients} clients, results in {folder}", flush=True)
    returncode = subprocess.call(command, env=environment, cwd=flwr_home)
    # `flwr run --stream` exits 0 even when the ServerApp fails: the run's own record decides.
    status = run_status(folder)
    if status != "finished":
        print(
            f"fedcond: error: the run did not finish (status: {status}); the reason is printed above", file=sys.stderr
        )
        return returncode or 1
    return returncode


def simulation_runner(cpus_per_client: float, gpus_per_client: float | None) -> Callable[[RunConfig], None]:
    """Runs one configuration as an in-process Flower simulation (ServerApp thread, Ray clients)."""
    from strategies.simulation import simulate

    gpus = default_gpus_per_client() if gpus_per_client is None else gpus_per_client
    for name, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return lambda config: simulate(config, cpus_per_client=cpus_per_client, gpus_per_client=gpus, quiet=True)


def run_and_report(experiment: Experiment, base: dict[str, object], out: Path, arguments: argparse.Namespace) -> int:
    """Run what is not finished yet, then write metrics.csv and the reports; 1 if any run failed."""
    if arguments.dry_run:
        print(describe_plan(experiment, base, out))
        return 0
    run_experiment(experiment, base, out, simulation_runner(arguments.cpus_per_client, arguments.gpus_per_client),
                   sys.stdout)  # fmt: skip
    return report(out)


def report(out: Path) -> int:
    """(Re)write ``metrics.csv`` and the reports of a compare or sweep folder, and print them."""
    from fedcond.tools.report import render

    experiment = load_experiment(out)
    write_metrics(experiment, out)
    failures = failed_runs(experiment, out)
    text = render(out, experiment.title, experiment.kind, experiment.tables,
                  [column_name(axis) for axis in experiment.setting_axes], failures)  # fmt: skip
    print(text)
    print(f"fedcond: metrics.csv and reports written to {out}")
    if failures:
        print(f"fedcond: error: {len(failures)} run(s) did not finish; see summary.md", file=sys.stderr)
        return 1
    return 0


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
    compare_parser.add_argument("--methods", default="all", help="comma-separated method names, or all (default)")
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
        add_resource_flags(experiment_parser)
    report_parser = commands.add_parser("report", help="redraw the tables and figures of a compare or sweep folder")
    report_parser.add_argument("out", metavar="DIR")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedcond", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run one Flower simulation: fedcond run key=value ...")
    run_parser.add_argument("settings", nargs="*", help="run-config overrides, e.g. method=fedavg num-clusters=5")
    run_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    add_resource_flags(run_parser)
    add_experiment_commands(commands)
    commands.add_parser("list", help="list methods, datasets, scenarios, fingerprints and conditionings")
    deploy_parser = commands.add_parser(
        "deploy-local", help="one run on a real SuperLink and SuperNodes, separate processes on 127.0.0.1 (TLS)"
    )
    deploy_parser.add_argument("settings", nargs="*", help="run-config overrides, e.g. num-clusters=3")
    deploy_parser.add_argument("--nodes", type=int, help="SuperNodes to start (num-clusters x clients-per-cluster)")
    deploy_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    deploy_parser.add_argument("--insecure", action="store_true", help="plain HTTP instead of TLS (local trials)")
    export_parser = commands.add_parser("export-partitions", help="write every client's data to partition-<id>.npz")
    export_parser.add_argument("settings", nargs="*", help="run-config overrides that shape the split")
    export_parser.add_argument("--out", required=True, metavar="DIR", help="folder for the partition files")
    export_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "list":
            return list_choices()
        if arguments.command in ("compare", "sweep"):
            return compare(arguments) if arguments.command == "compare" else sweep(arguments)
        if arguments.command == "report":
            return report(Path(arguments.out))
        if arguments.command in ("deploy-local", "export-partitions"):
            from fedcond.tools import deploy  # imports this module: loaded on use

            if arguments.command == "export-partitions":
                return deploy.export_partitions_command(arguments.settings, arguments.out, arguments.config)
            return deploy.deploy_local(arguments.settings, arguments.nodes, arguments.insecure, arguments.config)
        return run(arguments.settings, arguments.cpus_per_client, arguments.gpus_per_client, arguments.config)
    except FedcondError as error:
        print(f"fedcond: error: {error}", file=sys.stderr)
        return 2


def list_choices() -> int:
    from fedcond.config import CONDITIONINGS
    from fedcond.datasets import DATASETS
    from fedcond.fingerprint import FINGERPRINTS
    from fedcond.methods import registry
    from fedcond.scenarios import SCENARIOS

    print("methods:   " + ", ".join(f"{name} ({method.summary})" for name, method in registry().items()))
    print("datasets:  " + ", ".join(DATASETS))
    print("scenarios: " + ", ".join(SCENARIOS))
    print("fingerprints: " + ", ".join(FINGERPRINTS) + "; conditionings: " + ", ".join(CONDITIONINGS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

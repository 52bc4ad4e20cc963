"""The ``fedcond`` command: validate settings, then hand the run to ``flwr run`` as a simulation.

``fedcond run method=fedavg num-server-rounds=20`` is ``flwr run`` with the node count, Ray
resources, offline environment and an absolute results folder filled in for you.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
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


def prepare(assignments: Sequence[str], override_file: str | None = None) -> tuple[RunConfig, dict[str, object]]:
    """Validate everything (data files included) before Flower starts, and fill the results folder."""
    from fedcond.methods import check_held_out, get_method
    from fedcond.scenarios import scenario_for, validate_without_data

    overrides = {**read_override_file(override_file), **parse_assignments(assignments)}
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedcond", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run one Flower simulation: fedcond run key=value ...")
    run_parser.add_argument("settings", nargs="*", help="run-config overrides, e.g. method=fedavg num-clusters=5")
    run_parser.add_argument("--config", metavar="FILE", help="experiment file (TOML run-config overrides)")
    run_parser.add_argument("--cpus-per-client", type=int, default=1, help="Ray CPUs per virtual client (default 1)")
    run_parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=None,
        help="GPU share per virtual client (0.25 with CUDA, else 0)",
    )
    commands.add_parser("list", help="list methods, datasets, scenarios, fingerprints and conditionings")
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "list":
            return list_choices()
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

"""What every tool that drives Flower's own executables shares: the run settings (the app's
defaults, an experiment file, ``key=value`` words), the environment Flower needs offline, where
its executables are, and how to tell whether a run finished (``flwr run`` does not say).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.methods import declared_options, run_config
from fedcond.records.checkpoint import RESUME, resume_settings
from fedcond.records.history import run_status, unused_run_folder

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
    folder = Path(__file__).resolve().parents[2]
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file() or "tool" not in tomllib.loads(pyproject.read_text()):
        raise FedcondError(f"no Flower app at {folder}; install fedcond from a source checkout (pip install -e .)")
    return folder


def executable(name: str) -> str:
    """A Flower command of this environment (next to its python), whether or not it is activated."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.is_file() else (shutil.which(name) or name)


def flower_environment(**extra: str) -> dict[str, str]:
    """This process's environment, offline, with this environment's scripts first on PATH: Flower's
    processes start one another by name (``flwr`` starts ``flower-superlink``)."""
    environment = {**os.environ, **OFFLINE_ENVIRONMENT, **extra}
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    return environment


def to_run_config_string(values: dict[str, object]) -> str:
    """Flower's ``--run-config`` (and ``--node-config``) syntax: space-separated TOML assignments."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


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
    """Every run-config key at its default, from the settings' declarations: what pyproject.toml's
    ``[tool.flwr.app.config]`` holds (generated from them; tests/test_config.py), and what an install
    from a wheel, which has no pyproject.toml, runs with."""
    from fedcond.tools.settings import settings

    return {row.key: row.default for row in settings()}


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


def settings_from(assignments: Sequence[str], override_file: str | None) -> RunConfig:
    """The run configuration from defaults, an experiment file and ``key=value`` words, checked."""
    overrides = read_overrides(assignments, override_file)
    config = run_config({**default_config(), **overrides}, overrides)
    check_run(config, given=overrides.keys())
    return config


def run_settings(assignments: Sequence[str], override_file: str | None) -> RunConfig:
    """What ``fedcond run`` would run, checked without reading the data (its dry run): as
    ``settings_from``, but a ``resume=`` takes its run's recorded settings, as ``prepare`` does."""
    overrides = read_overrides(assignments, override_file)
    if not overrides.get(RESUME.key):
        return settings_from(assignments, override_file)
    return resumed_settings(overrides, load_data=False)


def resumed_settings(overrides: dict[str, object], load_data: bool) -> RunConfig:
    """A ``resume=``'s settings: its run's record, with what ``overrides`` may change, checked."""
    config = resume_settings(Path(str(overrides[RESUME.key])), overrides, declared_options())
    check_run(config, load_data=load_data, given=overrides.keys())
    return config


def prepare(assignments: Sequence[str], override_file: str | None = None) -> tuple[RunConfig, dict[str, object]]:
    """Check everything (data files included) before Flower starts, and name the results folder.

    Returns the configuration and the overrides to pass to ``flwr run`` (absolute paths: the
    ServerApp runs in the SuperLink's working directory, not ours). With ``resume=FOLDER`` the run
    continues in that folder with its recorded settings (``fedcond.records.checkpoint``).
    """
    overrides = read_overrides(assignments, override_file)
    if overrides.get(RESUME.key):
        # Every setting as run.json records it, passed on in full: the clients see only the run
        # config (a deployed client cannot read the server's run.json).
        config = resumed_settings(overrides, load_data=True)
        return config, config.to_mapping()
    config = run_config({**default_config(), **overrides}, overrides)
    check_run(config, load_data=True)
    # The folder is named here, so that this process can tell afterwards whether the run finished.
    folder = unused_run_folder(config)
    overrides["results-dir"] = str(folder.parent)
    overrides["run-name"] = folder.name
    if config.data_dir:
        overrides["data-dir"] = str(config.resolved_data_dir())
    return config, overrides


def run_folder(overrides: dict[str, object]) -> Path:
    return Path(str(overrides["results-dir"]), str(overrides["run-name"]))


def unfinished(folder: Path, rounds: int) -> str | None:
    """Why the run of ``folder`` did not finish its ``rounds`` rounds, or None if it did.

    ``flwr run --stream`` exits 0 even when the ServerApp fails: the run's own record decides. A
    resumed run that extends a finished one says ``finished`` from the start: the rounds tell.
    """
    status = run_status(folder)
    if status != "finished":
        return status
    completed = json.loads((folder / "run.json").read_text()).get("rounds_completed")
    if completed != rounds:
        return f"stopped after {completed} of {rounds} rounds (see Flower's output)"
    return None

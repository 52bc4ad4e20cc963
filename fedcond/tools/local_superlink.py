"""Flower's local SuperLink: the one ``flwr run`` starts for a Flower home, found and stopped by PID.

``flwr run`` with a local federation starts ``flower-superlink --simulation ... --log-file
$FLWR_HOME/local-superlink/superlink.log`` detached and records its PID nowhere; it keeps running
after the run (so the next run starts about 3 s faster) with the environment and working directory
it started with. The log-file argument names the Flower home it belongs to, so that exact process is
found among this user's processes, never another user's or another Flower home's SuperLink (a
``pkill -f flower-superlink`` ends them all).

Flower puts every local SuperLink on the same two ports (39091, 39093) whatever its home, so a run
of one Flower home would attach to another home's (another user's job on a shared machine) and
then find its own "not running". Each home therefore gets ports of its own (``ports_of``), chosen
free once and kept in the home, which ``fedcond run`` hands to ``flwr run``.

``flwr run`` reuses a running local SuperLink whatever environment started it, and its ServerApp,
simulation and Ray workers run with that one: ``foreign`` says when the running one was started
from another environment (another ``flower-superlink``, so another Python and packages; another
``PYTHONPATH``, so another fedcond checkout; other offline settings) or before this environment's
Flower or fedcond was installed again, and ``fedcond run`` then refuses to use it (``check_reusable``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

import psutil

from fedcond.errors import FedcondError
from fedcond.tools.flwr_commands import OFFLINE_ENVIRONMENT
from fedcond.tools.processes import STOP_GRACE

#: Written into a run's folder by ``fedcond run``: which SuperLink served it and how to stop it.
RECORD_FILE = "local-superlink.json"
#: In a Flower home: the ports of its local SuperLink (``ports_of``).
PORTS_FILE = "fedcond-local-ports.json"
#: flwr's variables for the local SuperLink's ports (flwr/cli/constant.py).
PORT_VARIABLES = ("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", "FLWR_LOCAL_CONTROL_API_PORT")


def ports_of(home: Path, environment: dict[str, str] | None = None) -> dict[str, str]:
    """The port variables for ``home``'s local SuperLink: those the environment sets already, else the
    home's own pair (chosen free on first use and kept in ``PORTS_FILE``), never Flower's defaults."""
    from fedcond.tools.deploy import free_ports

    environment = os.environ if environment is None else environment
    if all(variable in environment for variable in PORT_VARIABLES):
        return {variable: environment[variable] for variable in PORT_VARIABLES}
    path = home / PORTS_FILE
    try:
        kept = json.loads(path.read_text())
        ports = {variable: str(int(kept[variable])) for variable in PORT_VARIABLES}
    except (OSError, ValueError, KeyError, TypeError):
        ports = dict(zip(PORT_VARIABLES, map(str, free_ports(len(PORT_VARIABLES))), strict=True))
        home.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ports, indent=2) + "\n")
    return {**ports, **{variable: environment[variable] for variable in PORT_VARIABLES if variable in environment}}


def flower_home(environment: dict[str, str] | None = None) -> Path:
    """The Flower home ``flwr`` uses (``FLWR_HOME``, else ``~/.flwr``)."""
    environment = os.environ if environment is None else environment
    return Path(environment.get("FLWR_HOME", Path.home() / ".flwr"))


def log_file(home: Path) -> Path:
    """The log file Flower passes its local SuperLink for ``home`` (flwr/cli/local_superlink.py)."""
    return home / "local-superlink" / "superlink.log"


def find(home: Path) -> psutil.Process | None:
    """The running local SuperLink of Flower home ``home`` started by this user, if any."""
    wanted = str(log_file(home).resolve())
    user = psutil.Process().username()
    for process in psutil.process_iter(["cmdline", "username"], ad_value=None):
        words = process.info["cmdline"] or []
        if process.info["username"] != user or not any(Path(word).name == "flower-superlink" for word in words[:2]):
            continue
        if "--log-file" in words[:-1] and str(Path(words[words.index("--log-file") + 1]).resolve()) == wanted:
            return process
    return None


#: Variables of the environment that change what a local SuperLink's runs do: which fedcond checkout
#: its processes import (PYTHONPATH) and the offline settings fedcond gives Flower.
ENVIRONMENT_VARIABLES = ("PYTHONPATH", *OFFLINE_ENVIRONMENT)
#: The installed distributions whose code a running SuperLink holds from the moment it started.
DISTRIBUTIONS = ("flwr", "fedcond")


def foreign(process: psutil.Process, environment: Mapping[str, str], superlink: Path) -> str | None:
    """How the local SuperLink ``process`` differs from what a run with ``environment`` and this
    environment's ``superlink`` executable would start ("started from ..."), or None: the same."""
    try:
        words = process.cmdline()
        theirs = process.environ()
        started = process.create_time()
        cwd = process.cwd()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None  # gone (or not ours to read): flwr run starts or finds another
    script = next((word for word in words[:2] if Path(word).name == "flower-superlink"), None)
    if script is not None and os.path.realpath(Path(cwd, script)) != os.path.realpath(superlink):
        return f"from another environment: it runs {script}, this one has {superlink}"
    for variable in ENVIRONMENT_VARIABLES:
        if theirs.get(variable) != environment.get(variable):
            return (
                f"with {variable}={theirs.get(variable, '(unset)')}, and this run has "
                f"{variable}={environment.get(variable, '(unset)')}"
            )
    for name, installed in installed_at().items():
        if installed > started:
            return f"before {name} {metadata.version(name)} was installed here: it runs the version installed before"
    return None


#: A distribution's metadata file: a wheel's (dist-info), or the egg-info an editable install leaves in
#: the checkout (found first from there, as the current folder is on the path).
METADATA_FILES = ("METADATA", "PKG-INFO")


def installed_at() -> dict[str, float]:
    """When each of ``DISTRIBUTIONS`` was last installed: the newest of its metadata folders' times
    (pip makes them anew), over every copy of its metadata on the path."""
    times: dict[str, float] = {}
    for name in DISTRIBUTIONS:
        for distribution in metadata.distributions(name=name):
            for file in distribution.files or []:
                path = Path(str(file.locate()))
                if file.name in METADATA_FILES and path.exists():
                    times[name] = max(times.get(name, 0.0), path.parent.stat().st_mtime)
    return times


def check_reusable(home: Path, environment: Mapping[str, str], superlink: Path) -> None:
    """Refuse (one line) a run that ``flwr run`` would hand to a local SuperLink of ``home`` started
    from another environment (``foreign``).

    Refused rather than restarted: stopping it would also end whatever it is running now, a run of
    another terminal of this Flower home (quite likely, from that other environment), and fedcond
    cannot tell from outside whether it is idle; the operator can, and ``fedcond stop-superlink``
    stops it in one command, after which ``flwr run`` starts one with this environment."""
    process = find(home)
    if process is None:
        return
    why = foreign(process, environment, superlink)
    if why is not None:
        raise FedcondError(
            f"Flower's local SuperLink of {home} (PID {process.pid}) was started {why}; flwr run would reuse it as it "
            "is: stop it with fedcond stop-superlink (or make stop-superlink) once its runs are over, then run again"
        )


def record(folder: Path, home: Path) -> psutil.Process | None:
    """Write which local SuperLink served the run in ``folder`` (``RECORD_FILE``, when the run made its
    folder); that SuperLink, or None when none is running."""
    process = find(home)
    if process is not None and folder.is_dir():
        entry = {"pid": process.pid, "flwr_home": str(home), "log": str(log_file(home)),
                 "stop": "fedcond stop-superlink"}  # fmt: skip
        (folder / RECORD_FILE).write_text(json.dumps(entry, indent=2) + "\n")
    return process


def stop(home: Path) -> int | None:
    """End the local SuperLink of ``home`` (``terminate``); the PID it had, or None when none was running."""
    process = find(home)
    if process is None:
        return None
    terminate(process)
    return process.pid


def terminate(process: psutil.Process) -> None:
    """End ``process`` and what it started: SIGTERM, then SIGKILL after ``STOP_GRACE``."""
    family = [process, *process.children(recursive=True)]
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            continue
    _, left = psutil.wait_procs(family, timeout=STOP_GRACE)
    for member in left:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=5)

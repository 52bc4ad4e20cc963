"""Real deployment on one machine: ``fedcond deploy-local`` and ``fedcond export-partitions``.

``deploy-local`` starts what a real federation runs on separate machines, as separate processes on
127.0.0.1: one ``flower-superlink`` and N ``flower-supernode``s, each SuperNode holding only its own
client's partition file, all talking TLS with a fresh private CA (``--insecure`` for plain HTTP).
It submits the run with ``flwr run``, prints where the results are, and stops every process it
started, also on error, Ctrl+C or SIGTERM. No Flower import here: it runs Flower's executables.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedcond.tools.cli import (
    OFFLINE_ENVIRONMENT,
    app_directory,
    default_config,
    prepare,
    read_overrides,
    to_run_config_string,
)
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.history import run_status

LOOPBACK = "127.0.0.1"
CERTIFICATE_SCRIPT = Path("scripts") / "generate-certificates.sh"
# Flower's default ports and the local simulation SuperLink's: never take them, others may use them.
RESERVED_PORTS = frozenset(range(9091, 9096)) | frozenset(range(39091, 39096))
CONNECTION = "fedcond-local"  # the connection name deploy-local writes into its private FLWR_HOME
START_TIMEOUT = 120.0  # seconds the SuperLink may take to listen (imports are slow on a busy machine)
# Environment variable marking every process one deploy-local started (see Processes.stop_all).
DEPLOY_TAG = "FEDCOND_DEPLOY_TAG"
STOP_GRACE = 15.0  # seconds between SIGTERM and SIGKILL: a SuperNode takes ~8 s to shut down


@dataclass(frozen=True)
class Certificates:
    """The PEM files ``scripts/generate-certificates.sh`` writes."""

    ca: Path  # every SuperNode and `flwr` trust this
    server_cert: Path  # the SuperLink's certificate, naming its host in subjectAltName
    server_key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key")


def generate_certificates(host: str, folder: Path) -> Certificates:
    """A private CA and a server certificate for ``host``, by the script the deployment guide uses."""
    if shutil.which("openssl") is None:
        raise FedcondError("openssl not found; install it (apt-get install openssl) or pass --insecure")
    script = app_directory() / CERTIFICATE_SCRIPT
    result = subprocess.run(["bash", str(script), host, str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise FedcondError(f"{script} failed ({reason}); run it by hand to see why")
    return Certificates.in_folder(folder)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback, none of Flower's defaults."""
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            probe = socket.socket()
            probe.bind((LOOPBACK, 0))
            if probe.getsockname()[1] in RESERVED_PORTS:
                probe.close()
                continue
            sockets.append(probe)  # held open until all are chosen, so no port is handed out twice
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


def executable(name: str) -> str:
    """A Flower command of this environment (next to its python), whether or not it is activated."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.is_file() else (shutil.which(name) or name)


def tls_flags_superlink(certificates: Certificates | None) -> list[str]:
    if certificates is None:
        return ["--insecure"]
    return [
        "--ssl-ca-certfile", str(certificates.ca),
        "--ssl-certfile", str(certificates.server_cert),
        "--ssl-keyfile", str(certificates.server_key),
    ]  # fmt: skip


def superlink_command(port: int, certificates: Certificates | None) -> list[str]:
    """One SuperLink serving Fleet (SuperNodes), Control (`flwr`) and Runtime (ServerApp) on ``port``."""
    return [
        executable("flower-superlink"), *tls_flags_superlink(certificates), "--host", LOOPBACK,
        "--port", str(port), "--disable-runtime-dependency-installation",
    ]  # fmt: skip


def node_config_string(values: dict[str, object]) -> str:
    """``--node-config`` syntax, the same as ``--run-config``'s: ``partition-id=0 partition-file="/p.npz"``."""
    return to_run_config_string(values)


def supernode_command(
    superlink_port: int, port: int, node_config: dict[str, object], certificates: Certificates | None
) -> list[str]:
    """One SuperNode: dials the SuperLink, serves its own ClientApps on ``port`` (loopback)."""
    tls = ["--insecure"] if certificates is None else ["--root-certificates", str(certificates.ca)]
    return [
        executable("flower-supernode"), *tls, "--superlink", f"{LOOPBACK}:{superlink_port}",
        "--host", LOOPBACK, "--port", str(port), "--node-config", node_config_string(node_config),
    ]  # fmt: skip


def flwr_connection_toml(superlink_port: int, certificates: Certificates | None) -> str:
    """``$FLWR_HOME/config.toml`` naming this SuperLink as the default connection of ``flwr``."""
    security = "insecure = true" if certificates is None else f'root-certificates = "{certificates.ca}"'
    return (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{LOOPBACK}:{superlink_port}"\n{security}\n'
    )


def descendants(roots: set[int]) -> set[int]:
    """Every live process below ``roots``, by parent pid (Flower starts SuperExec in a new session)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces and parentheses: the ppid follows the last ')'.
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found: set[int] = set()
    frontier = list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead: only its parent's wait() is missing.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, signum: int, group: bool) -> None:
    with suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)


def tagged(tag: str) -> set[int]:
    """Live processes whose environment carries ``DEPLOY_TAG=tag``: everything a launch started,
    however deep, even after its parent died and it was handed to init."""
    needle = f"{DEPLOY_TAG}={tag}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return {pid for pid in found if alive(pid)}


class Processes:
    """Every process the launcher starts, each in its own session, all stopped together."""

    def __init__(self, environment: dict[str, str], log_folder: Path) -> None:
        # Every child inherits the tag, so stop_all finds processes started while it was stopping.
        self.tag = uuid.uuid4().hex
        self.environment = {**environment, DEPLOY_TAG: self.tag}
        self.log_folder = log_folder
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, command: Sequence[str], cwd: Path, log: bool = True) -> subprocess.Popen[bytes]:
        """Start ``command``; its output goes to ``<log folder>/<name>.log`` (else to ours)."""
        output: IO[bytes] | None = (self.log_folder / f"{name}.log").open("wb") if log else None
        try:
            # A new session per process: Ctrl+C reaches only this launcher, which then stops them in order.
            process = subprocess.Popen(
                list(command), cwd=cwd, env=self.environment, stdout=output, stderr=subprocess.STDOUT if log else None,
                start_new_session=True,
            )  # fmt: skip
        finally:
            if output is not None:
                output.close()  # the child holds its own copy
        self.started.append((name, process))
        return process

    def log_path(self, name: str) -> Path:
        return self.log_folder / f"{name}.log"

    def stopped(self) -> list[str]:
        """Names of started processes that have exited."""
        return [name for name, process in self.started if process.poll() is not None]

    def stop_all(self) -> None:
        """SIGTERM every process and its descendants, SIGKILL what is left after ``STOP_GRACE``."""
        leaders = {process.pid for _, process in self.started if process.poll() is None}
        family = descendants(leaders) | tagged(self.tag)  # before parents exit and orphan them
        for pid in leaders:
            _signal(pid, signal.SIGTERM, group=True)
        for pid in family:
            _signal(pid, signal.SIGTERM, group=False)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and any(alive(pid) for pid in leaders | family):
            for _, process in self.started:
                process.poll()  # reap our own children so they don't linger as zombies
            # A SuperNode may start a ClientApp process while shutting down: stop late arrivals too.
            for pid in tagged(self.tag) - family:
                family.add(pid)
                _signal(pid, signal.SIGTERM, group=False)
            time.sleep(0.2)
        for pid in leaders:
            _signal(pid, signal.SIGKILL, group=True)
        for _ in range(5):
            left = {pid for pid in family if alive(pid)} | tagged(self.tag)
            if not left:
                break
            for pid in left:
                _signal(pid, signal.SIGKILL, group=False)
            time.sleep(0.2)
        for _, process in self.started:
            with suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)


def wait_until_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Return once something accepts connections on ``port``; fail if ``process`` exits first."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise FedcondError(f"the SuperLink stopped while starting (exit {process.returncode}); see {log}")
        with socket.socket() as probe:
            if probe.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.3)
    raise FedcondError(f"the SuperLink did not listen on {LOOPBACK}:{port} within {START_TIMEOUT:.0f} s; see {log}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a killed terminal, a CI timeout) and SIGINT take the Ctrl+C clean-up path."""

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
        # A launcher started in the background (`cmd &`, nohup, some CI runners) inherits SIGINT
        # ignored, and Python then never raises KeyboardInterrupt: Ctrl+C must still clean up.
        previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


def settings_from(assignments: Sequence[str], override_file: str | None) -> RunConfig:
    """The run configuration from defaults, an experiment file and ``key=value`` words."""
    return RunConfig.from_mapping({**default_config(), **read_overrides(assignments, override_file)})


def export_partitions_command(assignments: Sequence[str], out: str, override_file: str | None = None) -> int:
    """``fedcond export-partitions``: one ``partition-<id>.npz`` per client, to copy to its machine."""
    from fedcond.client_data import export_partitions
    from fedcond.scenarios import validate_without_data

    config = settings_from(assignments, override_file)
    validate_without_data(config)
    folder = Path(out).expanduser().resolve()
    paths = export_partitions(config, folder)
    print(f"fedcond: {len(paths)} partition files in {folder} (partition-0.npz .. partition-{len(paths) - 1}.npz)")
    print(
        "fedcond: copy partition-<i>.npz to client machine i and start its SuperNode with\n"
        f"  --node-config 'partition-id=<i> num-partitions={len(paths)} partition-file=\"/path/to/partition-<i>.npz\"'"
    )
    return 0


def deploy_local(
    assignments: Sequence[str],
    nodes: int | None = None,
    insecure: bool = False,
    override_file: str | None = None,
) -> int:
    """Run one configuration on a real SuperLink and ``nodes`` SuperNodes on loopback; 0 if it finished."""
    config, overrides = prepare(assignments, override_file)
    nodes = config.num_clients if nodes is None else nodes
    if nodes != config.num_clients:
        raise FedcondError(
            f"--nodes {nodes} but num-clusters x clients-per-cluster = {config.num_clients}; "
            f"pass --nodes {config.num_clients} or settings with {nodes} clients (e.g. num-clusters={nodes} "
            "clients-per-cluster=1)"
        )
    folder = Path(str(overrides["results-dir"]), str(overrides["run-name"]))
    workdir = Path(tempfile.mkdtemp(prefix="fedcond-deploy-"))
    environment = {**os.environ, **OFFLINE_ENVIRONMENT, "FLWR_HOME": str(workdir / "flwr-home")}
    # flwr's processes start one another by name: make this environment's scripts findable unactivated.
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment.get("PATH", "")])
    # N SuperNodes share this machine's cores; without this every ClientApp's torch takes them all.
    environment["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nodes))
    for name in ("flwr-home", "logs", "superlink", *(f"supernode-{i}" for i in range(nodes))):
        (workdir / name).mkdir(parents=True, exist_ok=True)
    processes = Processes(environment, workdir / "logs")
    succeeded = False
    try:
        with sigterm_as_interrupt():
            succeeded = _deploy(config, overrides, nodes, insecure, workdir, processes, folder)
    except KeyboardInterrupt:
        print("fedcond: interrupted; stopping every process deploy-local started", file=sys.stderr, flush=True)
        return 130
    finally:
        processes.stop_all()
        _keep_logs(workdir, folder, succeeded)
    if not succeeded:
        print(f"fedcond: error: the run did not finish (status: {run_status(folder)}); see the process logs",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"fedcond: results in {folder} (history.csv, run.json; process logs in deploy-logs/)")
    return 0


def _deploy(
    config: RunConfig,
    overrides: dict[str, object],
    nodes: int,
    insecure: bool,
    workdir: Path,
    processes: Processes,
    folder: Path,
) -> bool:
    from fedcond.client_data import export_partitions

    certificates = None if insecure else generate_certificates(LOOPBACK, workdir / "certificates")
    # Each SuperNode gets only its own client's file, as a client machine would hold only its data.
    partition_files = export_partitions(config, workdir / "partitions")
    superlink_port, *node_ports = free_ports(nodes + 1)
    security = "insecure (plain HTTP)" if insecure else "TLS"
    print(f"fedcond: SuperLink on {LOOPBACK}:{superlink_port} ({security}), {nodes} SuperNodes, work folder {workdir}",
          flush=True)  # fmt: skip
    superlink = processes.start("superlink", superlink_command(superlink_port, certificates), workdir / "superlink")
    wait_until_listening(superlink_port, superlink, processes.log_path("superlink"))
    for partition_id, (port, partition_file) in enumerate(zip(node_ports, partition_files, strict=True)):
        node_config = {"partition-id": partition_id, "num-partitions": nodes, "partition-file": str(partition_file)}
        command = supernode_command(superlink_port, port, node_config, certificates)
        processes.start(f"supernode-{partition_id}", command, workdir / f"supernode-{partition_id}")
    (workdir / "flwr-home" / "config.toml").write_text(flwr_connection_toml(superlink_port, certificates))
    print(f"fedcond: results will be in {folder}", flush=True)
    # `flwr run` from the work folder, never the source tree (see README: the app is packed from it).
    command = [executable("flwr"), "run", str(app_directory()), CONNECTION, "--stream",
               "--run-config", to_run_config_string(overrides)]  # fmt: skip
    submitter = processes.start("flwr-run", command, workdir, log=False)
    while submitter.poll() is None:
        crashed = [name for name in processes.stopped() if name != "flwr-run"]
        if crashed:
            raise FedcondError(f"{crashed[0]} stopped during the run; see {crashed[0]}.log in the process logs")
        time.sleep(0.5)
    # `flwr run --stream` exits 0 even when the ServerApp fails: the run's own record decides.
    return run_status(folder) == "finished"


def _keep_logs(workdir: Path, folder: Path, succeeded: bool) -> None:
    """Copy the process logs next to the results; delete the work folder (certificates, partitions)."""
    logs = workdir / "logs"
    if not folder.is_dir():  # the run never started: keep everything for a look
        print(f"fedcond: process logs in {logs}", file=sys.stderr)
        return
    shutil.copytree(logs, folder / "deploy-logs", dirs_exist_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
    if not succeeded:
        print(f"fedcond: process logs in {folder / 'deploy-logs'}", file=sys.stderr)

"""Real deployment on one machine: ``fedcond deploy-local`` and ``fedcond export-partitions``.

``deploy-local`` starts what a real federation runs on separate machines, as separate processes on
127.0.0.1: one ``flower-superlink`` and N ``flower-supernode``s, each SuperNode holding only its own
client's partition file, all talking TLS with a fresh private CA (``--insecure`` for plain HTTP).
It submits the run with ``flwr run``, prints where the results are, and stops every process it
started, also on error, Ctrl+C or SIGTERM. It drives Flower through its executables alone.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from fedcond.client_data import export_partitions
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.tools.certificates import Certificates, generate_certificates
from fedcond.tools.flwr_commands import (
    app_directory,
    executable,
    flower_environment,
    prepare,
    run_folder,
    settings_from,
    to_run_config_string,
    unfinished,
)
from fedcond.tools.processes import Processes

LOOPBACK = "127.0.0.1"
# Flower's default ports and the local simulation SuperLink's: never take them, others may use them.
RESERVED_PORTS = frozenset(range(9091, 9096)) | frozenset(range(39091, 39096))
CONNECTION = "fedcond-local"  # the connection name deploy-local writes into its private FLWR_HOME
START_TIMEOUT = 120.0  # seconds the SuperLink may take to listen (imports are slow on a busy machine)


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


def export_partitions_command(assignments: Sequence[str], out: str, override_file: str | None = None) -> int:
    """``fedcond export-partitions``: one ``partition-<id>.npz`` per client, to copy to its machine."""
    config = settings_from(assignments, override_file)
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
    folder = run_folder(overrides)
    workdir = Path(tempfile.mkdtemp(prefix="fedcond-deploy-"))
    environment = flower_environment(FLWR_HOME=str(workdir / "flwr-home"))
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
        reason = unfinished(folder, config.num_server_rounds)
        print(f"fedcond: error: the run did not finish (status: {reason}); see the process logs", file=sys.stderr)
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
    return unfinished(folder, config.num_server_rounds) is None


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

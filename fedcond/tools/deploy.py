"""Real deployment on one machine: ``fedcond deploy-local`` and ``fedcond export-partitions``.

``deploy-local`` starts what a real federation runs on separate machines, as separate processes on
127.0.0.1: one ``flower-superlink`` and N ``flower-supernode``s, each SuperNode holding only its own
client's partition file and its own authentication key, all talking TLS with a fresh private CA.
The SuperLink admits only SuperNodes whose public keys were registered with it (Flower's SuperNode
authentication, ``--enable-supernode-auth``); ``--insecure`` (plain HTTP, for local trials) has no
node authentication, which Flower allows over TLS only. It submits the run with ``flwr run``,
prints where the results are, and stops every process it started, also on error, Ctrl+C or
SIGTERM. It drives Flower through its executables alone.

``LocalDeployment`` is the same machinery as an object, for tests and benchmarks that need to
start, kill and restart single nodes or submit several runs to the same nodes.
"""

from __future__ import annotations

import json
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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from fedcond.config import RunConfig
from fedcond.data.client_data import export_partitions
from fedcond.errors import FedcondError
from fedcond.tools.certificates import Certificates, NodeKey, generate_certificates, generate_node_keys
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
FLWR_COMMAND_TIMEOUT = 120.0  # seconds one `flwr` CLI call (register a key, list nodes) may take
# Flower keeps a node that vanished without a goodbye "online" for two heartbeats of 30 s, and
# refuses to activate the same key again until then: a restarted node waits that long at most.
REJOIN_TIMEOUT = 2 * 30.0 + 60.0
# How often each SuperNode's SuperExec asks for a new ClientApp task (Flower's default: every 1 s).
# Every message waits half of it on average, twice a round; a poll costs a few ms of CPU.
SUPEREXEC_POLL_VARIABLE = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
SUPEREXEC_POLL_SECONDS = "0.2"


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
        # Only SuperNodes whose public keys were registered (`flwr supernode register`) may join.
        "--enable-supernode-auth",
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
    superlink_port: int,
    port: int,
    node_config: dict[str, object],
    certificates: Certificates | None,
    private_key: Path | None = None,
) -> list[str]:
    """One SuperNode: dials the SuperLink, serves its own ClientApps on ``port`` (loopback); with
    ``private_key`` it proves to the SuperLink that it holds the key whose public half was registered."""
    tls = ["--insecure"] if certificates is None else ["--root-certificates", str(certificates.ca)]
    authentication = [] if private_key is None else ["--auth-supernode-private-key", str(private_key)]
    return [
        executable("flower-supernode"), *tls, *authentication, "--superlink", f"{LOOPBACK}:{superlink_port}",
        "--host", LOOPBACK, "--port", str(port), "--node-config", node_config_string(node_config),
    ]  # fmt: skip


def fleet_proxy_server(listen: str, superlink_port: int, certificates_folder: Path) -> str:
    """nginx's ``server`` block that exposes a SuperLink's Fleet API alone (docs/deployment.md).

    In flwr 1.42 one SuperLink port serves Fleet (the SuperNodes'), Control (``flwr``: runs, key
    registration) and Runtime (its ServerApp); Control has no credential in the open-source
    distribution, so the SuperLink listens on loopback and this proxy passes ``/v1/fleet/`` only, over
    TLS with the SuperLink's own certificate, and answers everything else 404.
    """
    folder = certificates_folder
    return f"""server {{
    listen {listen} ssl;                       # what the SuperNodes dial: --superlink HOST:PORT
    ssl_certificate     {folder / "server.pem"};
    ssl_certificate_key {folder / "server.key"};
    client_max_body_size 0;                    # model updates can be large
    proxy_request_buffering off;               # and stream through, never buffered on disk
    proxy_buffering off;
    proxy_read_timeout 300s;
    location /v1/fleet/ {{
        proxy_pass https://127.0.0.1:{superlink_port};   # the SuperLink, on loopback only
        proxy_ssl_trusted_certificate {folder / "ca.crt"};
        proxy_ssl_verify on;
        proxy_ssl_name localhost;              # a DNS name in its certificate: nginx checks names
        proxy_http_version 1.1;
    }}
    location / {{ return 404; }}                 # Control and Runtime stay on loopback
}}
"""


def flwr_connection_toml(superlink_port: int, certificates: Certificates | None) -> str:
    """``$FLWR_HOME/config.toml`` naming this SuperLink as the default connection of ``flwr``."""
    security = "insecure = true" if certificates is None else f'root-certificates = "{certificates.ca}"'
    return (
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{LOOPBACK}:{superlink_port}"\n{security}\n'
    )


def node_name(partition_id: int) -> str:
    """A SuperNode's process, log and key name."""
    return f"supernode-{partition_id}"


def check_keys_folder(folder: Path, nodes: int) -> None:
    """Refuse, before anything starts, a ``--keys`` folder that already holds one of the keys to write."""
    if folder.exists() and not folder.is_dir():
        raise FedcondError(f"--keys {folder} is a file; name a folder (it is created if missing)")
    for partition_id in range(nodes):
        key = NodeKey.in_folder(folder, node_name(partition_id))
        for path in (key.private, key.public):
            if path.exists():
                raise FedcondError(
                    f"{path} exists; deploy-local makes new keys per deployment and never replaces any: "
                    "name an empty --keys folder, or move the old keys away"
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


@dataclass
class DeployedNode:
    """One SuperNode of a local deployment: its partition, port, key and the SuperLink's id for it."""

    partition_id: int
    num_partitions: int
    port: int
    partition_file: Path
    key: NodeKey | None  # None in insecure mode: the node registers itself with a throw-away key
    node_id: int | None = None  # known once its public key is registered

    @property
    def name(self) -> str:
        return node_name(self.partition_id)

    @property
    def node_config(self) -> dict[str, object]:
        return {
            "partition-id": self.partition_id,
            "num-partitions": self.num_partitions,
            "partition-file": str(self.partition_file),
        }


class LocalDeployment:
    """A SuperLink and one SuperNode per client on 127.0.0.1, as separate processes under ``workdir``.

    ``start`` makes the credentials (TLS certificates, one key pair per node, registered with the
    SuperLink), the partition files, and starts everything; ``submit`` starts ``flwr run``;
    ``kill_node`` / ``restart_node`` take one node down and bring it back with its key and data;
    ``stop`` (also on leaving a ``with`` block) ends every process started, however deep.
    """

    def __init__(self, workdir: Path, insecure: bool = False, keys_folder: Path | None = None) -> None:
        self.workdir = workdir
        self.insecure = insecure
        self.keys_folder = keys_folder or workdir / "keys"
        self.flwr_home = workdir / "flwr-home"
        for name in ("flwr-home", "logs", "superlink"):
            (workdir / name).mkdir(parents=True, exist_ok=True)
        environment = flower_environment(FLWR_HOME=str(self.flwr_home))
        environment.setdefault(SUPEREXEC_POLL_VARIABLE, SUPEREXEC_POLL_SECONDS)
        self.processes = Processes(environment, workdir / "logs")
        self.certificates: Certificates | None = None
        self.superlink_port = 0
        self.nodes: dict[int, DeployedNode] = {}

    def __enter__(self) -> LocalDeployment:
        self.processes.guard()  # a kill -9 of this command still stops the SuperLink and every node
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    # -- starting ----------------------------------------------------------------------------------------
    def start(self, config: RunConfig, nodes: int, start_nodes: bool = True) -> None:
        """Credentials, partition files, the SuperLink, key registrations, then ``nodes`` SuperNodes
        (unless ``start_nodes`` is False: a caller that starts them its own way)."""
        if not self.insecure:
            check_keys_folder(self.keys_folder, nodes)
        # N SuperNodes share this machine's cores; without this every ClientApp's torch takes them all.
        self.processes.environment["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nodes))
        if not self.insecure:
            self.certificates = generate_certificates(LOOPBACK, self.workdir / "certificates")
        keys: list[NodeKey | None] = (
            [None] * nodes
            if self.insecure
            else list(generate_node_keys(self.keys_folder, [node_name(i) for i in range(nodes)]))
        )
        # Each SuperNode gets only its own client's file, as a client machine would hold only its data.
        partition_files = export_partitions(config, self.workdir / "partitions")
        self.superlink_port, *node_ports = free_ports(nodes + 1)
        for partition_id, (port, partition_file, key) in enumerate(zip(node_ports, partition_files, keys, strict=True)):
            self.nodes[partition_id] = DeployedNode(partition_id, nodes, port, partition_file, key)
        superlink = self.processes.start(
            "superlink", superlink_command(self.superlink_port, self.certificates), self.workdir / "superlink"
        )
        wait_until_listening(self.superlink_port, superlink, self.processes.log_path("superlink"))
        (self.flwr_home / "config.toml").write_text(flwr_connection_toml(self.superlink_port, self.certificates))
        self.register_keys()
        for partition_id in self.nodes if start_nodes else ():
            self.start_node(partition_id)

    def register_keys(self) -> None:
        """Tell the SuperLink every node's public key (Control API, as its operator would): only these may join."""
        pending = {
            node.partition_id: self.flwr_process(["supernode", "register", str(node.key.public), CONNECTION])
            for node in self.nodes.values()
            if node.key is not None
        }
        for partition_id, process in pending.items():
            self.nodes[partition_id].node_id = int(self.flwr_answer(process, "register")["node-id"])

    def start_node(self, partition_id: int) -> subprocess.Popen[bytes]:
        node = self.nodes[partition_id]
        folder = self.workdir / node.name  # the node's working directory, where its ClientApps run
        folder.mkdir(exist_ok=True)
        private_key = None if node.key is None else node.key.private
        command = supernode_command(self.superlink_port, node.port, node.node_config, self.certificates, private_key)
        return self.processes.start(node.name, command, folder)

    # -- faults ------------------------------------------------------------------------------------------
    def kill_node(self, partition_id: int) -> None:
        """The node's machine loses power: its SuperNode and every ClientApp die at once, no goodbye."""
        self.processes.kill(self.nodes[partition_id].name)

    def restart_node(self, partition_id: int) -> subprocess.Popen[bytes]:
        """Start a killed node again with the same key, data and port, once the SuperLink lets its key in.

        Flower refuses to activate a key whose node it still believes online (until two heartbeats
        pass without one); in insecure mode the node simply registers itself anew.
        """
        node = self.nodes[partition_id]
        if node.node_id is not None:
            deadline = time.monotonic() + REJOIN_TIMEOUT
            while self.node_statuses().get(node.node_id) == "online":
                if time.monotonic() > deadline:
                    raise FedcondError(f"the SuperLink still lists {node.name} online {REJOIN_TIMEOUT:.0f} s on")
                time.sleep(3.0)
        return self.start_node(partition_id)

    def node_statuses(self) -> dict[int, str]:
        """The SuperLink's view of every registered node: node id to "registered", "online" or "offline"."""
        answer = self.flwr_answer(self.flwr_process(["supernode", "ls", CONNECTION]), "supernode ls")
        return {int(node["node-id"]): str(node["status"]) for node in answer["nodes"]}

    # -- runs --------------------------------------------------------------------------------------------
    def submit(self, app: Path, run_config: dict[str, object], log_as: str | None = None) -> subprocess.Popen[bytes]:
        """``flwr run APP --stream`` against this SuperLink; its output goes to ours, or to the log
        ``<log_as>.log`` when named."""
        # From the work folder, never the source tree (see README: the app is packed from it).
        command = [executable("flwr"), "run", str(app), CONNECTION, "--stream",
                   "--run-config", to_run_config_string(run_config)]  # fmt: skip
        return self.processes.start(log_as or "flwr-run", command, self.workdir, log=log_as is not None)

    def check_running(self, reported: set[str]) -> None:
        """Fail if the SuperLink stopped; say once of each SuperNode that stopped (the run goes on
        without it: the strategy decides whether the rounds still count)."""
        for name in self.processes.stopped():
            if name == "superlink":
                raise FedcondError(f"the SuperLink stopped during the run; see {self.processes.log_path(name)}")
            if name.startswith("supernode-") and name not in reported:
                reported.add(name)
                print(f"fedcond: {name} stopped; the run goes on without it (see {name}.log in the process logs)",
                      file=sys.stderr, flush=True)  # fmt: skip

    def stop(self) -> None:
        self.processes.stop_all()

    # -- the `flwr` CLI, against this deployment's SuperLink ----------------------------------------------------
    def flwr_process(self, arguments: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [executable("flwr"), *arguments, "--format", "json"], cwd=self.workdir, env=self.processes.environment,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def flwr_answer(self, process: subprocess.Popen[str], what: str) -> dict[str, object]:
        try:
            output, errors = process.communicate(timeout=FLWR_COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise FedcondError(f"flwr {what} took over {FLWR_COMMAND_TIMEOUT:.0f} s; see the SuperLink's log") from None
        try:
            answer = json.loads(output)
        except json.JSONDecodeError:
            answer = {}
        if process.returncode != 0 or not answer.get("success"):
            reason = (errors.strip() or output.strip() or "no output").splitlines()[-1]
            raise FedcondError(f"flwr {what} failed ({reason}); see the SuperLink's log")
        return answer


def deploy_local(
    assignments: Sequence[str],
    nodes: int | None = None,
    insecure: bool = False,
    override_file: str | None = None,
    keys: str | None = None,
    dry_run: bool = False,
) -> int:
    """Run one configuration on a real SuperLink and ``nodes`` SuperNodes on loopback; 0 if it finished."""
    config, overrides = (
        (settings_from(assignments, override_file), {}) if dry_run else prepare(assignments, override_file)
    )
    nodes = config.num_clients if nodes is None else nodes
    if nodes != config.num_clients:
        raise FedcondError(
            f"--nodes {nodes} but num-clusters x clients-per-cluster = {config.num_clients}; "
            f"pass --nodes {config.num_clients} or settings with {nodes} clients (e.g. num-clusters={nodes} "
            "clients-per-cluster=1)"
        )
    if keys is not None and insecure:
        raise FedcondError("--keys needs TLS: Flower authenticates SuperNodes over TLS only; drop --insecure")
    keys_folder = None if keys is None else Path(keys).expanduser().resolve()
    if keys_folder is not None:
        check_keys_folder(keys_folder, nodes)  # before anything starts
    if dry_run:
        app_directory()  # the Flower app the run is submitted from: a dry run refuses where the run would
        security = "plain HTTP" if insecure else "TLS, authenticated SuperNodes"
        print(
            f"fedcond: dry run: a SuperLink and {nodes} SuperNodes on 127.0.0.1 ({security}) would run "
            f"{config.method} for {config.num_server_rounds} rounds; every setting checked, nothing started"
        )
        return 0
    folder = run_folder(overrides)
    workdir = Path(tempfile.mkdtemp(prefix="fedcond-deploy-"))
    deployment = LocalDeployment(workdir, insecure, keys_folder)
    succeeded = False
    try:
        with sigterm_as_interrupt():
            succeeded = _deploy(deployment, config, overrides, nodes, folder)
    except KeyboardInterrupt:
        print("fedcond: interrupted; stopping every process deploy-local started", file=sys.stderr, flush=True)
        return 130
    finally:
        deployment.stop()
        _keep_logs(workdir, folder, succeeded)
    if not succeeded:
        reason = unfinished(folder, config.num_server_rounds)
        print(f"fedcond: error: the run did not finish (status: {reason}); see the process logs", file=sys.stderr)
        return 1
    print(f"fedcond: results in {folder} (history.csv, run.json; process logs in deploy-logs/)")
    if keys_folder is not None:
        print(f"fedcond: the SuperNodes' key pairs are kept in {keys_folder}")
    return 0


def _deploy(
    deployment: LocalDeployment, config: RunConfig, overrides: dict[str, object], nodes: int, folder: Path
) -> bool:
    security = (
        "insecure: plain HTTP, no node authentication" if deployment.insecure else "TLS, authenticated SuperNodes"
    )
    deployment.start(config, nodes)
    print(f"fedcond: SuperLink on {LOOPBACK}:{deployment.superlink_port} ({security}), {nodes} SuperNodes, "
          f"work folder {deployment.workdir}", flush=True)  # fmt: skip
    print(f"fedcond: results will be in {folder}", flush=True)
    submitter = deployment.submit(app_directory(), overrides)
    reported: set[str] = set()
    while submitter.poll() is None:
        deployment.check_running(reported)
        time.sleep(0.5)
    return unfinished(folder, config.num_server_rounds) is None


def _keep_logs(workdir: Path, folder: Path, succeeded: bool) -> None:
    """Copy the process logs next to the results; delete the work folder (certificates, keys, partitions)."""
    logs = workdir / "logs"
    if not folder.is_dir():  # the run never started: keep everything for a look
        print(f"fedcond: process logs in {logs}", file=sys.stderr)
        return
    shutil.copytree(logs, folder / "deploy-logs", dirs_exist_ok=True)
    shutil.rmtree(workdir, ignore_errors=True)
    if not succeeded:
        print(f"fedcond: process logs in {folder / 'deploy-logs'}", file=sys.stderr)

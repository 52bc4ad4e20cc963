"""Deployment: certificates, partition files, node config, clean-up, and a real 3-node TLS run."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
from flwr.common import Context, RecordDict
from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

from fedcond.config import RunConfig
from fedcond.data.client_data import export_partitions, load_client_data, load_partition_file
from fedcond.errors import FedcondError
from fedcond.federation.client_app import build_client, node_data
from fedcond.fingerprint.fingerprints import eigen_fingerprint
from fedcond.tools.certificates import CERTIFICATE_SCRIPT, generate_certificates, generate_node_keys
from fedcond.tools.cli import main
from fedcond.tools.deploy import (
    CONNECTION,
    LOOPBACK,
    RESERVED_PORTS,
    START_TIMEOUT,
    LocalDeployment,
    free_ports,
    superlink_command,
    supernode_command,
    wait_until_listening,
)
from fedcond.tools.flwr_commands import app_directory, executable, flower_environment, prepare, run_folder
from fedcond.tools.processes import Processes, alive, descendants

THREE_CLIENTS = RunConfig(num_clusters=3, clients_per_cluster=1)


def context(node_config: dict[str, object]) -> Context:
    return Context(run_id=0, node_id=0, node_config=node_config, state=RecordDict(), run_config={})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("host", "name"), [("127.0.0.1", "IP Address:127.0.0.1"), ("fl.example.org", "DNS:fl.example.org")]
)
def test_certificate_script_names_the_host_and_chains_to_its_ca(tmp_path, host, name):
    certificates = generate_certificates(host, tmp_path / "certs")
    text = subprocess.run(
        ["openssl", "x509", "-in", str(certificates.server_cert), "-noout", "-ext", "subjectAltName"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert name in text and "IP Address:127.0.0.1" in text
    verify = ["openssl", "verify", "-CAfile", str(certificates.ca), str(certificates.server_cert)]
    assert subprocess.run(verify, capture_output=True).returncode == 0
    assert certificates.server_key.stat().st_mode & 0o077 == 0  # the private key is its owner's alone


def test_the_certificate_script_never_replaces_a_ca_key(tmp_path):
    certificates = generate_certificates("127.0.0.1", tmp_path)
    key = (tmp_path / "ca.key").read_bytes()
    script = app_directory() / CERTIFICATE_SCRIPT
    result = subprocess.run(["bash", str(script), "127.0.0.1", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"fedcond: error: {tmp_path}/ca.key exists; keep it, or move")
    assert (tmp_path / "ca.key").read_bytes() == key and certificates.ca.is_file()


def test_commands_use_tls_node_authentication_and_loopback_only(tmp_path):
    certificates = generate_certificates("127.0.0.1", tmp_path)
    link = superlink_command(40001, certificates)
    assert "--insecure" not in link and link[link.index("--ssl-certfile") + 1] == str(certificates.server_cert)
    assert link[link.index("--host") + 1] == "127.0.0.1" and "--enable-supernode-auth" in link
    node_config = {"partition-id": 1, "partition-file": "/d/p 1.npz"}
    node = supernode_command(40001, 40002, node_config, certificates, tmp_path / "supernode-1")
    assert node[node.index("--root-certificates") + 1] == str(certificates.ca)
    assert node[node.index("--auth-supernode-private-key") + 1] == str(tmp_path / "supernode-1")
    assert node[node.index("--superlink") + 1] == "127.0.0.1:40001" and node[node.index("--host") + 1] == "127.0.0.1"
    assert node[node.index("--node-config") + 1] == 'partition-id=1 partition-file="/d/p 1.npz"'
    insecure_link, insecure_node = superlink_command(40001, None), supernode_command(1, 2, {}, None)
    assert "--insecure" in insecure_link and "--insecure" in insecure_node
    # Flower authenticates SuperNodes over TLS only (it refuses the flag with --insecure).
    assert "--enable-supernode-auth" not in insecure_link and "--auth-supernode-private-key" not in insecure_node


def test_node_keys_are_p384_openssh_pairs_and_never_replaced(tmp_path):
    keys = generate_node_keys(tmp_path / "keys", ["supernode-0", "supernode-1"])
    for key in keys:
        assert key.public.read_text().startswith("ecdsa-sha2-nistp384 ")  # what `flwr supernode register` takes
        assert key.private.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
        assert key.private.stat().st_mode & 0o077 == 0  # the private key is its owner's alone
    before = keys[1].private.read_bytes()
    with pytest.raises(FedcondError, match=r"supernode-1 exists; keep it \(its public key may be registered\)"):
        generate_node_keys(tmp_path / "keys", ["supernode-2", "supernode-1"])
    assert keys[1].private.read_bytes() == before and not (tmp_path / "keys" / "supernode-2").exists()
    with pytest.raises(FedcondError, match="may hold only letters"):
        generate_node_keys(tmp_path / "keys", ["../escape"])


def test_deploy_local_refuses_a_keys_folder_holding_keys_before_starting(tmp_path, capsys):
    generate_node_keys(tmp_path / "keys", ["supernode-1"])
    settings = ["--nodes", "3", "num-clusters=3", "clients-per-cluster=1", f"results-dir={tmp_path / 'r'}"]
    assert main(["deploy-local", "--keys", str(tmp_path / "keys"), *settings]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'keys' / 'supernode-1'} exists; deploy-local makes new keys" in err
    assert main(["deploy-local", "--insecure", "--keys", str(tmp_path / "other"), *settings]) == 2
    assert "Flower authenticates SuperNodes over TLS only" in capsys.readouterr().err
    assert not (tmp_path / "r").exists() and not (tmp_path / "other").exists()


def test_free_ports_are_distinct_and_never_flowers_defaults():
    ports = free_ports(30)
    assert len(set(ports)) == 30 and not set(ports) & RESERVED_PORTS


def test_a_partition_file_holds_exactly_the_computed_partition(tmp_path):
    paths = export_partitions(THREE_CLIENTS, tmp_path)
    assert [path.name for path in paths] == ["partition-0.npz", "partition-1.npz", "partition-2.npz"]
    stored, computed = load_partition_file(paths[2], THREE_CLIENTS, 2), load_client_data(THREE_CLIENTS, 2)
    for field in ("train_x", "train_y", "test_x", "test_y"):
        np.testing.assert_array_equal(getattr(stored, field), getattr(computed, field))
    assert (stored.cluster, stored.num_classes) == (computed.cluster, computed.num_classes)
    # So the fingerprint a client computes on its own machine is the simulation's, bit for bit.
    fingerprints = [eigen_fingerprint(d.train_x, d.train_y, d.num_classes, 32, 0) for d in (stored, computed)]
    np.testing.assert_array_equal(*fingerprints)


def test_a_partition_file_of_another_client_or_split_is_refused(tmp_path):
    path = export_partitions(THREE_CLIENTS, tmp_path)[0]
    with pytest.raises(FedcondError, match="holds partition 0 but this node has partition-id=1"):
        load_partition_file(path, THREE_CLIENTS, 1)
    with pytest.raises(FedcondError, match=r"exported for another split \(seed 0 vs 1\)"):
        load_partition_file(path, THREE_CLIENTS.replace(seed=1), 0)
    with pytest.raises(FedcondError, match="no partition file"):
        load_partition_file(tmp_path / "missing.npz", THREE_CLIENTS, 0)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(FedcondError, match="not a readable partition file"):
        load_partition_file(tmp_path / "junk.npz", THREE_CLIENTS, 0)


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("train_y", lambda y: y + 10, r"train labels run from \d+ to \d+, outside 0\.\.9"),
        ("test_y", lambda y: y - 20, "test labels run from -"),
        ("train_x", lambda x: np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x), "NaN or infinite pixels"),
        ("test_x", lambda x: np.full_like(x, np.inf), "NaN or infinite pixels"),
        ("train_x", lambda x: x * 255, r"train pixels run from 0 to 255, outside \[0, 1\]"),
        ("num_classes", lambda n: np.array(1000), "claims 1000 classes, digits has 10"),
        ("train_x", lambda x: x[:, :, :4], "train arrays have shapes"),
        ("train_y", lambda y: y.astype(np.float32), "labels must be integers"),
    ],
)
def test_a_forged_partition_file_is_refused_in_one_line(tmp_path, field, change, message):
    path = export_partitions(THREE_CLIENTS, tmp_path)[0]
    with np.load(path, allow_pickle=False) as stored:
        arrays = {key: stored[key] for key in stored.files}
    arrays[field] = change(arrays[field])
    with path.open("wb") as handle:
        np.savez_compressed(handle, **arrays)
    with pytest.raises(FedcondError, match=message) as error:
        load_partition_file(path, THREE_CLIENTS, 0)
    assert "\n" not in str(error.value) and str(error.value).endswith("(fedcond export-partitions)")


def test_the_client_app_loads_what_its_node_config_names(tmp_path):
    path = export_partitions(THREE_CLIENTS, tmp_path)[1]
    data = node_data(context({"partition-id": 1, "partition-file": str(path)}), THREE_CLIENTS, 1)
    np.testing.assert_array_equal(data.train_y, load_client_data(THREE_CLIENTS, 1).train_y)
    # A node's data-dir overrides the run's: this machine's folder is the one searched.
    mnist = THREE_CLIENTS.replace(dataset="mnist", data_dir="/the/server/folder")
    with pytest.raises(FedcondError, match="data-dir /nonexistent/client/folder does not exist"):
        build_client(context({"partition-id": 0, "num-partitions": 3, "data-dir": "/nonexistent/client/folder"}), mnist)


def test_export_partitions_command_and_bad_node_count(tmp_path, capsys):
    assert main(["export-partitions", "--out", str(tmp_path / "p"), "num-clusters=3", "clients-per-cluster=1"]) == 0
    assert sorted(path.name for path in (tmp_path / "p").iterdir()) == [f"partition-{i}.npz" for i in range(3)]
    assert main(["deploy-local", "--nodes", "4", "num-clusters=3", "clients-per-cluster=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedcond: error:") and "pass --nodes 3" in err


def test_stop_all_ends_children_that_left_the_process_group(tmp_path):
    """Flower starts SuperExec in a session of its own: killing the group alone would leave it."""
    processes = Processes(dict(os.environ), tmp_path)
    parent = processes.start("parent", ["bash", "-c", "setsid sleep 300 & exec sleep 300"], tmp_path)
    # Until the child has called setsid (a busy machine shows it first in the parent's group).
    deadline, escaped = time.monotonic() + 20, None
    while escaped is None and time.monotonic() < deadline:
        children = descendants({parent.pid})
        if len(children) == 1 and os.getpgid(next(iter(children))) != os.getpgid(parent.pid):
            (escaped,) = children
        time.sleep(0.1)
    assert escaped is not None, "the child never left the parent's process group"
    processes.stop_all()
    assert parent.poll() is not None and not alive(escaped)


def processes_under(folder: Path) -> list[int]:
    """Live processes whose command line or environment names ``folder`` (all deploy-local starts do)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            text = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if str(folder).encode() in text and int(proc.name) != os.getpid() and alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def deploy_local(tmp_path: Path, arguments: list[str], **popen: object) -> subprocess.Popen[str]:
    """``fedcond deploy-local`` as a user runs it, its work folder (hence FLWR_HOME) under ``tmp_path``."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    environment = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    command = [sys.executable, "-m", "fedcond.tools.cli", "deploy-local", *arguments]
    return subprocess.Popen(command, env=environment, text=True, **popen)  # type: ignore[call-overload]


def assert_nothing_left(folder: Path) -> None:
    left = processes_under(folder)
    for pid in left:  # never leave them to the next test, but still fail
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


def read_history(folder: Path) -> list[dict[str, str]]:
    (run,) = folder.iterdir()
    with (run / "history.csv").open() as handle:
        return list(csv.DictReader(handle))


# Digits, conditional, 3 clusters x 1 client: one SuperNode per client, 2 rounds.
SETTINGS = ["num-clusters=3", "clients-per-cluster=1", "num-server-rounds=2", "verbose=false"]
# Same data (the partition files are the simulation's partitions), seeds and initial model: measured
# here, deployment and simulation agreed to every digit (accuracy difference 0.0, loss within 1e-7).
# Float summation order and thread counts may still differ elsewhere: allow a prediction or two.
ACCURACY_TOLERANCE = 0.01


@pytest.mark.slow
def test_three_node_tls_deployment_matches_the_simulation(tmp_path):
    """Separate SuperLink and SuperNode processes on 127.0.0.1, TLS; then the same run simulated."""
    started = time.monotonic()
    deployment = deploy_local(tmp_path, ["--nodes", "3", *SETTINGS, f"results-dir={tmp_path / 'deployed'}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        output, _ = deployment.communicate(timeout=900)
    finally:
        deployment.kill()
        assert_nothing_left(tmp_path)
    deployed_seconds = time.monotonic() - started
    assert deployment.returncode == 0, output[-3000:]
    assert "(TLS, authenticated SuperNodes)" in output and "fedcond: results in" in output
    deployed = read_history(tmp_path / "deployed")
    (run,) = (tmp_path / "deployed").iterdir()
    assert (run / "deploy-logs" / "superlink.log").is_file() and (run / "deploy-logs" / "supernode-2.log").is_file()

    from fedcond.tools.simulation import simulate

    config = RunConfig.from_mapping(
        {"num-clusters": 3, "clients-per-cluster": 1, "num-server-rounds": 2, "verbose": False,
         "results-dir": str(tmp_path / "simulated")}
    )  # fmt: skip
    simulate(config)
    simulated = read_history(tmp_path / "simulated")
    assert [row["round"] for row in deployed] == [row["round"] for row in simulated] == ["1", "2"]
    assert list(deployed[0]) == list(simulated[0])
    for mine, theirs in zip(deployed, simulated, strict=True):
        assert abs(float(mine["accuracy"]) - float(theirs["accuracy"])) <= ACCURACY_TOLERANCE
        assert float(mine["loss"]) == pytest.approx(float(theirs["loss"]), rel=1e-3)
        assert mine["bytes_down"] == theirs["bytes_down"] and mine["bytes_up"] == theirs["bytes_up"]
    print(f"deployment {deployed_seconds:.0f} s; accuracy deployed {[r['accuracy'] for r in deployed]} "
          f"simulated {[r['accuracy'] for r in simulated]}")  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_stops_every_process_deploy_local_started(tmp_path):
    deployment = deploy_local(
        tmp_path, ["--nodes", "2", "--insecure", "num-clusters=2", "clients-per-cluster=1", "num-server-rounds=50"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert deployment.stdout is not None
        for line in deployment.stdout:  # wait until the SuperNodes exist: the launcher printed the results folder
            if line.startswith("fedcond: results will be in"):
                break
        deadline = time.monotonic() + START_TIMEOUT  # launcher, SuperLink, its SuperExec, SuperNodes
        while len(processes_under(tmp_path)) < 4:
            assert time.monotonic() < deadline, f"only {processes_under(tmp_path)} started"
            time.sleep(0.2)
        deployment.send_signal(signal.SIGINT)
        output, _ = deployment.communicate(timeout=60)
    finally:
        deployment.kill()
        assert_nothing_left(tmp_path)
    assert deployment.returncode == 130, output
    assert "interrupted; stopping every process" in output


@pytest.mark.slow
def test_only_supernodes_with_a_registered_key_join(tmp_path):
    """A SuperLink of deploy-local admits the node whose key it registered; one with another key, or
    with none, is refused at once and never gets work."""
    with LocalDeployment(tmp_path / "deployment") as deployment:
        deployment.start(RunConfig(num_clusters=1, clients_per_cluster=1), nodes=1)
        (registered,) = deployment.nodes.values()
        (stranger,) = generate_node_keys(tmp_path / "stranger", ["supernode-9"])
        ports = free_ports(2)
        # The operator's wrapper around flower-supernode (fedcond supernode) says what to fix.
        unregistered = supernode_command(deployment.superlink_port, ports[0], {"partition-id": 0, "num-partitions": 1},
                                         deployment.certificates, stranger.private)  # fmt: skip
        wrapped = [executable("fedcond"), "supernode", *unregistered[1:]]
        intruders = {
            "unregistered-key": deployment.processes.start("unregistered-key", wrapped, tmp_path),
            "no-key": deployment.processes.start(
                "no-key", supernode_command(deployment.superlink_port, ports[1], {}, deployment.certificates), tmp_path
            ),
        }
        for name, process in intruders.items():
            assert process.wait(timeout=180) != 0, name
            log = deployment.processes.log_path(name).read_text()
            assert "Failed to initialize the connection to the SuperLink" in log, log[-2000:]
            assert "SuperNode ID:" not in log  # it never became a node of this federation
        assert "fedcond: the SuperLink refused this node's key: it is not registered there" in (
            deployment.processes.log_path("unregistered-key").read_text()
        )
        deadline = time.monotonic() + 180
        while (statuses := deployment.node_statuses()) != {registered.node_id: "online"}:
            assert time.monotonic() < deadline, statuses  # only the registered node, and it is in
            time.sleep(2)
        assert deployment.processes.running(registered.name) is not None
    assert_nothing_left(tmp_path)


@pytest.mark.slow
def test_the_fab_holds_the_apps_code_and_every_module_they_import(tmp_path):
    """Flower ships the FAB to every node, and each deployed ClientApp process unpacks and checks it
    again: it holds the code alone (fab-include), but nothing the ServerApp or ClientApp imports may miss,
    every method's classes and every conditioning mechanism included (both are imported when asked for)."""
    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app_directory()))) as fab:
        shipped = {name for name in fab.namelist() if name.endswith(".py")}
    script = (
        "import sys, pathlib\n"
        "import fedcond.federation.client_app, fedcond.federation.server_app\n"
        "from fedcond.model.conditioning import MECHANISMS, mechanism\n"
        "from fedcond.federation.methods import registry\n"
        "classes = [(m.client, m.strategy) for m in registry().values()]  # imported when a run asks for them\n"
        "mechanisms = [mechanism(name) for name in MECHANISMS]\n"
        "root = pathlib.Path.cwd().resolve()\n"
        "for name, module in list(sys.modules.items()):\n"
        "    if name.split('.')[0] in ('fedcond', 'clients', 'strategies'):\n"
        "        print(pathlib.Path(module.__file__).resolve().relative_to(root).as_posix())\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=app_directory(),
                            env={**os.environ, "PYTHONPATH": str(app_directory())}, check=True)  # fmt: skip
    imported = set(result.stdout.split())
    assert {
        "fedcond/federation/client_app.py",
        "fedcond/federation/server_app.py",
        "fedcond/model/training.py",
    } <= imported
    assert imported <= shipped, sorted(imported - shipped)
    # No docs, results, tests, nor the checkout's record tooling (tools/).
    assert {name.split("/")[0] for name in shipped} == {"clients", "fedcond", "strategies"}


def history_rows(folder: Path) -> list[dict[str, str]]:
    path = folder / "history.csv"
    if not path.is_file():
        return []
    with path.open() as handle:
        return list(csv.DictReader(handle))


def wait_for(ready: Callable[[], bool], submitter: subprocess.Popen[bytes], timeout: float, late: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert submitter.poll() is None, "the run ended first"
        assert time.monotonic() < deadline, f"{late} within {timeout:.0f} s"
        time.sleep(1)


def wait_for_rounds(folder: Path, rounds: int, submitter: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(history_rows(folder)) < rounds:
        assert submitter.poll() is None, f"the run ended after {len(history_rows(folder))} rounds"
        assert time.monotonic() < deadline, f"round {rounds} did not end within {timeout:.0f} s"
        time.sleep(1)


# history.csv's accounting of each round (the failure policy, docs/deployment.md "Failures and time limits").
FAILURE_COLUMNS = ("clients_asked", "clients_answered", "clients_failed", "clients_timed_out")
#: The rejoin run's length: a ceiling only. The test stops the run once the restarted node has
#: answered a round, so how fast it rejoins decides when the test ends, never whether it passes.
REJOIN_CEILING_ROUNDS = 60
ROUND_WAIT = 1200.0  # seconds a deployed round may take here: the development machine is often very busy
# Flower 1.42 has no setting for a SuperNode's heartbeat (flwr.common.constant: every 30 s, and a node
# silent for two of them is offline): the waits below are that long, plus the time to start a node.
HEARTBEAT_SILENCE = HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL


# The node-killed deployment: NODES SuperNodes, the last one's machine dies in round 2.
NODES = 3
KILLED = NODES - 1


def rejoined_round(folder: Path) -> int | None:
    """The round in which the server took the killed node back (run.json's membership, written as it happens)."""
    try:
        events = json.loads((folder / "run.json").read_text())["membership"]
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or caught mid-write
    joined = [e["round"] for e in events if e["partition-id"] == KILLED and e["event"] == "joined" and e["round"] > 2]
    return joined[0] if joined else None


def stop_run(deployment: LocalDeployment) -> None:
    """``flwr stop`` of the deployment's one run, as an operator stops a run that needs no more rounds."""
    (run,) = deployment.flwr_answer(deployment.flwr_process(["list", CONNECTION]), "list")["runs"]
    deployment.flwr_answer(deployment.flwr_process(["stop", str(run["run-id"]), CONNECTION]), "stop")


@pytest.mark.slow
def test_a_node_killed_in_round_2_comes_back_under_its_partition_id(tmp_path):
    """3 SuperNodes: node 2's machine dies during round 2 (SIGKILL of its SuperNode and ClientApps: no
    goodbye) and is started again, with its key and data, once Flower has noticed it gone. The run goes
    on with 2 of 3 answers (min-answered-fraction=0.6); the history shows round 2's failure, round 1's
    evaluation that node 2's round-2 message was to bring (one message a round, the default) missing, not
    counted, and node 2 answering again under its partition id and node id. Each step waits for its
    event (round 1 saved, Flower noticing, the node online, a round counting it), and the run is then
    stopped: the test prints how long each step took (docs/deployment.md cites it)."""
    # The fingerprints' log normalisation needs no secure sum before round 1: federated
    # normalisation's SecAgg+ stages (a ClientApp process per node for each) cost this test a minute
    # and a half, and the TLS deployment above runs them.
    settings = [f"num-clusters={NODES}", "clients-per-cluster=1", f"num-server-rounds={REJOIN_CEILING_ROUNDS}",
                "local-epochs=1", "batch-size=32", "min-answered-fraction=0.6", "normalisation=log", "verbose=false",
                f"results-dir={tmp_path / 'results'}"]  # fmt: skip
    config, overrides = prepare(settings)
    folder = run_folder(overrides)
    step_wait = HEARTBEAT_SILENCE + ROUND_WAIT
    with LocalDeployment(tmp_path / "deployment") as deployment:
        deployment.start(config, nodes=NODES)
        node_id = deployment.nodes[KILLED].node_id
        submitter = deployment.submit(app_directory(), overrides, log_as="flwr-run")
        # Round 1's checkpoint is saved as it ends (its row waits for round 2's replies): round 2 is under way.
        wait_for(lambda: (folder / "checkpoint.pt").exists(), submitter, ROUND_WAIT, "round 1 did not end")
        killed = time.monotonic()
        deployment.kill_node(KILLED)
        # Round 2's training ends once Flower has noticed the node gone (two missed heartbeats); its
        # replies complete round 1's row.
        wait_for_rounds(folder, 1, submitter, step_wait)
        noticed = time.monotonic()
        deployment.restart_node(KILLED)  # once the SuperLink lists the node offline (it refuses its key till then)
        restarted = time.monotonic()
        wait_for(lambda: deployment.node_statuses().get(node_id) == "online", submitter, step_wait, "not online")
        online = time.monotonic()
        wait_for(lambda: rejoined_round(folder) is not None, submitter, step_wait, "the server never took it back")
        taken_back = time.monotonic()
        back = lambda: any(int(row["clients_answered"]) == NODES for row in history_rows(folder)[2:])  # noqa: E731
        wait_for(back, submitter, step_wait, "no round counted the restarted node")
        answered = time.monotonic()
        stop_run(deployment)
        submitter.wait(timeout=ROUND_WAIT)
        statuses = deployment.node_statuses()
        run_log = deployment.processes.log_path("flwr-run").read_text()
    assert_nothing_left(tmp_path)
    # Said as the SuperLink gave up on it (verbose=false: the round's counts are printed nowhere).
    silent = f"fedcond: round 2: partition {KILLED} (node {node_id}) stopped sending heartbeats: the SuperLink gave up"
    assert silent in run_log, run_log[-3000:]
    rows = history_rows(folder)
    assert 3 <= len(rows) < REJOIN_CEILING_ROUNDS, run_log[-3000:]
    assert [row["round"] for row in rows] == [str(r) for r in range(1, len(rows) + 1)]
    count = [{column: int(row[column]) for column in FAILURE_COLUMNS} for row in rows]
    everyone = {"clients_asked": NODES, "clients_answered": NODES, "clients_failed": 0, "clients_timed_out": 0}
    one_lost = {"clients_asked": NODES, "clients_answered": NODES - 1, "clients_failed": 1, "clients_timed_out": 0}
    # Round 1: every node trained, but the killed one never sent its evaluation (due with round 2's
    # fit); round 2: it never answered (an error reply once the SuperLink saw it gone); rounds after
    # it lose it until it is back, then count it again.
    assert count[:2] == [one_lost, one_lost], count
    returned = next(index for index, row in enumerate(count) if index >= 2 and row == everyone)
    assert count[2:returned] == [one_lost] * (returned - 2) and count[returned] == everyone, count
    events = json.loads((folder / "run.json").read_text())
    assert events["status"] == "stopped" and "stopped before it finished" in events["error"], events["error"]
    assert {(f["round"], f["stage"], f["partition-id"]) for f in events["failures"]} >= {
        (1, "evaluate", KILLED), (2, "fit", KILLED),
    }  # fmt: skip
    assert [e["event"] for e in events["membership"] if e["partition-id"] == KILLED][-1] == "joined"
    assert statuses[node_id] == "online"  # the same node id: it belongs to the registered key
    print(f"rejoin: Flower noticed the killed node after {noticed - killed:.0f} s; it was let in again "
          f"{restarted - noticed:.0f} s later; online {online - restarted:.0f} s after its start; taken back "
          f"in round {rejoined_round(folder)} {taken_back - online:.0f} s after that; its answers complete round "
          f"{returned + 1}'s row {answered - taken_back:.0f} s later")  # fmt: skip


@pytest.mark.slow
def test_a_run_the_server_stops_says_why_in_the_submitting_terminal_at_once(tmp_path):
    """The manual path (flower-superlink, flower-supernode, flwr run --stream, as an operator types
    them) with a copy-paste slip: two SuperNodes given partition-id 0. The ServerApp's one line
    reaches the terminal that submitted the run, `flwr run` returns right after it (not after the
    SuperLink's minute-long wait for a heartbeat), and Flower records the run failed with that reason."""
    config = RunConfig(num_clusters=2, clients_per_cluster=1, num_server_rounds=2)
    reason = "partition-id 0 is claimed by 2 nodes and 1 partition(s) by none"
    with LocalDeployment(tmp_path / "deployment", insecure=True) as deployment:
        deployment.start(config, nodes=2)
        deployment.processes.kill(deployment.nodes[1].name)  # its machine runs partition 0's config instead:
        twin = supernode_command(deployment.superlink_port, free_ports(1)[0], deployment.nodes[0].node_config, None)
        deployment.processes.start("twin", twin, tmp_path)
        # The twin is submitted before it has connected: on a loaded machine (CI, pytest -n) it took
        # over node-timeout's default 60 s, and the run stopped on "the federation has 1 nodes".
        results = {"num-clusters": 2, "clients-per-cluster": 1, "num-server-rounds": 2, "results-dir": str(tmp_path),
                   "node-timeout": 240}  # fmt: skip
        submitter = deployment.submit(app_directory(), results, log_as="flwr-run")
        log = deployment.processes.log_path("flwr-run")
        deadline = time.monotonic() + 300
        while reason not in log.read_text() and submitter.poll() is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        said = time.monotonic()
        assert f"fedcond: error: {reason}" in log.read_text(), log.read_text()[-3000:]
        submitter.wait(timeout=30)
        assert time.monotonic() - said < 15  # Flower's heartbeat wait would be a minute
        assert "Traceback" not in log.read_text()
        (run,) = deployment.flwr_answer(deployment.flwr_process(["list", CONNECTION]), "list")["runs"]
        assert run["status"] == "finished:failed" and reason in run["status-details"]
        # The same submission through `fedcond submit`: its exit status says the run failed, and why.
        settings = [f"{key}={value}" for key, value in results.items()]
        submitted = subprocess.run(
            [sys.executable, "-m", "fedcond.tools.cli", "submit", CONNECTION, *settings],
            cwd=deployment.workdir, env=deployment.processes.environment, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert submitted.returncode == 1, submitted.stdout[-2000:] + submitted.stderr[-2000:]
        assert f"fedcond: error: {reason}" in submitted.stdout  # the ServerApp's line, streamed
        last = submitted.stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"fedcond: error: run \d+ finished:failed: .*", last) and reason in last, last
    assert_nothing_left(tmp_path)


def test_submit_says_in_one_line_why_flwr_list_could_not_tell_how_a_run_ended(tmp_path):
    """``flwr list --format json`` answers a failure with a JSON object of its own (and exit status 0):
    fedcond submit's last line is its message, never the JSON blob."""
    from fedcond.tools.submit import run_status

    environment = flower_environment(FLWR_HOME=str(tmp_path / "flwr-home"))  # a home with no such connection
    with pytest.raises(FedcondError) as error:
        run_status("no-such-connection", "42", environment)
    assert str(error.value) == (
        "flwr list could not say how run 42 ended (An unexpected error occurred while reading the Flower "
        f"configuration file ({tmp_path / 'flwr-home' / 'config.toml'}). SuperLink connection 'no-such-connection' "
        "not found in the Flower configuration file "
        f"({tmp_path / 'flwr-home' / 'config.toml'}).); flwr list no-such-connection --run-id 42 shows it once "
        "that is fixed"
    )


@pytest.mark.parametrize(
    ("node_config", "message"),
    [
        (None, "no --node-config; give this node its client"),
        ("num-partitions=3", "--node-config needs an integer partition-id=... (got None)"),
        ("partition-id=3 num-partitions=3", "partition-id 3 is outside 0..2; fix --node-config"),
        ("partition-id=0 num-partitions=3 partition-file='/nowhere/partition-0.npz'", "no partition file /nowhere"),
        ("partition-id=1 num-partitions=3 partition-file='PARTITION'", "holds partition 0 but --node-config says"),
    ],
)
def test_fedcond_supernode_checks_the_node_before_flower_starts(tmp_path, capsys, node_config, message):
    (partition, *_) = export_partitions(RunConfig(num_clusters=3, clients_per_cluster=1), tmp_path / "partitions")
    arguments = ["--insecure", "--superlink", "127.0.0.1:1"]
    if node_config is not None:
        arguments += ["--node-config", node_config.replace("PARTITION", str(partition))]
    assert main(["supernode", *arguments]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fedcond: error: ") and message in line
    assert not processes_under(tmp_path)  # nothing started


@pytest.mark.slow
def test_fedcond_supernode_says_it_cannot_reach_the_superlink_and_its_pid_stops_all_it_started(tmp_path):
    """flower-supernode retries a SuperLink it cannot reach forever; the wrapper says what to check. A
    SIGTERM to the wrapper's PID alone (a service manager's stop) ends the SuperNode and its SuperExec."""
    (port,) = free_ports(1)
    command = [executable("fedcond"), "supernode", "--insecure", "--superlink", "127.0.0.1:1", "--port", str(port),
               "--node-config", "partition-id=0 num-partitions=1"]  # fmt: skip
    log = (tmp_path / "supernode.log").open("w")
    wrapper = subprocess.Popen(command, cwd=tmp_path, env=flower_environment(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "fedcond: cannot reach the SuperLink at 127.0.0.1:1" not in (tmp_path / "supernode.log").read_text():
            assert time.monotonic() < deadline and wrapper.poll() is None, (tmp_path / "supernode.log").read_text()
            time.sleep(0.5)
        started = descendants([wrapper.pid])
        assert any("superexec" in " ".join(psutil.Process(pid).cmdline()) for pid in started if alive(pid))
        os.kill(wrapper.pid, signal.SIGTERM)  # its PID only, not its group
        assert wrapper.wait(timeout=60) == 130
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in started):
            assert time.monotonic() < deadline, [pid for pid in started if alive(pid)]
            time.sleep(0.5)
    finally:
        log.close()
        if wrapper.poll() is None:
            os.killpg(wrapper.pid, signal.SIGKILL)


@pytest.mark.slow
def test_fedcond_supernode_names_the_ca_file_that_did_not_sign_the_superlinks_certificate(tmp_path):
    """A node given the ca.crt of another CA (another run of the certificate script: the same name,
    CN=fedcond-ca, another key) against a real TLS SuperLink: Flower says a TLS handshake failed and
    exits; fedcond dials the SuperLink itself and names that file and the certificate presented."""
    certificates = generate_certificates(LOOPBACK, tmp_path / "certificates")
    stranger = generate_certificates(LOOPBACK, tmp_path / "another-ca")
    superlink_port, node_port = free_ports(2)
    (tmp_path / "logs").mkdir()
    processes = Processes(flower_environment(FLWR_HOME=str(tmp_path / "flwr-home")), tmp_path / "logs")
    try:
        superlink = processes.start("superlink", superlink_command(superlink_port, certificates), tmp_path)
        wait_until_listening(superlink_port, superlink, processes.log_path("superlink"))
        node = supernode_command(superlink_port, node_port, {"partition-id": 0, "num-partitions": 1}, stranger)
        wrapper = processes.start("supernode", [executable("fedcond"), "supernode", *node[1:]], tmp_path)
        assert wrapper.wait(timeout=180) != 0  # Flower gives up at once on a failed TLS handshake
        log = processes.log_path("supernode").read_text()
    finally:
        processes.stop_all()  # by PID: the SuperLink, the wrapper and whatever they started
    assert_nothing_left(tmp_path)
    (line,) = [line for line in log.splitlines() if line.startswith("fedcond: ")]  # one line, and no other hint
    assert line.startswith(
        f"fedcond: the SuperLink at {LOOPBACK}:{superlink_port} answers, but its certificate (issued by CN=fedcond-ca, "
        f"naming IP:127.0.0.1, DNS:localhost) is not signed by --root-certificates {stranger.ca}, which holds another "
        "CA of that name (another key: made by another run of the script) ("
    ), log[-3000:]
    assert line.endswith("give this node the ca.crt that signed the SuperLink's (or its proxy's) server.pem")


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").is_file() else None)


@pytest.mark.slow
@pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx-light)")
def test_the_fleet_only_proxy_of_the_docs_carries_a_whole_run_and_nothing_else(tmp_path):
    """docs/deployment.md's nginx block, on loopback: the SuperLink listens on its own port, registered
    SuperNodes dial the proxy's port alone, a run finishes through it with every one of the nodes'
    calls under /v1/fleet/, and the Control API answers 404 there."""
    import httpx

    from fedcond.tools.deploy import fleet_proxy_server

    # Log normalisation: the fingerprints' secure sum (a ClientApp process per node for each SecAgg+
    # stage) is the TLS deployment's to test; this one tests the path the proxy gives the nodes.
    config = RunConfig(num_clusters=1, clients_per_cluster=2, num_server_rounds=1, normalisation="log")
    with LocalDeployment(tmp_path / "deployment", keys_folder=tmp_path / "keys") as deployment:
        deployment.start(config, nodes=2, start_nodes=False)
        (proxy_port,) = free_ports(1)
        nginx_folder = tmp_path / "nginx"
        nginx_folder.mkdir()
        temporary = " ".join(f"{kind}_temp_path {nginx_folder / kind};" for kind in ("client_body", "proxy"))
        server = fleet_proxy_server(f"127.0.0.1:{proxy_port}", deployment.superlink_port,
                                    deployment.workdir / "certificates")  # fmt: skip
        (nginx_folder / "nginx.conf").write_text(
            f"daemon off; pid {nginx_folder / 'nginx.pid'}; error_log {nginx_folder / 'error.log'};\n"
            f"events {{}}\nhttp {{\n{temporary}\naccess_log {nginx_folder / 'access.log'};\n{server}}}\n"
        )
        deployment.processes.start("nginx", [NGINX, "-c", str(nginx_folder / "nginx.conf")], nginx_folder)
        deadline = time.monotonic() + 30
        while "ssl" not in " ".join(str(c.laddr) for c in psutil.net_connections("tcp") if c.laddr.port == proxy_port):
            assert time.monotonic() < deadline, (nginx_folder / "error.log").read_text()
            if any(
                c.laddr.port == proxy_port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")
            ):
                break
            time.sleep(0.2)
        for node in deployment.nodes.values():  # they know the proxy's address alone
            command = supernode_command(proxy_port, node.port, node.node_config, deployment.certificates,
                                        node.key.private)  # fmt: skip
            deployment.processes.start(node.name, command, deployment.workdir)
        results = {"num-clusters": 1, "clients-per-cluster": 2, "num-server-rounds": 1, "normalisation": "log",
                   "results-dir": str(tmp_path)}  # fmt: skip
        assert deployment.submit(app_directory(), results, log_as="flwr-run").wait(timeout=300) == 0
        (run,) = (tmp_path).glob("conditional-*")
        assert json.loads((run / "run.json").read_text())["status"] == "finished"
        paths = [line.split('"')[1].split()[1] for line in (nginx_folder / "access.log").read_text().splitlines()]
        assert paths and all(path.startswith("/v1/fleet/") for path in paths), sorted(set(paths))
        with httpx.Client(verify=str(deployment.certificates.ca)) as client:
            for path in ("/v1/control/list-runs", "/v1/control/register-node"):
                assert client.post(f"https://127.0.0.1:{proxy_port}{path}", content=b"").status_code == 404
    assert_nothing_left(tmp_path)


def test_the_docs_nginx_block_is_the_one_the_proxy_test_runs():
    """docs/deployment.md shows fleet_proxy_server's block for its example addresses, word for word."""
    from fedcond.tools.deploy import fleet_proxy_server

    docs = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    shown = docs.split("```nginx\n", 1)[1].split("```", 1)[0].split("\n", 1)[1]
    assert shown == fleet_proxy_server("0.0.0.0:39202", 39201, Path("/home/you/fl/certificates"))


def test_a_launcher_killed_outright_leaves_nothing_it_started_running(tmp_path):
    """kill -9 of `fedcond supernode` (or deploy-local) runs no clean-up in it: its guard stops the
    SuperNode and what the SuperNode started in sessions of their own (here: sleeps standing in)."""
    script = (
        "import os, sys, time; from pathlib import Path; from fedcond.tools.processes import Processes\n"
        "processes = Processes(dict(os.environ), Path(sys.argv[1])); processes.guard()\n"
        "processes.start('node', ['bash', '-c', 'setsid sleep 300 & exec sleep 300'], Path(sys.argv[1]))\n"
        "print('started', flush=True); time.sleep(300)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None and launcher.stdout.readline() == "started\n"
    deadline = time.monotonic() + 20
    while len(sleeping := [p for p in descendants({launcher.pid}) if psutil.Process(p).name() == "sleep"]) < 2:
        assert time.monotonic() < deadline, "the launcher's processes did not start"
        time.sleep(0.1)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in sleeping) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in sleeping if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the launcher's processes outlived it"


def test_a_traceback_of_a_refusal_fedcond_explains_is_shown_as_its_exception_line_alone(capsys):
    """The SuperLink restarted without its database: Flower's heartbeat gets a 401 and the SuperNode
    ends in a traceback; the operator sees its last exception line and fedcond's one-line reason.
    A traceback fedcond cannot explain is shown whole."""
    from fedcond.tools.supernode import _show

    unauthenticated = (
        "INFO :      Starting Flower SuperNode\n"
        "Traceback (most recent call last):\n"
        '  File "/venv/flwr/supernode/start.py", line 10, in run\n'
        "    heartbeat()\n"
        "grpc._channel._InactiveRpcError: <_InactiveRpcError of RPC that terminated with:\n"
        "\tstatus = StatusCode.UNAUTHENTICATED\n"
        '\tdetails = "Node not found"\n'
        ">\n"
        "INFO :      SuperNode stopped\n"
    )
    other = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: something else\n'
    for text in (unauthenticated, other):
        node = subprocess.Popen(["printf", "%s", text], stdout=subprocess.PIPE)
        _show(node, ["--superlink", "127.0.0.1:1"])
        node.wait()
    shown = capsys.readouterr()
    assert shown.out == (
        "INFO :      Starting Flower SuperNode\n"
        "grpc._channel._InactiveRpcError: <_InactiveRpcError of RPC that terminated with:\n"
        ">\n"  # the repr's closing bracket, unindented: the block ended before it
        "INFO :      SuperNode stopped\n"
        f"{other}"
    )
    (line,) = shown.err.splitlines()
    assert "restarted without --database" in line


@pytest.mark.parametrize(
    ("flower_says", "fedcond_says"),
    [
        ("grpc._channel._InactiveRpcError: status = StatusCode.UNAUTHENTICATED", "restarted without --database"),
        ("ssl_transport_security.cc:1659] Handshake failed ... CERTIFICATE_VERIFY_FAILED", "must be the ca.crt"),
        ("[code: 2004] Failed to activate SuperNode", "not registered there"),
    ],
)
def test_fedcond_supernode_says_what_a_flower_refusal_means_once(capsys, flower_says, fedcond_says):
    from fedcond.tools.supernode import _show

    node = subprocess.Popen(["printf", f"{flower_says}\\n{flower_says}\\n"], stdout=subprocess.PIPE)
    _show(node, ["--superlink", "127.0.0.1:1"])
    node.wait()
    printed = capsys.readouterr()
    assert printed.out.count(flower_says) == 2  # Flower's own lines, as they were
    (line,) = printed.err.splitlines()  # and fedcond's, once
    assert line.startswith("fedcond: ") and fedcond_says in line


def test_each_flower_home_has_local_superlink_ports_of_its_own_and_keeps_them(tmp_path):
    """Flower's local SuperLink listens on 39091/39093 whatever its home: a run of one home would
    attach to another's. fedcond run gives each home its own pair, the same every time."""
    from fedcond.tools.local_superlink import PORT_VARIABLES, ports_of

    first, again, other = ports_of(tmp_path / "a", {}), ports_of(tmp_path / "a", {}), ports_of(tmp_path / "b", {})
    assert first == again and set(first.values()).isdisjoint(other.values())
    assert not {"39091", "39093", "9091", "9093"} & {*first.values(), *other.values()}
    chosen = dict.fromkeys(PORT_VARIABLES, "45678")  # what the user set stays
    assert ports_of(tmp_path / "a", chosen) == chosen

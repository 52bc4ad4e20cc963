"""Deployment: certificates, partition files, node config, clean-up, and a real 3-node TLS run."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Context, RecordDict

from clients.app import build_client, node_data
from fedcond.client_data import export_partitions, load_client_data, load_partition_file
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint import eigen_fingerprint
from fedcond.tools.certificates import CERTIFICATE_SCRIPT, generate_certificates
from fedcond.tools.cli import main
from fedcond.tools.deploy import RESERVED_PORTS, free_ports, superlink_command, supernode_command
from fedcond.tools.flwr_commands import app_directory
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


def test_commands_use_tls_and_loopback_only(tmp_path):
    certificates = generate_certificates("127.0.0.1", tmp_path)
    link = superlink_command(40001, certificates)
    assert "--insecure" not in link and link[link.index("--ssl-certfile") + 1] == str(certificates.server_cert)
    assert link[link.index("--host") + 1] == "127.0.0.1"
    node = supernode_command(40001, 40002, {"partition-id": 1, "partition-file": "/d/p 1.npz"}, certificates)
    assert node[node.index("--root-certificates") + 1] == str(certificates.ca)
    assert node[node.index("--superlink") + 1] == "127.0.0.1:40001" and node[node.index("--host") + 1] == "127.0.0.1"
    assert node[node.index("--node-config") + 1] == 'partition-id=1 partition-file="/d/p 1.npz"'
    assert "--insecure" in superlink_command(40001, None) and "--insecure" in supernode_command(1, 2, {}, None)


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
    deadline = time.monotonic() + 20
    while not descendants({parent.pid}) and time.monotonic() < deadline:
        time.sleep(0.1)
    (escaped,) = descendants({parent.pid})
    assert os.getpgid(escaped) != os.getpgid(parent.pid)
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
    assert "(TLS)" in output and "fedcond: results in" in output
    deployed = read_history(tmp_path / "deployed")
    (run,) = (tmp_path / "deployed").iterdir()
    assert (run / "deploy-logs" / "superlink.log").is_file() and (run / "deploy-logs" / "supernode-2.log").is_file()

    from strategies.simulation import simulate

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
        time.sleep(2)
        assert len(processes_under(tmp_path)) >= 4  # launcher, SuperLink, its SuperExec, SuperNodes
        deployment.send_signal(signal.SIGINT)
        output, _ = deployment.communicate(timeout=60)
    finally:
        deployment.kill()
        assert_nothing_left(tmp_path)
    assert deployment.returncode == 130, output
    assert "interrupted; stopping every process" in output

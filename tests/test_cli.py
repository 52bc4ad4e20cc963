"""The `fedcond` command: bad input stops with one line before Flower starts; a real `flwr run`."""

import csv
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fedcond.tools.cli import main
from tests.test_datasets import write_fake_mnist


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["method=fedprox"], "unknown method 'fedprox'"),
        (["dataset=cifar7"], "unknown dataset 'cifar7'"),
        (["scenario=drift"], "unknown scenario 'drift'"),
        (["num-clusters=11"], "lower num-clusters"),
        (["num-clustres=2"], "unknown run-config key"),
        (["dataset=mnist", "data-dir=/nonexistent/folder"], "does not exist"),
        (["clients-per-cluster=500"], "lower clients-per-cluster"),
        (["method=local", "held-out-clients=1"], "held-out-clients has no meaning for local"),
        (["fingerprint=class-mean", "normalisation=log"], "use normalisation=federated or none"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(capsys, settings, message):
    assert main(["run", *settings]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedcond: error:") and message in err


def test_missing_and_corrupt_data_files_are_reported_before_training(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["run", "dataset=mnist", f"data-dir={tmp_path / 'empty'}"]) == 2
    assert "no mnist idx files" in capsys.readouterr().err
    write_fake_mnist(tmp_path / "mnist")
    labels = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:-9])
    assert main(["run", "dataset=mnist", f"data-dir={tmp_path}"]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def superlink_port_free() -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", 39091)) != 0


@pytest.mark.skipif(not superlink_port_free(), reason="another Flower SuperLink already listens on 127.0.0.1:39091")
def test_fedcond_run_goes_through_flwr_run(tmp_path):
    """The README's main command, shortened: flwr's local SuperLink, Ray virtual clients, results."""
    flwr_home = tmp_path / "flwr-home"
    environment = {**os.environ, "FLWR_HOME": str(flwr_home)}
    command = [sys.executable, "-m", "fedcond.tools.cli", "run", "num-clusters=2", "clients-per-cluster=2",
               "num-server-rounds=2", "local-epochs=1", "results-dir=out"]  # fmt: skip
    try:
        finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    finally:
        # flwr leaves its local SuperLink running; it is ours because it logs under our FLWR_HOME.
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "flower-superlink" in args and str(flwr_home) in args:
                os.kill(int(cmdline.parent.name), signal.SIGTERM)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    assert "round   2/2  accuracy" in finished.stdout
    (folder,) = (tmp_path / "out").iterdir()
    with (folder / "history.csv").open() as handle:
        assert [row["round"] for row in csv.DictReader(handle)] == ["1", "2"]
    assert Path(folder, "run.json").is_file()


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].joinpath("experiments").glob("*.toml")))
def test_every_experiment_file_is_a_valid_configuration(path):
    from fedcond.tools.cli import default_config, read_override_file
    from fedcond.config import RunConfig

    overrides = read_override_file(str(path))
    assert overrides, f"{path.name} sets nothing"
    RunConfig.from_mapping({**default_config(), **overrides})


def test_missing_experiment_file_is_reported(capsys):
    assert main(["run", "--config", "experiments/nope.toml"]) == 2
    assert "no experiment file" in capsys.readouterr().err

"""Checkpoint and resume: a run killed after round 2 and resumed computes what an uninterrupted run
does; bad resumes are refused in one line before anything starts; compare/sweep resume what stopped."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.methods import run_config
from fedcond.federation.participation import EVALUATE, FIT
from fedcond.pooled import run_pooled
from fedcond.records import locks
from fedcond.records.checkpoint import (
    RESUME,
    Checkpoint,
    check_resume,
    checkpoint_due,
    load_checkpoint,
    save_checkpoint,
)
from fedcond.records.history import RUN_LOCK, RoundRecord, RunRecorder, reopen_run, run_status
from fedcond.tools.cli import default_config, main
from fedcond.tools.experiment import Experiment, run_experiment
from fedcond.tools.flwr_commands import prepare
from fedcond.tools.processes import alive
from fedcond.tools.simulation import simulate

ROOT = Path(__file__).resolve().parents[1]
# Columns that must agree between a resumed and an uninterrupted run: everything but wall time.
TIMES = ("seconds", "elapsed_seconds")


def small(tmp_path: Path, method: str, name: str, **settings: object) -> RunConfig:
    values = {
        "method": method, "num-clusters": 2, "clients-per-cluster": 1, "num-server-rounds": 4, "local-epochs": 1,
        "data-fraction": 0.5, "results-dir": str(tmp_path / "results"), "run-name": name, "verbose": False,
        **settings,
    }  # fmt: skip
    return run_config(values)


def history(folder: Path) -> list[dict[str, str]]:
    with (folder / "history.csv").open() as handle:
        return [{key: value for key, value in row.items() if key not in TIMES} for row in csv.DictReader(handle)]


def assert_same_models(first: Checkpoint, second: Checkpoint) -> None:
    assert sorted(first.models) == sorted(second.models)
    for name, model in first.models.items():
        assert len(model) == len(second.models[name])
        assert all(np.array_equal(a, b) for a, b in zip(model, second.models[name], strict=True)), name


def kill_after_round(
    config: RunConfig, folder: Path, round_number: int, tmp_path: Path, history_rows: int = 0
) -> Checkpoint:
    """Run ``config`` in a process of its own and SIGKILL it (and every process it started) as soon
    as the checkpoint of ``round_number`` exists and ``history.csv`` has ``history_rows`` rounds."""
    script = (
        "import json, sys\nfrom fedcond.federation.methods import run_config\n"
        "from fedcond.tools.simulation import simulate\n"
        # Its ClientApps in it, with this process's torch threads: the same numbers as this test's runs.
        "from tests.thread_backend import install\ninstall()\nimport torch\ntorch.set_num_threads(int(sys.argv[2]))\n"
        "simulate(run_config(json.loads(sys.argv[1])))\n"
    )
    log = (tmp_path / "killed.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(config.to_mapping()), str(torch.get_num_threads())],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: Ray's processes go with it
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            checkpoint = load_checkpoint(folder) if folder.is_dir() else None
            if checkpoint is not None and checkpoint.round >= round_number and len(history(folder)) >= history_rows:
                break
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()
    checkpoint = load_checkpoint(folder)
    assert checkpoint is not None, (tmp_path / "killed.log").read_text()[-2000:]
    return checkpoint


RESUMED_METHODS = {
    # The global model and the secure sum's published fingerprint statistics.
    "conditional": {},
    # FedAvgM's velocity: without it the resumed run's step would start from zero.
    "fedavg-server-momentum": {"method": "fedavg", "server-momentum": 0.9},
    # A model per client held on the server, saved by partition id and handed back to the resumed
    # run's new node ids: three clients, each averaging with one peer, so that every model differs.
    "dac": {"num-clusters": 3, "dac-neighbours": 1},
    # The same with every client's model spilled to the run folder: the checkpoint names their files.
    "dac-spilled": {"method": "dac", "num-clusters": 3, "dac-neighbours": 1, "client-models-memory-mb": 0},
    # Saved after rounds 2 and 4 only, killed once round 3 is in the history: the resumed run does
    # round 3 again from round 2's checkpoint, whose spilled files round 3 must not have removed.
    "dac-spilled-checkpoint-every-2": {
        "method": "dac",
        "num-clusters": 3,
        "dac-neighbours": 1,
        "client-models-memory-mb": 0,
        "checkpoint-every": 2,
    },
}
#: Rounds the history must hold before the kill (default: the checkpointed round's).
KILLED_AFTER_HISTORY_ROWS = {"dac-spilled-checkpoint-every-2": 3}


def spilled_models(folder: Path) -> dict[str, list[np.ndarray]]:
    """The client models a checkpoint names by file (fedcond.model.store.SpillingModels)."""
    from fedcond.model.store import SPILL_FOLDER, SPILLED_VALUE

    named = load_checkpoint(folder).values.get(SPILLED_VALUE, {})
    loaded = {}
    for pid, server_round in named.items():
        with np.load(folder / SPILL_FOLDER / f"client-{pid}-round-{server_round}.npz") as stored:
            loaded[pid] = [stored[name] for name in sorted(stored.files, key=lambda name: int(name[4:]))]
    return loaded


@pytest.mark.slow
@pytest.mark.parametrize("label", list(RESUMED_METHODS))
def test_a_run_killed_after_round_2_and_resumed_equals_the_uninterrupted_run(tmp_path, label):
    settings = dict(RESUMED_METHODS[label])
    method = str(settings.pop("method", label))
    simulate(small(tmp_path, method, "straight", **settings))
    folder = tmp_path / "results" / "killed"
    rows = KILLED_AFTER_HISTORY_ROWS.get(label, 0)
    stopped = kill_after_round(small(tmp_path, method, "killed", **settings), folder, 2, tmp_path, rows)
    # Killed for real: no round 4, and run.json was left saying "running", as a killed process leaves it.
    assert 2 <= stopped.round < 4 and run_status(folder) == "running"
    if rows:  # the history went past the last checkpoint: the rounds since are done again
        assert stopped.round == 2 and len(history(folder)) >= rows
    assert locks.holder_of(folder / RUN_LOCK) is None  # the kernel let go of a dead process's lock

    simulate(RESUME.set(small(tmp_path, method, "killed", **settings), str(folder)))

    assert history(folder) == history(tmp_path / "results" / "straight")  # accuracies, losses, bytes
    assert_same_models(load_checkpoint(folder), load_checkpoint(tmp_path / "results" / "straight"))
    spilled, straight = spilled_models(folder), spilled_models(tmp_path / "results" / "straight")
    assert sorted(spilled) == sorted(straight) == (["0", "1", "2"] if "client-models-memory-mb" in settings else [])
    assert all(np.array_equal(a, b) for pid in spilled for a, b in zip(spilled[pid], straight[pid], strict=True))
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "finished" and info["rounds_completed"] == 4
    (resumed,) = info["resumed"]
    assert resumed["from_round"] == stopped.round + 1 and resumed["previous_status"] == "running"
    assert resumed["restarted_on_clients"] is None  # nothing of these methods lives on the clients
    assert "resume" not in info["config"]  # run.json names no path of this machine
    assert info["checkpoint"]["bytes"] > 0 and info["checkpoint"]["seconds_per_save"] > 0


def test_checkpoint_every_saves_every_that_many_rounds_and_after_the_last(tmp_path):
    config = small(tmp_path, "fedavg", "every-3", **{"num-server-rounds": 7, "checkpoint-every": 3})
    assert [r for r in range(1, 8) if checkpoint_due(config, r)] == [3, 6, 7]
    assert all(checkpoint_due(small(tmp_path, "fedavg", "every-1"), r) for r in range(1, 5))


def checkpointed_run(tmp_path: Path, done: int = 2, finished: bool = False) -> tuple[Path, RunConfig]:
    """A 3-round run's folder as the ServerApp leaves it after ``done`` rounds (finished, or killed)."""
    config = small(tmp_path, "conditional", "stopped", **{"num-server-rounds": 3}).resolved()
    folder = tmp_path / "results" / "stopped"
    folder.mkdir(parents=True)
    recorder = RunRecorder(folder, config, {}, config.num_clusters)
    for number in range(1, done + 1):
        recorder.add(RoundRecord(number, 0.5, 1.0, 1.0, 1.0, float(number), 10, 10))
    save_checkpoint(folder, Checkpoint(done, list(recorder.records), {"global": [np.zeros(3, np.float32)]}))
    if finished:
        recorder.finish()
    recorder.close()
    return folder, config


@pytest.mark.parametrize(
    ("case", "settings", "message"),
    [
        ("no run.json", [], "no run.json there; give the folder of a run"),
        ("no checkpoint", [], "no checkpoint.pt there (the run stopped before finishing round 1); start it again"),
        ("finished", [], "the run already finished its 3 rounds; to extend it, give num-server-rounds above 3"),
        (
            "stopped",
            ["method=fedavg", "seed=1"],
            'these may not change: method (given "fedavg", recorded "conditional"), seed (given 1, recorded 0); '
            'give them as recorded: method="conditional" seed=0',
        ),
        ("stopped", ["num-server-rounds=2"], "num-server-rounds=2 is not above the 2 rounds already finished"),
        ("stopped", ["run-name=other"], "a resumed run stays in its folder; leave out results-dir and run-name"),
        ("held", [], "the run is still going (process "),
    ],
)
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry run"])
def test_a_bad_resume_is_refused_in_one_line_before_anything_starts(tmp_path, capsys, case, settings, message, dry_run):
    folder, _ = checkpointed_run(tmp_path, done=3 if case == "finished" else 2, finished=case == "finished")
    if case == "no run.json":
        (folder / "run.json").unlink()
    if case == "no checkpoint":
        (folder / "checkpoint.pt").unlink()
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    held = locks.acquire(folder / RUN_LOCK) if case == "held" else None
    try:
        assert main(["run", *dry_run, f"resume={folder}", *settings]) == 2
    finally:
        if held is not None:
            held.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"fedcond: error: resume={folder}: ") and message in line
    after = {path.name: path.read_bytes() for path in folder.iterdir()}
    assert {name: data for name, data in after.items() if name != RUN_LOCK} == {
        name: data for name, data in before.items() if name != RUN_LOCK
    }  # nothing was touched


def test_the_dry_run_of_a_resume_checks_the_recorded_settings_as_the_run_does(tmp_path, capsys):
    """``fedcond run --dry-run resume=F`` passes where ``fedcond run resume=F`` would start: the
    recorded settings are the run's, not the defaults (which would all 'differ')."""
    folder, _ = checkpointed_run(tmp_path)
    assert main(["run", "--dry-run", f"resume={folder}"]) == 0
    assert "fedcond: dry run: conditional on digits" in capsys.readouterr().out


def test_fedcond_run_resume_passes_the_recorded_settings_in_full(tmp_path):
    folder, recorded = checkpointed_run(tmp_path)
    # Raising num-server-rounds extends the run; verbose is free; every other setting is the record's,
    # passed in full to flwr run, since a deployed client sees only the run config.
    config, overrides = prepare([f"resume={folder}", "num-server-rounds=5", "verbose=true"])
    assert config.num_server_rounds == 5 and config.verbose and RESUME.of(config) == str(folder)
    free = ("num-server-rounds", "verbose", "resume")
    assert {key: value for key, value in config.to_mapping().items() if key not in free} == {
        key: value for key, value in recorded.to_mapping().items() if key not in free
    }
    assert overrides == config.to_mapping() and overrides["run-name"] == "stopped"
    assert check_resume(config).round == 2
    # Extending a finished run is a resume too.
    finished, _ = checkpointed_run(tmp_path / "other", done=3, finished=True)
    assert prepare([f"resume={finished}", "num-server-rounds=4"])[0].num_server_rounds == 4


def test_plain_flwr_run_resume_needs_the_recorded_settings(tmp_path):
    """``flwr run --run-config 'resume=...'`` gives the app's defaults for every key it does not
    set: the ServerApp cannot tell them from given values, so any that differs is refused."""
    folder, _ = checkpointed_run(tmp_path)
    given = {"method": "conditional", "num-clusters": 2, "clients-per-cluster": 1, "data-fraction": 0.5}
    config = RESUME.set(run_config({**default_config(), **given}), str(folder))
    # Which keys were given is unknown (in-process, or an old caller): every difference is named as such.
    with pytest.raises(FedcondError) as unknown:
        check_resume(config)
    assert str(unknown.value) == (
        f"resume={folder}: a resumed run keeps its recorded settings; these may not change: local-epochs (here 5, "
        "recorded 1); give them as recorded: local-epochs=1"
    )
    # Known (the ServerApp reads --run-config's keys, fedcond submit its own): local-epochs was left
    # out and pyproject.toml's 5 taken, so it must be repeated, while a changed seed may not change.
    with pytest.raises(FedcondError) as known:
        check_resume(config.replace(seed=3), given=[*given, "seed", "resume", "num-server-rounds"])
    assert str(known.value) == (
        f"resume={folder}: a resumed run keeps its recorded settings; these may not change: seed (given 3, "
        "recorded 0); these were left out, so the app's defaults were taken: local-epochs (default 5, recorded 1); "
        "give them as recorded: local-epochs=1 seed=0"
    )
    assert "leave" not in str(known.value)  # leaving local-epochs out is what went wrong
    assert check_resume(config.replace(local_epochs=1)).round == 2


def test_a_plain_flwr_run_resume_must_give_its_rounds_or_pyprojects_would_silently_extend_it(tmp_path):
    """Flower's override_config says which keys --run-config gave; the ServerApp refuses a resume
    without num-server-rounds rather than run to pyproject.toml's 10 rounds."""
    from fedcond.federation.server_app import check_resumed_rounds

    folder, recorded = checkpointed_run(tmp_path)
    config = RESUME.set(run_config({**default_config(), **recorded.to_mapping()}), str(folder))
    with pytest.raises(FedcondError) as error:
        check_resumed_rounds(config, {"resume": str(folder)})
    assert str(error.value) == (
        f"resume={folder}: give num-server-rounds in --run-config (the run recorded 3: that many finishes it, more "
        "extends it); left out, pyproject.toml's 3 would be taken"
    )
    check_resumed_rounds(config, {"resume": str(folder), "num-server-rounds": 3})
    check_resumed_rounds(RESUME.set(config, ""), {})  # a new run: nothing to say


def test_fedcond_submit_refuses_a_resume_the_server_would_refuse_in_one_line_before_submitting(
    tmp_path, capsys, monkeypatch
):
    """``fedcond submit`` resumes through ``flwr run``: a setting left out takes the app's default, so
    the refusal names the settings to repeat as key=value (never "leave them out"), and a missing
    num-server-rounds is refused here too; one line each, exit 2, and Flower is never called."""
    import fedcond.tools.submit

    folder, _ = checkpointed_run(tmp_path)
    monkeypatch.setattr(fedcond.tools.submit, "executable", lambda name: pytest.fail(f"{name} was started"))
    assert main(["submit", "fedcond-local", f"resume={folder}", "num-server-rounds=3", "seed=1"]) == 2
    printed = capsys.readouterr()
    (line,) = printed.err.splitlines()
    assert printed.out == "" and "{" not in line and "leave" not in line
    defaults = run_config(default_config()).resolved().to_mapping()  # as compared: dataset defaults filled in
    left_out = ", ".join(
        f"{key} (default {json.dumps(defaults[key])}, recorded {json.dumps(value)})"
        for key, value in (("clients-per-cluster", 1), ("data-fraction", 0.5), ("local-epochs", 1), ("num-clusters", 2))
    )
    assert line == (
        f"fedcond: error: resume={folder}: a resumed run keeps its recorded settings; these may not change: seed "
        f"(given 1, recorded 0); these were left out, so the app's defaults were taken: {left_out}; give them as "
        "recorded: clients-per-cluster=1 data-fraction=0.5 local-epochs=1 num-clusters=2 seed=0"
    )
    recorded = ["method=conditional", "num-clusters=2", "clients-per-cluster=1", "local-epochs=1", "data-fraction=0.5"]
    assert main(["submit", "fedcond-local", f"resume={folder}", *recorded]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"fedcond: error: resume={folder}: give num-server-rounds in --run-config (the run recorded 3"
    )


@pytest.mark.slow
def test_a_pooled_run_that_failed_in_epoch_3_resumes_to_the_uninterrupted_numbers(tmp_path, monkeypatch):
    import fedcond.pooled

    settings = {"num-server-rounds": 3, "data-fraction": 0.25}
    straight = small(tmp_path, "pooled-conditional", "straight", **settings)
    run_pooled(straight)
    evaluate, calls = fedcond.pooled.evaluate, []

    def failing_in_round_3(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2 * 2 + 1:  # 2 clients evaluated a round: the first evaluation of round 3
            raise RuntimeError("the machine went away")
        return evaluate(*args)

    monkeypatch.setattr(fedcond.pooled, "evaluate", failing_in_round_3)
    stopped = small(tmp_path, "pooled-conditional", "stopped", **settings)
    with pytest.raises(RuntimeError):
        run_pooled(stopped)
    folder = tmp_path / "results" / "stopped"
    assert run_status(folder) == "failed: RuntimeError: the machine went away" and load_checkpoint(folder).round == 2
    monkeypatch.setattr(fedcond.pooled, "evaluate", evaluate)

    run_pooled(RESUME.set(stopped, str(folder)))

    assert history(folder) == history(tmp_path / "results" / "straight")
    assert_same_models(load_checkpoint(folder), load_checkpoint(tmp_path / "results" / "straight"))
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "finished" and "error" not in info
    assert info["resumed"][0]["previous_status"] == "failed: RuntimeError: the machine went away"
    assert (folder / "traceback-before-resume-1.txt").is_file() and not (folder / "traceback.txt").exists()


class CheckpointingRunner:
    """Writes a run's folder and checkpoint as the ServerApp does; ``stop_after`` rounds, the run
    "dies" (returns with run.json still running); a resume goes on from the checkpoint."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[RunConfig] = []
        self.stop_after = stop_after

    def __call__(self, config: RunConfig) -> None:
        self.calls.append(config)
        folder = Path(config.results_dir) / config.run_name
        checkpoint = load_checkpoint(folder) if RESUME.of(config) else None
        if checkpoint is None:
            folder.mkdir(parents=True)
            recorder = RunRecorder(folder, config.resolved(), {}, config.num_clusters)
        else:
            recorder = reopen_run(config.resolved(), folder, config.num_clusters, checkpoint.history, {})
        for number in range((checkpoint.round if checkpoint else 0) + 1, config.num_server_rounds + 1):
            recorder.add(RoundRecord(number, 0.1 * number, 1.0, 1.0, 1.0, float(number), 10, 10))
            save_checkpoint(folder, Checkpoint(number, list(recorder.records)))
            if number == self.stop_after:
                recorder.close()
                return
        recorder.finish()


def test_compare_resumes_interrupted_runs_and_restarts_the_rest_from_scratch(tmp_path):
    experiment = Experiment(
        {"num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 4},
        {"method": ["fedavg", "ditto"], "seed": [0, 1]},
        kind="compare",
    )
    run_experiment(experiment, default_config(), tmp_path, CheckpointingRunner(stop_after=2), io.StringIO())
    runs = tmp_path / "runs"
    assert {run_status(folder) for folder in runs.iterdir()} == {"failed: the run ended without finishing; "
                                                                 "see the error printed above this line"}  # fmt: skip
    (runs / "method-fedavg_seed-1" / "checkpoint.pt").unlink()  # as if killed before round 1 finished
    runner, stream = CheckpointingRunner(), io.StringIO()

    run_experiment(experiment, default_config(), tmp_path, runner, stream)

    resumed = {(config.method, config.seed): RESUME.of(config) for config in runner.calls}
    # fedavg seed 0 goes on from its checkpoint; seed 1 has none; Ditto's personal models live on its
    # clients, which a resume would restart: both start afresh.
    assert resumed == {
        ("fedavg", 0): str(runs / "method-fedavg_seed-0"), ("fedavg", 1): "", ("ditto", 0): "", ("ditto", 1): "",
    }  # fmt: skip
    assert "4 to run (1 resumed from their checkpoint)" in stream.getvalue()
    assert "[1/4] method-fedavg_seed-0 (4 clients, resumed after round 2)" in stream.getvalue()
    # The resumed run's progress lines are its rounds 3 and 4, not again 1 and 2.
    assert "method-fedavg_seed-0: round 1/4" not in stream.getvalue()
    assert "method-fedavg_seed-0: round 4/4" in stream.getvalue()
    for folder in runs.iterdir():
        assert run_status(folder) == "finished"
        assert [row["round"] for row in history(folder)] == ["1", "2", "3", "4"]
    assert len(json.loads((runs / "method-fedavg_seed-0" / "run.json").read_text())["resumed"]) == 1
    # A third rerun finds everything finished, resumed runs included (their settings compare equal).
    third = CheckpointingRunner()
    run_experiment(experiment, default_config(), tmp_path, third, io.StringIO())
    assert third.calls == []


def test_compare_refuses_a_run_folder_another_process_is_running_in(tmp_path):
    experiment = Experiment({"num-server-rounds": 4}, {"method": ["fedavg"], "seed": [0]}, kind="compare")
    run_experiment(experiment, default_config(), tmp_path, CheckpointingRunner(stop_after=2), io.StringIO())
    folder = tmp_path / "runs" / "method-fedavg_seed-0"
    held = locks.acquire(folder / RUN_LOCK)
    try:
        with pytest.raises(FedcondError, match="is in use by another run \\(process "):
            run_experiment(experiment, default_config(), tmp_path, CheckpointingRunner(), io.StringIO())
    finally:
        held.close()
    assert load_checkpoint(folder).round == 2  # left alone


def methods_with_server_state() -> list[str]:
    """Every registered method whose server holds more than the global model (it extends ``state``)."""
    from fedcond.federation.methods import registry
    from fedcond.federation.server_method import ServerMethod

    return [name for name, m in registry().items() if m.strategy and m.strategy.state is not ServerMethod.state]


def test_the_methods_whose_server_keeps_state_are_those_that_declare_it():
    """A method that keeps per-cluster or per-client models must extend ``state`` (the checkpoint
    saves only what it returns), and one that extends it says so in its Facts."""
    from fedcond.federation.methods import registry

    declared = {name for name, method in registry().items() if method.facts and method.facts.server_state}
    assert set(methods_with_server_state()) == declared and "oracle" in declared


@pytest.mark.parametrize("method", methods_with_server_state())
def test_per_client_server_state_is_saved_and_restored_by_partition_id(method):
    """A resumed run is a new Flower run: every node has a new id. What the server holds per client
    (assignments, per-client models) is keyed by partition id, the name a client keeps, so a fresh
    strategy gets back exactly what the stopped one held after a round, whichever nodes hold the
    partitions now."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    from fedcond.data.scenarios import scenario_for
    from fedcond.federation.messages import CHOICE, PAYLOAD_PARTS, TRAIN_LOSS, pack_parts
    from fedcond.federation.methods import get_method
    from fedcond.federation.server_method import StrategyInputs, initial_weights
    from fedcond.federation.strategy import FedcondStrategy

    # CFL: thresholds under which round 1's random updates split the cluster, so that a split is restored.
    splitting = {"cfl-warmup-rounds": 0, "cfl-eps1": 1e6, "cfl-eps2": 0, "cfl-min-cluster-size": 1}
    # Every method whose server averages a model, with its FedAvgM velocities (one per model): the
    # FedAvg family holds state only with a server optimiser.
    momentum = {"server-momentum": 0.5} if get_method(method).strategy.server_step_refusal is None else {}
    config = run_config({"method": method, "num-clusters": 2, "clients-per-cluster": 2, **momentum,
                         **(splitting if method == "cfl" else {})}).resolved()  # fmt: skip
    strategy_class = get_method(method).strategy
    inputs = StrategyInputs(config, 10, get_method(method).conditioned, None, scenario=scenario_for(config))
    before = FedcondStrategy(strategy_class(inputs)).method
    if method == "descriptor-clustering":  # its exchange before round 1 (the clients' descriptors), given here
        before.place([np.array([0.0, 0.0]), np.array([0.1, 0.0]), np.array([5.0, 1.0]), np.array([5.1, 1.0])])
    rng = np.random.default_rng(0)
    shapes = [array.shape for array in initial_weights(inputs)]

    def reply(pid: int) -> FitRes:
        """A trained model (and whatever else the method's reply names or carries after it) of random arrays."""
        parts = {name: [rng.normal(size=shape).astype(np.float32) for shape in shapes]
                 for name in strategy_class.reply_parts or ("model",)}  # fmt: skip
        arrays, names = pack_parts(parts)
        arrays += [rng.normal(size=shape).astype(np.float32) for shape in before.reply_extra_shapes()]
        named = {PAYLOAD_PARTS: names} if strategy_class.reply_parts else {}
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 10 + pid,
                      {TRAIN_LOSS: 0.0, CHOICE: (pid + 1) % 2, **named})  # fmt: skip

    replies = [(pid, reply(pid)) for pid in range(4)]
    for pid in range(4):  # what each client is sent (pFedHN measures each update from it)
        before.instruction(FIT, pid, before.initial_global(), {})
    before.combine(1, replies)
    assert method != "cfl" or len(before.models) == 2
    models, values = before.state()
    json.dumps(values)  # plain values only
    assert any(name != "global" for name in models)  # per-client or per-cluster models, by name

    after = FedcondStrategy(strategy_class(inputs)).method
    after.load_state(models, values)
    again_models, again_values = after.state()
    assert again_values == values and sorted(again_models) == sorted(models)
    for name, model in models.items():
        assert all(np.array_equal(a, b) for a, b in zip(model, again_models[name], strict=True)), name
    for partition in range(4):  # and each client is served from what was restored
        served, expected = (
            after.instruction(EVALUATE, partition, None, {})[0],
            before.instruction(EVALUATE, partition, None, {})[0],
        )
        assert served == expected or served.tensors == expected.tensors  # the FedAvg family: what it is given


@pytest.mark.slow
def test_fedcond_run_resume_goes_through_flwr_run_with_the_recorded_settings(tmp_path, one_thread):
    """The user's command, on a local SuperLink of its own (own Flower home, free ports, so a SuperLink
    left on flwr's default port by an earlier `make run` changes nothing): the ServerApp and the
    ClientApps read everything from the run config flwr run passes them. The suite's one real
    `flwr run` (each costs minutes), so it also checks what the terminal shows of it and that
    `fedcond stop-superlink` ends this Flower home's SuperLink alone."""
    from fedcond.tools.deploy import free_ports

    # One torch thread (one_thread) in these in-process runs, as Ray's actors train the resumed one.
    simulate(small(tmp_path, "fedavg", "straight", **{"num-server-rounds": 3}))
    simulate(small(tmp_path, "fedavg", "stopped", **{"num-server-rounds": 2}))
    http_port, control_port = free_ports(2)
    environment = {
        **os.environ,
        "FLWR_HOME": str(tmp_path / "flwr-home"),
        # flwr 1.42 reads these when it starts the local SuperLink of a ":local:" connection.
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
    }
    command = [sys.executable, "-m", "fedcond.tools.cli", "run", "resume=results/stopped", "num-server-rounds=3",
               "verbose=true"]  # fmt: skip
    # Another Flower home's SuperLink (a stand-in by that name): `fedcond stop-superlink` must leave it.
    other = tmp_path / "flower-superlink"
    other.write_text("import time\ntime.sleep(600)\n")
    other_home_log = tmp_path / "other-home" / "local-superlink" / "superlink.log"
    bystander = subprocess.Popen([sys.executable, str(other), "--log-file", str(other_home_log)])
    folder = tmp_path / "results" / "stopped"
    try:
        finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        # A failed `flwr run` says why here, before anything reads what it should have written.
        assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
        recorded = json.loads((folder / "local-superlink.json").read_text())["pid"]
        # The SuperLink flwr started for this test's Flower home, not the stand-in or an earlier run's.
        assert str(tmp_path / "flwr-home") in " ".join(psutil.Process(recorded).cmdline())
        stopped = subprocess.run([sys.executable, "-m", "fedcond.tools.cli", "stop-superlink"], env=environment,
                                 capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
        assert f"(PID {recorded})" in stopped.stdout and not alive(recorded)
        assert bystander.poll() is None  # the other home's SuperLink still runs
    finally:
        stop_superlink_on(http_port)
        bystander.kill()
    assert f"fedcond: resuming {folder} from round 3 of 3" in finished.stdout
    assert "round   3/3  accuracy" in finished.stdout and "round   1/3" not in finished.stdout
    assert f"local SuperLink (PID {recorded}" in finished.stdout and "fedcond stop-superlink" in finished.stdout
    # The terminal holds fedcond's lines only; Flower's own (INFO ...) went to the run's Flower log.
    assert all(line.startswith(("fedcond:", "round ", "scenario ", "  ")) for line in finished.stdout.splitlines())
    assert "INFO" in (folder / "flower-resume-1.log").read_text()
    # The extended run equals a 3-round run: the clients trained with the recorded settings. Only
    # round 2's downloads differ: it was the 2-round run's last, which ends with evaluate messages
    # (evaluate-in-fit); the 3-round run's round 2 evaluates in round 3's fit instead.
    without_downloads = [[{k: v for k, v in row.items() if k != "bytes_down"} for row in history(run)]
                         for run in (folder, tmp_path / "results" / "straight")]  # fmt: skip
    assert without_downloads[0] == without_downloads[1]
    assert_same_models(load_checkpoint(folder), load_checkpoint(tmp_path / "results" / "straight"))
    info = json.loads((folder / "run.json").read_text())
    assert info["status"] == "finished" and info["resumed"][0]["previous_status"] == "finished"
    assert (folder / "convergence.png").is_file()


def stop_superlink_on(port: int) -> None:
    """flwr leaves its local SuperLink running: end the one this test's port identifies, and its children.
    Found by port, not by fedcond.tools.local_superlink.stop (the code under test): a broken stop
    must still not leave the SuperLink behind."""
    for process in psutil.process_iter(["cmdline"], ad_value=None):
        cmdline = process.info["cmdline"] or []
        if any("flower-superlink" in part for part in cmdline) and str(port) in cmdline:
            for child in [*process.children(recursive=True), process]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.terminate()


def test_a_checkpoint_keeps_every_array_of_a_batchnorm_model_with_its_shape(tmp_path):
    """CIFAR's CNN has BatchNorm, whose num_batches_tracked is a 0-d array: a checkpoint that stored it
    as shape (1,) could not be loaded back into the model (a pooled CIFAR run failed to resume so)."""
    from fedcond.model.networks import build_model, get_weights, set_weights

    model = build_model((3, 32, 32), 10, 0, seed=0)
    weights = get_weights(model)
    assert any(array.ndim == 0 for array in weights)  # the case at stake
    save_checkpoint(tmp_path, Checkpoint(1, [], {"global": weights}))
    loaded = load_checkpoint(tmp_path).models["global"]  # type: ignore[union-attr]
    assert [array.shape for array in loaded] == [array.shape for array in weights]
    set_weights(build_model((3, 32, 32), 10, 0, seed=1), loaded)  # refused a (1,) array before


def test_a_run_json_that_cannot_be_written_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """A full disk mid-write (the queue of this project once filled one) must not leave run.json
    empty: the next compare could not read whether the run had finished."""
    import errno
    import pathlib

    from fedcond.records.history import write_run_info

    write_run_info(tmp_path, {"status": "running", "rounds_completed": 3})
    real_write = pathlib.Path.write_text

    def disk_full(self, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_write(self, data[: len(data) // 2], *args, **kwargs)  # half of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_run_info(tmp_path, {"status": "finished", "rounds_completed": 4})
    monkeypatch.undo()
    assert json.loads((tmp_path / "run.json").read_text()) == {"status": "running", "rounds_completed": 3}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run.json"]  # no temporary left behind


def test_a_run_flower_stops_from_outside_says_so_in_its_run_json(tmp_path):
    """`flwr stop` ends a run through Flower's exit handlers (its heartbeat raises SIGINT in the
    ServerApp's process), with no exception for the run to record: the ServerApp registers one that
    marks run.json. Here Flower's handlers are triggered as its exit does, while round 2 is asked."""
    from flwr.supercore.exit.exit_handler import trigger_exit_handlers

    config = small(tmp_path, "fedavg", "stopped", **{"evaluate-in-fit": False})
    folder = tmp_path / "results" / "stopped"
    seen: dict[str, object] = {}

    def flower_exits_in_round_2(message, context, call_next):
        rows = history(folder) if (folder / "history.csv").exists() else []
        if len(rows) == 1 and not seen:
            trigger_exit_handlers(run_before_force_exit=False)
            seen.update(json.loads((folder / "run.json").read_text()))
        return call_next(message, context)

    simulate(config, client_mods=[flower_exits_in_round_2], quiet=True)
    assert seen["status"] == "stopped" and "stopped before it finished (flwr stop" in str(seen["error"])
    assert f"resume={folder}" in str(seen["error"])

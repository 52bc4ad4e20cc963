"""End to end through Flower's simulation runtime: the ServerApp in a thread, the ClientApps in this
process (tests/thread_backend.py), except the test marked ``ray``, whose ClientApps run on Ray's actors."""

import csv
import json
import math
import time
from pathlib import Path

import pytest

from fedcond.config import RunConfig
from fedcond.data.scenarios import SCENARIOS
from fedcond.federation.methods import flower_method_names, get_method, registry, run_config
from fedcond.tools.simulation import simulate
from tests.faults import FIT, HANG, RAISE, REPORT, Fault
from tests.method_settings import method_test_settings


def read_history(results: Path) -> tuple[list[dict[str, str]], dict]:
    (folder,) = results.iterdir()
    with (folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return rows, json.loads((folder / "run.json").read_text())


# Every federated method of the registry and every named variant: a new method gets this test.
METHODS = flower_method_names()


# pFedHN's server moves the generated models by small steps (pfedhn-lr 0.002, strategies/pfedhn.py):
# 0.10, 0.20, 0.27 in these 3 rounds, still twice chance; every other method is above 0.6.
SLOW_LEARNERS = {"pfedhn": 0.2}


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_method_learns_through_flower_and_writes_a_finite_complete_history(tmp_path, method):
    """Digits E1 K=2 x 2 clients, 3 rounds of digits' default 5 local epochs: every method ends well
    above chance (0.1; each cluster's 5 classes: 0.2), measured 0.76 (Ditto) to 0.97 (recommended)."""
    declared = method_test_settings(method, tmp_path)
    config = run_config({
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 3,
        "results-dir": str(tmp_path / "results"), "verbose": False, **declared,
    })  # fmt: skip
    simulate(config)
    rows, info = read_history(tmp_path / "results")
    assert [int(row["round"]) for row in rows] == [1, 2, 3]
    floor = SLOW_LEARNERS.get(method, 0.6)
    assert float(rows[-1]["accuracy"]) > floor, f"{method} did not learn: {[row['accuracy'] for row in rows]}"
    for row in rows:
        assert 0.0 <= float(row["accuracy"]) <= 1.0
        for column in ("loss", "train_loss", "seconds", "accuracy_cluster_0", "accuracy_cluster_1"):
            assert math.isfinite(float(row[column])), column
        # Local exchanges nothing; everyone else moves models (gossip and DAC between peers).
        assert (int(row["bytes_down"]) > 0) == (method != "local")
        assert (int(row["bytes_up"]) > 0) == (method != "local")
        # IFCA, descriptor clustering and CFL record how well they recover the true clusters; no other method guesses.
        assert math.isfinite(float(row["ari"])) == (method in ("ifca", "descriptor-clustering", "cfl"))
        assert math.isnan(float(row["heldout_accuracy"]))  # no held-out clients
    assert info["status"] == "finished" and info["rounds_completed"] == 3
    if method == "ifca":  # all K=2 models go down each training round (round 1: its only message)
        fedavg_down = 4 * info["model_parameters"] * 4  # 4 clients x one model x float32
        assert int(rows[0]["bytes_down"]) > 1.4 * fedavg_down
    assert info["config"]["method"] == method and info["config"]["local-epochs"] == declared.get("local-epochs", 5)
    assert info["versions"]["flwr"] == "1.42.0"
    # Only conditioned methods run the secure sum for federated normalisation.
    assert (info["secure_sum_bytes"] > 0) == get_method(method).conditioned
    # No path of this machine in run.json: results-dir is recorded relative to the run's folder, and says so.
    assert info["config"]["results-dir"] == ".." and "results_folder" not in info
    assert info["config_paths"]["results-dir"] == "relative to this run's folder"
    (folder,) = (tmp_path / "results").iterdir()
    assert not list(folder.glob(".*lock"))  # a finished run's folder holds no lock


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_wrong_number_of_nodes_stops_before_training(tmp_path, capsys):
    config = run_config({
        "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 1, "node-timeout": 2,
        "results-dir": str(tmp_path / "r"),
    })  # fmt: skip
    simulate(config, num_supernodes=3)  # the in-process ServerApp stops; run_simulation returns
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedcond: error:")]
    assert len(errors) == 1 and "the federation has 3 nodes" in errors[0] and "num-supernodes=4" in errors[0]
    rows, info = read_history(tmp_path / "r")
    assert rows == [] and info["status"] == "failed" and "num-supernodes=4" in info["error"]


SCENARIO_DATASETS = {
    "covariate-rotation": "digits", "concept-permutation": "digits", "concept-semantic": "mnist",
    "domain": "mnist", "covariate-subclass": "cifar10", "combined": "cifar10",
    "dirichlet": "digits", "pathological": "digits", "concept-weights": "synthetic-logistic",
}  # fmt: skip


def test_every_scenario_of_the_table_runs_through_flower_below():
    """label-shift runs in every method's test above; each other scenario needs its line here."""
    assert set(SCENARIO_DATASETS) | {"label-shift"} == set(SCENARIOS)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", list(SCENARIO_DATASETS))
def test_every_scenario_runs_through_flower(tmp_path, scenario):
    from tests.test_cifar import write_cifar10_folder
    from tests.test_datasets import write_fake_mnist

    write_fake_mnist(tmp_path / "data" / "mnist", train=80, test=40)
    write_fake_mnist(tmp_path / "data" / "fashion-mnist", train=80, test=40)
    write_cifar10_folder(tmp_path / "data" / "cifar10-jpeg", per_class=(8, 4))
    from fedcond.data.scenarios import UNCLUSTERED_SCENARIOS

    # One population cut by a partitioner: four clients and a newcomer, no clusters.
    clusters, clients = (1, 4) if scenario in UNCLUSTERED_SCENARIOS else (2, 2)
    config = RunConfig(
        scenario=scenario, dataset=SCENARIO_DATASETS[scenario], num_clusters=clusters, clients_per_cluster=clients,
        held_out_clients=int(scenario in UNCLUSTERED_SCENARIOS), covariate_clusters=1, num_server_rounds=1,
        local_epochs=1, data_dir=str(tmp_path / "data"), results_dir=str(tmp_path / "results"), verbose=False,
    )  # fmt: skip
    simulate(config)
    rows, info = read_history(tmp_path / "results")
    assert len(rows) == 1 and math.isfinite(float(rows[0]["accuracy"])) and info["status"] == "finished"
    assert info["scenario"]["scenario"] == scenario and len(info["scenario"]["clusters"]) == clusters
    if scenario in UNCLUSTERED_SCENARIOS:
        assert math.isfinite(float(rows[0]["heldout_accuracy"]))


@pytest.mark.slow
def test_held_out_clients_never_train_and_are_reported_apart(tmp_path):
    config = RunConfig(
        method="conditional", fingerprint="class-mean", conditioning="hyper", num_clusters=2, clients_per_cluster=2,
        held_out_clients=1, num_server_rounds=2, local_epochs=1, results_dir=str(tmp_path / "r"), verbose=False,
    )  # fmt: skip
    simulate(config)  # 6 nodes: 4 training clients, then 1 held-out client per cluster
    rows, info = read_history(tmp_path / "r")
    assert info["status"] == "finished" and info["scenario"]["held_out_clients_per_cluster"] == 1
    model_bytes = info["model_parameters"] * 4  # float32
    for row in rows:
        assert 0.0 <= float(row["heldout_accuracy"]) <= 1.0
        # Only the 4 training clients return a model; the 2 held-out ones receive one to evaluate each
        # round, the training ones only after the last (evaluate-in-fit: before, in their fit).
        assert int(row["bytes_up"]) == pytest.approx(4 * model_bytes, rel=0.01)
        evaluating = 6 if row["round"] == str(config.num_server_rounds) else 2
        assert int(row["bytes_down"]) == pytest.approx((4 + evaluating) * model_bytes, rel=0.01)
    assert info["final_heldout_accuracy"] == float(rows[-1]["heldout_accuracy"])


# Fault injection (tests/faults.py): one client of 2 x 2 fails in round 2 of 4, per method family.
# min-answered-fraction 0.75 lets 3 of 4 go on. The hang waits out round-timeout (15 s: a round here
# takes a second or two) while the other clients answer: two messages at once (client_threads).
ROUND_TIMEOUT = 15


def fault_families() -> list[tuple[str, Fault, str, str]]:
    """One run per pairing of client and strategy classes the method table holds (its first method):
    a peer-to-peer server's client hangs (the round waits out round-timeout), the others raise or
    report an error in turn, each on another partition."""
    families, seen = [], set()
    for name, method in registry().items():
        pairing = (method.client, method.strategy)
        if method.client is None or pairing in seen:
            continue
        seen.add(pairing)
        index = len(families)
        if method.strategy.peer_to_peer:
            fault = Fault(index % 4, 2, FIT, HANG)
            families.append((name, fault, "timed out", f"no answer within round-timeout={ROUND_TIMEOUT} s"))
        else:
            fault = Fault(index % 4, 2, FIT, (RAISE, REPORT)[index % 2])
            families.append((name, fault, "failed", fault.reason))
    return families


FAMILIES = fault_families()


def test_the_fault_families_cover_every_pairing_and_every_kind_of_fault():
    pairing = {name: (method.client, method.strategy) for name, method in registry().items() if method.client}
    assert set(pairing.values()) == {pairing[name] for name, *_ in FAMILIES}
    assert {family[1].how for family in FAMILIES} == {RAISE, REPORT, HANG}


@pytest.mark.slow
@pytest.mark.client_threads(2)
@pytest.mark.parametrize(("method", "fault", "outcome", "reason"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_client_failing_in_round_2_leaves_that_round_to_the_others(tmp_path, method, fault, outcome, reason):
    config = run_config({
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 4, "local-epochs": 1,
        "min-answered-fraction": 0.75, "round-timeout": ROUND_TIMEOUT, "results-dir": str(tmp_path / "r"),
        "verbose": False, **method_test_settings(method, tmp_path),
    })  # fmt: skip
    simulate(config, client_mods=[fault], quiet=True)
    assert_survived_one_failure(tmp_path / "r", method, fault, outcome, reason)


@pytest.mark.slow
@pytest.mark.ray
def test_on_rays_actors_a_conditioned_run_survives_a_failure_with_the_in_process_numbers(tmp_path, monkeypatch):
    """The users' backend: each virtual client in a Ray actor of its own, which unpickles the
    ClientApp with its mods; the secure sum of the fingerprint statistics before round 1, then a
    client raising in round 2. The first messages wait for Ray to start its actors: a CI run with the
    other test processes on the same 2 cores once took over 60 s for that (the run failed before
    round 1), so round-timeout is 300 s; the fault raises at once, so no round waits for it. The
    same run with the ClientApps in this process, as every other test runs them, gives the same
    rounds: the in-process backend changes where clients run, not what they compute."""
    fault = Fault(1, 2, FIT, RAISE)
    settings = {
        "method": "conditional", "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 4,
        "local-epochs": 1, "min-answered-fraction": 0.75, "round-timeout": 300, "verbose": False,
    }  # fmt: skip
    simulate(run_config({**settings, "results-dir": str(tmp_path / "ray")}), client_mods=[fault], quiet=True)
    info = assert_survived_one_failure(tmp_path / "ray", "conditional", fault, "failed", fault.reason)
    assert info["secure_sum_bytes"] > 0

    from tests.thread_backend import install

    install(1, monkeypatch.setattr)
    simulate(run_config({**settings, "results-dir": str(tmp_path / "threads")}), client_mods=[fault], quiet=True)
    on_ray, in_process = read_history(tmp_path / "ray")[0], read_history(tmp_path / "threads")[0]
    for ray_row, process_row in zip(on_ray, in_process, strict=True):
        assert ray_row["bytes_down"] == process_row["bytes_down"] and ray_row["bytes_up"] == process_row["bytes_up"]
        # Ray's actors sum the clients' updates in their order of arrival: floating point, not bits.
        assert float(ray_row["accuracy"]) == pytest.approx(float(process_row["accuracy"]), abs=0.01)


def assert_survived_one_failure(results: Path, method: str, fault: Fault, outcome: str, reason: str) -> dict:
    """Round 2 went on with 3 of 4 clients, the missing one recorded by partition and reason; run.json.
    Round 1's model was to be scored in round 2's fit (one message a round): round 1 lost that client's
    evaluation too, and says so."""
    rows, info = read_history(results)
    assert info["status"] == "finished" and [int(row["round"]) for row in rows] == [1, 2, 3, 4]
    for row in rows:
        missing = (0, 1) if outcome == "timed out" else (1, 0)
        failed, timed_out = missing if row["round"] in ("1", "2") else (0, 0)
        assert (row["clients_asked"], row["clients_answered"]) == ("4", "3" if row["round"] in ("1", "2") else "4")
        assert (int(row["clients_failed"]), int(row["clients_timed_out"])) == (failed, timed_out)
        assert math.isfinite(float(row["accuracy"])) and math.isfinite(float(row["train_loss"]))
    assert sorted(info["failures"], key=lambda failure: failure["round"]) == [
        {"round": 1, "stage": "evaluate", "partition-id": fault.partition_id, "outcome": outcome,
         "reason": f"its evaluation was to come with round 2's fit, which {outcome}: {reason}"},
        {"round": 2, "stage": "fit", "partition-id": fault.partition_id, "outcome": outcome, "reason": reason},
    ]  # fmt: skip
    if not get_method(method).strategy.peer_to_peer:  # 3 models (if any) came back in round 2
        assert int(rows[1]["bytes_up"]) == 3 * int(rows[0]["bytes_up"]) // 4
    return info


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_too_few_answers_stop_the_run_with_one_line(tmp_path, capsys):
    config = RunConfig(
        method="fedavg", num_clusters=2, clients_per_cluster=2, num_server_rounds=3, local_epochs=1,
        results_dir=str(tmp_path / "r"), verbose=False,
    )  # fmt: skip
    simulate(config, client_mods=[Fault(0, 2, FIT, RAISE)], quiet=True)  # default min-answered-fraction 0.8
    rows, info = read_history(tmp_path / "r")
    assert [row["round"] for row in rows] == ["1"] and info["status"] == "failed" and info["rounds_completed"] == 1
    expected = (
        "round 2: 3 of 4 clients answered in fit, fewer than the 4 that min-answered-fraction=0.8 require; first: "
        "round 2: partition 0 failed in fit: injected fault: partition 0 round 2 fit; every failure is listed in "
        "run.json: fix those clients or lower min-answered-fraction"
    )
    # Round 1's model was to be scored in round 2's fit: partition 0 failed round 1 too, and its row says so.
    assert info["error"] == expected and [(f["round"], f["stage"]) for f in info["failures"]] == [
        (1, "evaluate"), (2, "fit"),
    ]  # fmt: skip
    assert (rows[0]["clients_answered"], rows[0]["clients_failed"]) == ("3", "1")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedcond: error:")]
    assert errors == [f"fedcond: error: {expected}"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_too_few_clients_left_in_the_statistics_sum_fail_the_run_before_round_1(tmp_path):
    # 2 clients: SecAgg+ needs both (threshold 2 of 2), so one dropping out at set-up leaves no sum.
    config = RunConfig(
        method="conditional", num_clusters=2, clients_per_cluster=1, num_server_rounds=1, local_epochs=1,
        results_dir=str(tmp_path / "r"), verbose=False,
    )  # fmt: skip
    simulate(config, client_mods=[Fault(1, 0, "setup", RAISE)], quiet=True)
    rows, info = read_history(tmp_path / "r")
    assert rows == [] and info["status"] == "failed"
    assert info["error"].startswith("the fingerprint statistics: SecAgg+ stopped with 0 of 2 clients")
    first = "first: round 0: partition 1 failed in fingerprint statistics: injected fault: partition 1 round 0 setup"
    assert first in info["error"]
    assert [failure["partition-id"] for failure in info["failures"]] == [1, 0]


@pytest.mark.slow
def test_under_secaggplus_a_client_dropping_mid_protocol_is_a_failure_the_round_survives(tmp_path):
    # Partition 1 raises in round 2 at SecAgg+'s masked-vector stage: left out of that round's sum,
    # recorded as the round's fit failure; 3 of 4 answers suffice (min-answered-fraction 0.75).
    config = run_config({
        "method": "fedavg", "secure-aggregation": "secaggplus", "num-clusters": 2, "clients-per-cluster": 2,
        "num-server-rounds": 3, "local-epochs": 1, "min-answered-fraction": 0.75, "results-dir": str(tmp_path / "r"),
        "verbose": False,
    })  # fmt: skip
    simulate(config, client_mods=[Fault(1, 2, "collect_masked_vectors", RAISE)], quiet=True)
    rows, info = read_history(tmp_path / "r")
    assert info["status"] == "finished" and [row["clients_answered"] for row in rows] == ["4", "3", "4"]
    (failure,) = info["failures"]
    assert (failure["round"], failure["stage"], failure["partition-id"]) == (2, "fit", 1)
    assert failure["reason"] == (
        "injected fault: partition 1 round 2 collect_masked_vectors (SecAgg+ collect_masked_vectors stage)"
    )
    assert all(math.isfinite(float(row["train_loss"])) and int(row["bytes_up"]) > 0 for row in rows)
    assert info["privacy"]["secure_aggregation"]["protocol"].startswith("SecAgg+")


@pytest.mark.slow
def test_under_secaggplus_each_rounds_sum_runs_over_its_sample_of_clients(tmp_path):
    config = run_config({
        "method": "fedavg", "secure-aggregation": "secaggplus", "num-clusters": 2, "clients-per-cluster": 2,
        "clients-per-round": 3, "evaluate-every": 2, "num-server-rounds": 2, "local-epochs": 1,
        "results-dir": str(tmp_path / "r"), "verbose": False,
    })  # fmt: skip
    simulate(config, quiet=True)
    rows, info = read_history(tmp_path / "r")
    assert info["status"] == "finished" and not info["failures"]
    # Round 1: its 3 sampled clients train in the sum and evaluate; round 2 (the last): every client evaluates.
    assert [row["clients_asked"] for row in rows] == ["3", "4"]
    assert all(math.isfinite(float(row["accuracy"])) and math.isfinite(float(row["train_loss"])) for row in rows)


def test_the_server_takes_its_nodes_as_soon_as_they_are_connected(tmp_path):
    """Flower's grid client manager refreshes its nodes every 5 s, or when asked how many it has:
    waiting on its wait_for cost every run (simulated or deployed) up to 5 s before round 1."""
    from types import SimpleNamespace

    from flwr.server import SimpleClientManager
    from flwr.server.compat.app_utils import start_update_client_manager_thread

    from fedcond.federation.exchange import all_clients

    grid = SimpleNamespace(get_node_ids=lambda: [11, 12, 13, 14], run=SimpleNamespace(run_id=1))
    manager = SimpleClientManager()
    _, stop, registered = start_update_client_manager_thread(grid, manager)  # type: ignore[arg-type]
    registered.wait()
    started = time.monotonic()
    try:
        proxies = all_clients(manager, RunConfig(num_clusters=2, clients_per_cluster=2))
    finally:
        stop.set()
    assert sorted(proxy.cid for proxy in proxies) == ["11", "12", "13", "14"]
    assert time.monotonic() - started < 1.0  # Flower's own refresh would come after 5 s


@pytest.mark.slow
def test_a_pfedhn_newcomer_failing_an_embedding_step_is_reported_and_the_run_goes_on(tmp_path):
    """Partition 4 (cluster 0's newcomer) raises in its round-2 embedding exchange: the failure is
    recorded under its stage, that round's adapted score is the other newcomer's, and the run ends."""
    fault = Fault(4, 2, FIT, RAISE)
    config = run_config({
        "method": "pfedhn", "num-clusters": 2, "clients-per-cluster": 2, "held-out-clients": 1, "newcomer-steps": 2,
        "num-server-rounds": 3, "local-epochs": 1, "results-dir": str(tmp_path / "r"), "verbose": False,
    })  # fmt: skip
    simulate(config, client_mods=[fault], quiet=True)
    rows, info = read_history(tmp_path / "r")
    assert info["status"] == "finished" and len(rows) == 3
    assert info["failures"] == [
        {"round": 2, "stage": "newcomer embedding", "partition-id": 4, "outcome": "failed", "reason": fault.reason}
    ]
    assert all(math.isfinite(float(row["heldout_adapted_accuracy"])) for row in rows)

"""What a process reuses between messages (partitions, the working model) changes no number."""

import numpy as np
import pytest
import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.task_identity import TaskIdentity

from fedcond.config import RunConfig
from fedcond.data import client_data
from fedcond.errors import FedcondError
from fedcond.federation.client_app import make_client_app
from fedcond.federation.methods import run_config
from fedcond.model import aggregation as agg
from fedcond.model.networks import build_run_model, get_weights
from tests.scripts import load_script


def federated_rounds(method: str, order: list[int], rounds: int = 2) -> list[tuple]:
    """Drive the ClientApp as a Ray actor does (every message through ``client_fn``), in one process,
    visiting clients in ``order``; FedAvg between rounds. Returns every reply, in partition order."""
    config = run_config({
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "local-epochs": 1, "data-fraction": 0.3,
        "ditto-personal-epochs": 1,
    })  # fmt: skip
    app = make_client_app(config)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    contexts = [Context(1, 10 + i, {"partition-id": i, "num-partitions": 4}, RecordDict(), {}) for i in range(4)]
    weights = get_weights(build_run_model(config.resolved(), 10, False))
    replies = []
    for server_round in range(1, rounds + 1):
        parameters, round_config = ndarrays_to_parameters(weights), {"server-round": server_round}
        fits = {}
        for i in order:
            content = compat.fitins_to_recorddict(FitIns(parameters, round_config), keep_input=True)
            reply = app(Message(content, dst_node_id=10 + i, message_type=MessageType.TRAIN), contexts[i])
            fits[i] = compat.recorddict_to_fitres(reply.content, keep_input=False)
        evaluations = {}
        for i in order:
            content = compat.evaluateins_to_recorddict(EvaluateIns(parameters, round_config), keep_input=True)
            reply = app(Message(content, dst_node_id=10 + i, message_type=MessageType.EVALUATE), contexts[i])
            evaluations[i] = compat.recorddict_to_evaluateres(reply.content)
        for i in range(4):
            replies.append((parameters_to_ndarrays(fits[i].parameters), fits[i].metrics, evaluations[i].loss))
        if method != "local":
            weights = agg.weighted_average(
                [replies[-4 + i][0] for i in range(4)], [fits[i].num_examples for i in range(4)]
            )
    return replies


# The reused working model is the client's: one client kind each whose model arrives from the server
# (FedAvg), whose second, personal model lives beside it in the same process (Ditto), and whose model
# never leaves the client (Local). This file's loop speaks plain FedAvg messages, which these three take.
@pytest.mark.parametrize("method", ["fedavg", "ditto", "local"])
def test_reusing_models_and_partitions_changes_no_number(method, monkeypatch, one_thread):
    monkeypatch.setenv("FEDCOND_REUSE", "0")
    fresh = federated_rounds(method, [0, 1, 2, 3])
    monkeypatch.setenv("FEDCOND_REUSE", "1")
    # Another order: the reused model last held another client's weights, as on a shared Ray actor.
    reused = federated_rounds(method, [3, 1, 0, 2])
    assert len(fresh) == len(reused) == 8
    for (weights_a, metrics_a, loss_a), (weights_b, metrics_b, loss_b) in zip(fresh, reused, strict=True):
        assert metrics_a == metrics_b and loss_a == loss_b
        assert len(weights_a) == len(weights_b)
        assert all(np.array_equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


def test_partition_cache_is_bounded_and_returns_the_computed_partition():
    config = RunConfig(num_clusters=2, clients_per_cluster=3)
    one = client_data.load_client_data(config, 0).nbytes
    cache = client_data._PartitionCache(max_bytes=int(2.5 * one))  # room for two digits partitions
    for partition_id in range(6):
        cached = cache.get(config, partition_id)
        computed = client_data.load_client_data(config, partition_id)
        assert np.array_equal(cached.train_x, computed.train_x) and np.array_equal(cached.test_y, computed.test_y)
        assert cache.bytes <= cache.max_bytes and len(cache.entries) <= 2
    assert cache.get(config, 5) is cache.get(config, 5)  # the most recent one is kept


def test_averaging_a_stream_of_models_equals_averaging_a_list():
    rng = np.random.default_rng(5)
    models = [[rng.standard_normal((3, 2)).astype(np.float32), np.array(4, dtype=np.int64)] for _ in range(4)]
    counts = [10, 3, 7, 1]
    listed = agg.weighted_average(models, counts)
    streamed = agg.weighted_average((list(m) for m in models), counts)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(listed, streamed, strict=True))


def test_a_streamed_average_in_any_arrival_order_equals_the_listed_one():
    rng = np.random.default_rng(11)
    models = {k: [rng.standard_normal((4, 3)).astype(np.float32), np.array(7 + k, dtype=np.int64)] for k in range(6)}
    counts = {0: 60, 1: 54, 2: 61, 3: 7, 4: 600, 5: 33}
    listed = agg.weighted_average([models[k] for k in range(6)], [counts[k] for k in range(6)])
    stream = agg.StreamingAverage({k: float(n) for k, n in counts.items()})
    for key in [4, 1, 5, 0, 3, 2]:  # early arrivals wait for their turn
        stream.add(key, models[key], counts[key])
    assert stream.largest_backlog == 4  # 4, 1, 5 waited for 0; then 3 waited for 2
    streamed = stream.result(counts)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(listed, streamed, strict=True))


def test_a_streamed_average_without_the_clients_that_failed_is_their_average():
    rng = np.random.default_rng(12)
    models = {k: [rng.standard_normal((4, 3)).astype(np.float32)] for k in range(5)}
    counts = {k: float(10 + 5 * k) for k in range(5)}
    stream = agg.StreamingAverage(counts)
    stream.add(3, models[3], counts[3])
    stream.withdraw(1)  # failed: 3 still waits for 0 and 2
    stream.add(0, models[0], counts[0])
    stream.add(4, models[4], counts[4])
    answered = {k: counts[k] for k in (0, 3, 4)}  # 2 never came back and was never withdrawn
    streamed = stream.result(answered)
    expected = agg.weighted_average([models[k] for k in answered], list(answered.values()))
    np.testing.assert_allclose(streamed[0], expected[0], rtol=1e-6, atol=1e-7)
    with pytest.raises(FedcondError, match="disagree"):
        agg.StreamingAverage(counts).result({0: 10.0})  # a reply the stream never saw


def benchmark_module():
    """benchmarks/overhead.py, which is a script rather than part of the package."""
    return load_script("benchmarks/overhead.py")


def test_the_bare_loop_averages_and_shuffles_as_the_framework_does():
    from fedcond.federation.client import FedcondClient

    bench = benchmark_module()
    rng = np.random.default_rng(7)
    models = [[rng.standard_normal((5, 3)).astype(np.float32), np.array(9, dtype=np.int64)] for _ in range(5)]
    counts = [60, 54, 61, 7, 600]
    ours = bench.fedavg(iter(models), counts)
    for a, b in zip(ours, agg.weighted_average(models, counts), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    client = FedcondClient.__new__(FedcondClient)  # only round_seed's inputs are needed
    client.run_config = RunConfig(seed=3)
    client.data = client_data.ClientData(11, 0, 10, *(np.zeros(1),) * 4)
    assert bench.round_seed(3, 4, 11) == client.round_seed({"server-round": 4})


def test_the_sampled_bare_loop_trains_and_scores_the_clients_fedcond_does(tmp_path):
    """The yardstick of the sampled target: each round's accuracy of the bare loop equals fedcond's
    FedAvg under the same sample (trained clients, and the clients that score each round's model)."""
    import csv

    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.tools.in_process import run_in_process

    settings = {"dataset": "digits", "num-clusters": 2, "clients-per-cluster": 3, "num-server-rounds": 4,
                "clients-per-round": 2, "evaluate-every": 2, "data-fraction": 1.0}  # fmt: skip
    bare = benchmark_module().bare_loop(settings, threads=1)
    config = run_config({**default_config(), **settings, "method": "fedavg", "results-dir": str(tmp_path),
                         "verbose": False})  # fmt: skip
    recorder, _ = run_in_process(config)
    with (recorder.folder / "history.csv").open() as handle:
        ours = [float(row["accuracy"]) for row in csv.DictReader(handle)]
    assert [round(r["accuracy"], 6) for r in bare["rounds"]] == [round(a, 6) for a in ours]


def test_the_benchmark_table_reports_ratios_and_per_message_overhead():
    bench = benchmark_module()

    def result(part, whole, rounds, rss):
        return bench.PartResult(part, "quick", 4, len(rounds), whole, rounds, 1.0, 0.5, rss, rss, 0.9)

    table = bench.table([
        result("bare", 10.0, [3.0, 2.0, 2.0], 2**30),
        result("flwr-run", 20.0, [5.0, 2.8, 2.8], 2 * 2**30),
        result("floor", 8.0, [1.0, 0.4, 0.4], 2**29),
    ])  # fmt: skip
    assert "whole command (s)" in table and "2.00" in table  # 20 s / 10 s
    # Rounds 2..n-1 (the last also sends the closing evaluations); one message per client per round.
    assert "flwr-run overhead per message over the bare loop: 200.0 ms" in table  # (2.8 - 2.0) / 4 messages
    assert "Flower's floor per message: 100.0 ms" in table
    # Start-up: the time outside the rounds less the shut-down (round 1's line may come a round late).
    assert bench.split_outside(20.0, [5.0, 2.8], last_end=11.8) == (4.0, 8.2)


def test_an_actor_gets_as_many_torch_threads_as_ray_gave_it_cpus(monkeypatch):
    """OMP_NUM_THREADS inherited from the user's shell (Ray then leaves it alone) must not give each
    of two one-CPU actors two threads: that made every round 4x slower on 2 cores."""
    import sys
    import types

    from fedcond.federation.client_app import threads_for_this_actor

    class Runtime:
        def get_assigned_resources(self) -> dict[str, float]:
            return {"CPU": 1.0}

    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=Runtime)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads_for_this_actor.cache_clear()
        monkeypatch.setitem(sys.modules, "ray", None)  # a deployed ClientApp: no Ray, threads untouched
        threads_for_this_actor()
        assert torch.get_num_threads() == 2
        threads_for_this_actor.cache_clear()
        monkeypatch.setitem(sys.modules, "ray", fake_ray)
        threads_for_this_actor()
        assert torch.get_num_threads() == 1
    finally:
        threads_for_this_actor.cache_clear()
        torch.set_num_threads(before)


def test_the_cuda_check_repeats_a_recorded_run_to_its_accuracy_and_refuses_what_it_cannot_repeat(tmp_path):
    """benchmarks/cuda_methods.py --rerun: a run repeated from its run.json in this process (no Ray)
    gives the accuracy it recorded (same device: bit-identical), so a GPU's difference is the GPU's."""
    import json

    check = load_script("benchmarks/cuda_methods.py")
    first = check.run_once({**check.SMOKE, "method": "fedavg", "num-server-rounds": 1}, tmp_path, "first")
    again = check.run_once(check.rerun_settings(tmp_path / "first"), tmp_path / "again", "first")
    assert again["accuracy"] == first["accuracy"]
    assert (again["gpu_mib"] > 0) == torch.cuda.is_available()  # it trained where fedcond picked
    recorded = json.loads((tmp_path / "first" / "run.json").read_text())
    recorded["config"].update(method="conditional", normalisation="federated")
    (tmp_path / "first" / "run.json").write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match="normalisation=federated needs SecAgg"):
        check.rerun_settings(tmp_path / "first")
    with pytest.raises(SystemExit, match=r"holds no run\.json"):
        check.rerun_settings(tmp_path)

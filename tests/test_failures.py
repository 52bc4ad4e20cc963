"""The failure policy, membership and time limits, without Ray: strategies driven by fake nodes.

The fake nodes answer as Flower's proxies do (or raise, as a failed client's proxy does), and
Flower's own ``fit_clients`` / ``evaluate_clients`` run the instructions, so the strategies see
exactly the results and failures a real round gives them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flwr.common import (
    Code,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetPropertiesIns,
    GetPropertiesRes,
    Message,
    MessageTypeLegacy,
    Parameters,
    Scalar,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common.recorddict_compat import getpropertiesres_to_recorddict, recorddict_to_getpropertiesres
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.server import evaluate_clients, fit_clients

from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.federation.exchange import classify_failure, failure_reason
from fedcond.federation.membership import Membership
from fedcond.federation.messages import (
    ACCURACY,
    CHOICE,
    ERROR,
    EVALUATE_FIRST,
    EVALUATED_ACCURACY,
    EVALUATED_EXAMPLES,
    EVALUATED_LOSS,
    PARTITION_ID,
    TRAIN_LOSS,
)
from fedcond.federation.methods import get_method, run_config
from fedcond.federation.participation import EVALUATE, FAILED, TIMED_OUT, RoundParticipation, required_answers
from fedcond.federation.server_method import EMPTY, StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model.training import check_not_diverged
from fedcond.records.history import RunRecorder, results_folder
from tests.method_settings import peer_to_peer_methods

Reply = Callable[[int], FitRes]


def layer_model(value: float) -> list[np.ndarray]:
    return [np.full((2, 3), value, dtype=np.float32), np.full(4, value, dtype=np.float32)]


class FakeNode(ClientProxy):
    """A node holding ``partition`` (of ``cluster``, which only IFCA's choice reflects: no reply says
    it); fits return ``layer_model(partition + 1)`` with ``10 * (partition + 1)`` samples unless
    ``fit_error`` makes the call raise, as Flower's proxy of a failed client does."""

    def __init__(self, cid: str, partition: int, cluster: int, fit_error: str = "") -> None:
        super().__init__(cid)
        self.partition, self.cluster, self.fit_error = partition, cluster, fit_error
        self.identity_questions = 0
        self.train_loss = 1.0

    def identity(self) -> dict[str, int]:
        return {PARTITION_ID: self.partition}

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        self.identity_questions += 1
        # Through the records Flower's grid proxy decodes (its properties arrive as a ConfigRecord, not a dict).
        answer = GetPropertiesRes(Status(Code.OK, ""), self.identity())
        return recorddict_to_getpropertiesres(getpropertiesres_to_recorddict(answer))

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        if self.fit_error:
            raise ValueError(self.fit_error)
        metrics: dict[str, Scalar] = {TRAIN_LOSS: self.train_loss, CHOICE: self.cluster}
        if ins.config.get(EVALUATE_FIRST):  # evaluate-in-fit: the last round's model, scored 0.1 x (partition + 1)
            metrics |= {EVALUATED_LOSS: 0.5, EVALUATED_EXAMPLES: 20, EVALUATED_ACCURACY: 0.1 * (self.partition + 1)}
        return FitRes(
            Status(Code.OK, ""), ndarrays_to_parameters(layer_model(self.partition + 1)), self.samples, metrics
        )

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        return EvaluateRes(Status(Code.OK, ""), 0.5, 20, {ACCURACY: 0.75})

    @property
    def samples(self) -> int:
        return 10 * (self.partition + 1)

    def get_parameters(self, *args: object) -> None:
        raise NotImplementedError

    def reconnect(self, *args: object) -> None:
        raise NotImplementedError


def federation(nodes: list[FakeNode]) -> SimpleClientManager:
    manager = SimpleClientManager()
    for node in nodes:
        manager.register(node)
    return manager


def two_by_two(**errors: str) -> list[FakeNode]:
    """2 clusters x 2 clients: partitions 0, 1 in cluster 0 and 2, 3 in cluster 1; ``p1="why"`` fails partition 1."""
    return [FakeNode(f"node-{p}", p, p // 2, errors.get(f"p{p}", "")) for p in range(4)]


def strategy_for(method: str, tmp_path: Path | None = None, **settings: object) -> FedcondStrategy:
    mapping = {"method": method, "num-clusters": 2, "clients-per-cluster": 2, "verbose": False, **settings}
    config = run_config(mapping)
    recorder = (
        RunRecorder(results_folder(config.replace(results_dir=str(tmp_path))), config, {}, 2) if tmp_path else None
    )
    strategy_class = get_method(method).strategy
    assert strategy_class is not None
    inputs = StrategyInputs(config, 10, False, recorder, scenario=scenario_for(config))
    strategy = FedcondStrategy(strategy_class(inputs))
    if hasattr(strategy.method, "trained"):  # Gossip's and DAC's mask of trained arrays: here FakeNode's replies
        strategy.method.trained = [True] * len(layer_model(0.0))
    return strategy


def fit_round(
    strategy: FedcondStrategy, manager: SimpleClientManager, server_round: int = 2
) -> tuple[Parameters | None, dict[str, Scalar]]:
    """configure_fit, Flower's fit_clients, aggregate_fit: what Flower's server does in a round's fit."""
    instructions = strategy.configure_fit(server_round, EMPTY, manager)
    results, failures = fit_clients(instructions, max_workers=None, timeout=None, group_id=server_round)
    return strategy.aggregate_fit(server_round, results, failures)


def test_required_answers_round_up_and_keep_their_floor():
    assert required_answers(0.8, 5) == 4  # 0.8 x 5 is 4.000000000000001 in floating point
    assert required_answers(0.8, 4) == 4 and required_answers(0.75, 4) == 3 and required_answers(0.8, 15) == 12
    assert required_answers(0.0, 4) == 1  # at least one client, always
    assert required_answers(0.0, 6, floor=3) == 3 and required_answers(1.0, 2, floor=3) == 2


def test_a_client_counts_once_by_its_first_failure():
    participation = RoundParticipation(3, range(5))
    participation.fail("fit", 1, "boom\n  on two lines")
    participation.fail("evaluate", 1, "later")  # same client: still one failure in the counts
    participation.fail("fit", 2, "no answer", TIMED_OUT)
    participation.fail("evaluate", 4, "node left")
    assert participation.counts() == {
        "clients_asked": 5, "clients_answered": 2, "clients_failed": 2, "clients_timed_out": 1,
    }  # fmt: skip
    assert [f.reason for f in participation.new_failures()] == ["boom on two lines", "later", "no answer", "node left"]
    assert participation.new_failures() == []  # each is reported once
    participation.check(0.4)
    with pytest.raises(FedcondError) as error:
        participation.check(0.5, stage="evaluate")
    assert str(error.value) == (
        "round 3: 2 of 5 clients answered in evaluate, fewer than the 3 that min-answered-fraction=0.5 require; "
        "first: round 3: partition 1 failed in fit: boom on two lines; every failure is listed in run.json: "
        "fix those clients or lower min-answered-fraction"
    )


def test_fedavg_averages_the_survivors_with_renormalised_weights(tmp_path):
    strategy = strategy_for("fedavg", tmp_path, **{"min-answered-fraction": 0.75})
    crashed = "Message contains an Error (reason: <class 'RuntimeError'>:<'client crashed'>). It originated ..."
    nodes = two_by_two(p1=crashed)
    manager = federation(nodes)
    strategy.initialize_parameters(manager)
    parameters, _ = fit_round(strategy, manager)
    # Partitions 0, 2, 3 answered: models 1, 3, 4 with 10, 30, 40 samples; partition 1 is left out.
    expected = (10 * 1 + 30 * 3 + 40 * 4) / (10 + 30 + 40)
    for layer in parameters_to_ndarrays(parameters):
        np.testing.assert_allclose(layer, expected, rtol=1e-6)
    assert strategy.participation.counts()["clients_failed"] == 1
    (folder,) = tmp_path.iterdir()
    failures = json.loads((folder / "run.json").read_text())["failures"]
    assert failures == [
        {"round": 2, "stage": "fit", "partition-id": 1, "outcome": "failed", "reason": "RuntimeError: client crashed"}
    ]


def test_a_reported_error_and_a_failed_status_are_failures_too():
    strategy = strategy_for("fedavg", **{"min-answered-fraction": 0.5})
    manager = federation(two_by_two())
    strategy.initialize_parameters(manager)
    instructions = strategy.configure_fit(1, EMPTY, manager)
    results, failures = fit_clients(instructions, max_workers=None, timeout=None, group_id=1)
    by_partition = {proxy.partition_id: (proxy, res) for proxy, res in results}  # type: ignore[attr-defined]
    by_partition[0][1].metrics[ERROR] = "training loss became nan; lower learning-rate"
    proxy, res = by_partition.pop(3)
    failures.append((proxy, FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "no fit here"), res.parameters, 0, {})))
    strategy.aggregate_fit(1, [pair for p, pair in by_partition.items() if p != 3], failures)
    reasons = {f.partition_id: f.reason for f in strategy.participation.failures}
    assert reasons == {0: "training loss became nan; lower learning-rate", 3: "no fit here"}


def test_below_the_threshold_the_round_stops_the_run_before_aggregating():
    strategy = strategy_for("fedavg")  # default min-answered-fraction 0.8: 4 of 4 needed
    manager = federation(two_by_two(p2="the client crashed"))
    strategy.initialize_parameters(manager)
    with pytest.raises(FedcondError, match=r"round 2: 3 of 4 clients answered in fit, fewer than the 4") as error:
        fit_round(strategy, manager)
    assert "partition 2 failed in fit: the client crashed" in str(error.value) and "\n" not in str(error.value)


class SilentNodeGrid:
    """What Flower's ``GridClientProxy`` sends through, answering as the SuperLink does for a node
    that stopped sending heartbeats: the identity question before round 1 (it was alive then) with
    its partition id, every later message with the SuperLink's own "Node Unavailable" error reply."""

    def __init__(self, partition: int) -> None:
        self.partition = partition

    def send_and_receive(self, messages: list[Message], *, timeout: float | None = None) -> list[Message]:
        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        (message,) = messages
        if message.metadata.message_type == MessageTypeLegacy.GET_PROPERTIES:
            answer = GetPropertiesRes(Status(Code.OK, ""), {PARTITION_ID: self.partition})
            return [Message(getpropertiesres_to_recorddict(answer), reply_to=message)]
        return [create_message_error_unavailable_res_message(message.metadata, "node_unavail")]


class Terminal(io.StringIO):
    """The ServerApp's standard error; ``heard`` is set once a node's lost heartbeat is said."""

    def __init__(self) -> None:
        super().__init__()
        self.heard = threading.Event()

    def write(self, text: str) -> int:
        if "stopped sending heartbeats" in text:
            self.heard.set()
        return super().write(text)


class SlowNode(FakeNode):
    """A node whose fit answers only after the silent node's line was said (or 30 s): whether it had
    been said by then, ``heard_first`` records."""

    terminal: Terminal

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        self.heard_first = self.terminal.heard.wait(timeout=30)
        return super().fit(ins, timeout, group_id)


def test_a_node_silent_past_its_heartbeats_is_named_the_moment_flower_answers_for_it(tmp_path, monkeypatch):
    """Flower's grid proxy and the SuperLink's own error reply for a node that stopped sending
    heartbeats (its SuperNode killed: no goodbye): the ServerApp says which partition and node at
    once, while the round's other clients are still training, whatever ``verbose`` says."""
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.supercore.task_identity import TaskIdentity

    # What Flower sets in a ServerApp's process, and its messages carry.
    for attribute, value in {"_run_id": 1, "_node_id": 0, "_task_id": 7}.items():
        monkeypatch.setattr(TaskIdentity, attribute, value)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    SlowNode.terminal = terminal
    silent = GridClientProxy(node_id=4242, grid=SilentNodeGrid(2), run_id=1)  # type: ignore[arg-type]
    others = [SlowNode(f"node-{p}", p, p // 2) for p in (0, 1, 3)]
    strategy = strategy_for("fedavg", tmp_path, **{"min-answered-fraction": 0.5})  # verbose=false
    manager = federation([*others, silent])  # type: ignore[list-item]
    strategy.initialize_parameters(manager)
    fit_round(strategy, manager, 2)
    assert all(node.heard_first for node in others)  # said before the round's other replies came
    (line,) = terminal.getvalue().splitlines()
    assert line == (
        "fedcond: round 2: partition 2 (node 4242) stopped sending heartbeats: the SuperLink gave up on it, so its "
        "fit failed (node left); the run goes on while min-answered-fraction allows, and the node rejoins when its "
        "SuperNode starts again with its key and --node-config partition-id=2"
    )
    assert [(f.partition_id, f.reason) for f in strategy.participation.failures] == [(2, "node left")]


def test_a_node_that_left_fails_before_it_is_asked_and_counts_once(tmp_path):
    # Both messages of a round (evaluate-in-fit asks the training clients to evaluate in the next fit).
    strategy = strategy_for("fedavg", tmp_path, **{"min-answered-fraction": 0.5, "evaluate-in-fit": False})
    nodes = two_by_two()
    manager = federation(nodes)
    strategy.initialize_parameters(manager)
    manager.unregister(nodes[3])
    instructions = strategy.configure_fit(1, EMPTY, manager)
    assert sorted(proxy.partition_id for proxy, _ in instructions) == [0, 1, 2]  # type: ignore[attr-defined]
    results, failures = fit_clients(instructions, max_workers=None, timeout=None, group_id=1)
    strategy.aggregate_fit(1, results, failures)
    evaluations = strategy.configure_evaluate(1, EMPTY, manager)
    results, failures = evaluate_clients(evaluations, max_workers=None, timeout=None, group_id=1)
    strategy.aggregate_evaluate(1, results, failures)
    (record,) = strategy.inputs.recorder.records  # type: ignore[union-attr]
    assert (record.clients_asked, record.clients_answered, record.clients_failed, record.clients_timed_out) == (
        4, 3, 1, 0,
    )  # fmt: skip
    (folder,) = tmp_path.iterdir()
    info = json.loads((folder / "run.json").read_text())
    assert [(f["stage"], f["partition-id"], f["reason"]) for f in info["failures"]] == [
        ("fit", 3, "node left"), ("evaluate", 3, "node left"),
    ]  # fmt: skip
    assert info["membership"][0] | {"node-id": None} == {
        "round": 1, "event": "left", "partition-id": 3, "node-id": None, "reason": "node left",
    }  # fmt: skip
    # Only the clients that answered evaluate make the round's numbers.
    assert record.accuracy == pytest.approx(0.75) and record.cluster_accuracy == {0: 0.75, 1: 0.75}


LEAVES, CRASHES = "leaves", "crashes"


@pytest.mark.parametrize("resumed", [False, True], ids=["", "resumed"])
@pytest.mark.parametrize("how", [LEAVES, CRASHES])
def test_a_client_lost_in_round_2_has_not_evaluated_round_1_whose_model_its_fit_was_to_score(tmp_path, how, resumed):
    """One message a round: round 1's model is scored in round 2's fit replies. A client lost there
    never scored it, so round 1's record counts it as failed, names it, and averages the others."""
    strategy = strategy_for("fedavg", tmp_path / "run", **{"min-answered-fraction": 0.5})
    nodes = two_by_two()
    manager = federation(nodes)
    strategy.initialize_parameters(manager)
    fit_round(strategy, manager, 1)
    strategy.end_round(1)  # evaluate-in-fit, no held-out clients: round 1's evaluation step asked no one
    assert strategy.inputs.recorder.records == []  # type: ignore[union-attr]
    if resumed:  # the checkpoint holds round 1's pending record and who took part in it
        models, values = strategy.state()
        recorder = strategy.inputs.recorder
        strategy = strategy_for("fedavg", None, **{"min-answered-fraction": 0.5})
        strategy.inputs = dataclasses.replace(strategy.inputs, recorder=recorder)
        strategy.tracker.recorder = recorder
        strategy.initialize_parameters(manager)
        strategy.load_state(models, json.loads(json.dumps(values)))
    if how == LEAVES:
        manager.unregister(nodes[3])
    else:
        nodes[3].fit_error = "the client crashed"
    fit_round(strategy, manager, 2)
    (record,) = strategy.inputs.recorder.records  # type: ignore[union-attr]
    assert (record.round, record.clients_asked, record.clients_answered, record.clients_failed) == (1, 4, 3, 1)
    # Partitions 0-2 (10, 20 and 30 samples' worth of nothing: each reports 20 examples) scored it.
    assert record.accuracy == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    assert record.cluster_accuracy == pytest.approx({0: 0.15, 1: 0.3})
    cause = "node left" if how == LEAVES else "the client crashed"
    (folder,) = (tmp_path / "run").iterdir()
    failures = json.loads((folder / "run.json").read_text())["failures"]
    assert {"round": 1, "stage": "evaluate", "partition-id": 3, "outcome": "failed",
            "reason": f"its evaluation was to come with round 2's fit, which failed: {cause}"} in failures  # fmt: skip
    assert sorted((f["round"], f["stage"]) for f in failures if f["partition-id"] == 3) == [(1, "evaluate"), (2, "fit")]


# One method of each server family that FakeNode can answer (a model back): CFL, descriptor clustering and
# SCAFFOLD need their own clients' replies (an update tree, a descriptor, named parts).
@pytest.mark.parametrize("method", ["fedavg", "oracle", "ifca", "dac"])
def test_a_training_loss_that_explodes_stops_the_run_in_one_line_naming_the_learning_rate(method):
    """Finite but far past chance (ln 10 = 2.3 on digits): the run stops rather than sit at chance
    to the end and say "finished"."""
    strategy = strategy_for(method, **{"learning-rate": 0.05})
    nodes = two_by_two()
    manager = federation(nodes)
    strategy.initialize_parameters(manager)
    for node in nodes:
        node.train_loss = 200.0  # under 100 x ln 10 = 230: a bad round, not a diverged one
    fit_round(strategy, manager, 1)
    nodes[0].train_loss = 7e12
    with pytest.raises(FedcondError) as error:
        fit_round(strategy, manager, 2)
    assert str(error.value) == (
        "round 2: the mean training loss reached 7e+11, over 230 (100 times chance's): training diverged; "
        "lower learning-rate (now 0.05)"
    )


def test_pfedhns_divergence_names_its_own_server_step_first():
    assert strategy_for("pfedhn", **{"learning-rate": 0.05}).method.divergence_fix() == (
        "lower pfedhn-lr (now 0.002) or set pfedhn-step=round-mean, or learning-rate (now 0.05)"
    )
    assert strategy_for("pfedhn", **{"pfedhn-step": "round-mean", "pfedhn-lr": 1.0}).method.divergence_fix() == (
        "lower pfedhn-lr (now 1), or learning-rate (now 0.01)"
    )


def test_a_regression_tasks_loss_diverges_against_its_first_round_and_nan_says_nothing():
    check_not_diverged(3, 9.9e4, 1, 10.0, "lower learning-rate")  # under 10,000 x round 1's
    check_not_diverged(3, float("nan"), 10, float("nan"), "lower learning-rate")  # withheld under DP-SGD
    with pytest.raises(FedcondError, match=r"^round 3: the mean training loss reached 1\.01e\+05, over 1e\+05 \(10000"):
        check_not_diverged(3, 1.01e5, 1, 10.0, "lower learning-rate")


def test_a_federation_short_of_nodes_names_the_partitions_without_one():
    """A deployment operator learns which node to start (the nodes are asked which partition each holds)."""
    strategy = strategy_for("fedavg", **{"node-timeout": 1})
    nodes = [node for node in two_by_two() if node.partition != 2]
    with pytest.raises(FedcondError) as error:
        strategy.initialize_parameters(federation(nodes))
    assert str(error.value) == (
        "the federation has 3 nodes but num-clusters x (clients-per-cluster) = 2 x 2 = 4 (waited 1 s); partition-id 2 "
        'has no node: start a SuperNode with --node-config "partition-id=2 num-partitions=4 ..." for each (a '
        'simulation: --federation-config "num-supernodes=4"), or submit with settings for the nodes there are'
    )


def test_too_few_connected_nodes_stop_the_round_before_anything_is_sent():
    strategy = strategy_for("fedavg")  # 0.8 of 4: all 4 needed
    nodes = two_by_two()
    manager = federation(nodes)
    strategy.initialize_parameters(manager)
    manager.unregister(nodes[0])
    with pytest.raises(FedcondError) as error:
        strategy.configure_fit(1, EMPTY, manager)
    assert str(error.value).startswith(
        "round 1: 3 of 4 clients are left to ask in fit, fewer than the 4 that min-answered-fraction=0.8 require; "
        "first: round 1: partition 0 failed in fit: node left;"
    )


def test_oracle_keeps_a_silent_clusters_model_and_needs_one_answer_per_model():
    strategy = strategy_for("oracle", **{"min-answered-fraction": 0.0})
    manager = federation(two_by_two(p2="crashed", p3="crashed"))  # all of cluster 1
    strategy.initialize_parameters(manager)
    assert strategy.method.assignment == {0: 0, 1: 0, 2: 1, 3: 1}  # type: ignore[attr-defined]
    silent = [np.copy(layer) for layer in strategy.method.models[1]]  # type: ignore[attr-defined]
    fit_round(strategy, manager)
    for layer, before in zip(strategy.method.models[1], silent, strict=True):  # type: ignore[attr-defined]
        np.testing.assert_array_equal(layer, before)
    np.testing.assert_allclose(strategy.method.models[0][0], (10 * 1 + 20 * 2) / 30)  # type: ignore[attr-defined]
    # One answer for two models: too few, whatever min-answered-fraction allows.
    strategy = strategy_for("oracle", **{"min-answered-fraction": 0.0})
    manager = federation(two_by_two(p1="crashed", p2="crashed", p3="crashed"))
    strategy.initialize_parameters(manager)
    floor = r"1 of 4 clients answered in fit, fewer than the 2 that min-answered-fraction=0 and one per cluster model"
    with pytest.raises(FedcondError, match=floor):
        fit_round(strategy, manager)


def test_ifca_sends_every_model_to_a_client_that_has_not_chosen_yet():
    strategy = strategy_for("ifca", **{"min-answered-fraction": 0.5})
    manager = federation(two_by_two(p1="crashed in round 1"))
    strategy.initialize_parameters(manager)
    fit_round(strategy, manager, server_round=1)
    assert strategy.method.assignment == {0: 0, 2: 1, 3: 1}  # type: ignore[attr-defined]
    one_model = len(strategy.method.instruction(EVALUATE, 0, EMPTY, {})[0].tensors)
    assert len(strategy.method.instruction(EVALUATE, 1, EMPTY, {})[0].tensors) == 2 * one_model  # all K = 2 models


def test_ifca_client_evaluates_the_model_it_would_choose_when_given_all():
    from fedcond.model.networks import get_weights
    from tests.test_methods import client_of

    client = client_of("ifca")
    good = get_weights(client.model)
    broken = [np.zeros_like(w) for w in good]
    broken[-1] = np.array([50.0] + [0.0] * (len(broken[-1]) - 1), dtype=np.float32)  # always predicts class 0
    chosen = broken if np.all(client.data.train_y == 0) else good
    assert client.evaluate([*broken, *good], {"server-round": 1}) == client.evaluate(chosen, {"server-round": 1})


@pytest.mark.parametrize("method", peer_to_peer_methods())
def test_peers_that_did_not_answer_keep_their_models_and_are_skipped(method):
    strategy = strategy_for(method, **{"min-answered-fraction": 0.5, "dac-neighbours": 3})
    manager = federation(two_by_two(p1="crashed"))
    strategy.initialize_parameters(manager)
    start = [np.copy(layer) for layer in strategy.method.models[1]]  # type: ignore[attr-defined]
    fit_round(strategy, manager)
    models = strategy.method.models  # type: ignore[attr-defined]
    for layer, initial in zip(models[1], start, strict=True):
        np.testing.assert_array_equal(layer, initial)  # absent: untouched
    survivors = [models[p][0][0, 0] for p in (0, 2, 3)]
    # Only the survivors' models (1, 3, 4) were mixed: their values stay among themselves, their mean kept.
    assert all(1.0 <= value <= 4.0 for value in survivors) and sum(survivors) == pytest.approx(8.0)


def test_membership_maps_a_rejoining_node_back_and_refuses_a_second_claim(tmp_path, capsys):
    config = run_config({"num-clusters": 2, "clients-per-cluster": 2, "results-dir": str(tmp_path)})
    recorder = RunRecorder(results_folder(config), config, {}, 2)
    nodes = two_by_two()
    manager = federation(nodes)
    membership = Membership(4, None, recorder, verbose=False)
    membership.start(nodes)
    assert {p: proxy.cid for p, proxy in membership.node_of.items()} == {p: f"node-{p}" for p in range(4)}
    # Partition 2's SuperNode restarts: a new node id, the same partition.
    manager.unregister(nodes[2])
    restarted = FakeNode("node-2-again", 2, 1)
    manager.register(restarted)
    connected = membership.refresh(manager, 3)
    assert connected[2] is restarted and len(connected) == 4
    # A second node claiming partition 0 while node-0 is connected: refused, never instructed, said once.
    second = FakeNode("intruder", 0, 0)
    manager.register(second)
    assert membership.refresh(manager, 4)[0] is nodes[0]
    assert membership.refresh(manager, 5)[0] is nodes[0] and second.identity_questions == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "fedcond: round 4: partition 0 refused: partition-id 0 is held by a connected node, so this node is never "
        "instructed; give each SuperNode its own --node-config partition-id=..."
    ]
    # When partition 0's node leaves, the waiting node takes its place.
    manager.unregister(nodes[0])
    assert membership.refresh(manager, 6)[0] is second
    events = json.loads((recorder.folder / "run.json").read_text())["membership"]
    assert [(e["round"], e["event"], e["partition-id"], e["node-id"]) for e in events] == [
        (3, "left", 2, "node-2"), (3, "joined", 2, "node-2-again"), (4, "refused", 0, "intruder"),
        (6, "left", 0, "node-0"), (6, "joined", 0, "intruder"),
    ]  # fmt: skip


def test_two_nodes_with_one_partition_at_the_start_stop_the_run():
    nodes = [FakeNode("a", 0, 0), FakeNode("b", 1, 0), FakeNode("c", 1, 1), FakeNode("d", 3, 1)]
    with pytest.raises(FedcondError) as error:
        Membership(4, None).start(nodes)
    assert str(error.value) == (
        "partition-id 1 is claimed by 2 nodes and 1 partition(s) by none; give each SuperNode its own "
        "--node-config partition-id=... (0..3)"
    )
    with pytest.raises(FedcondError, match=r"a node reports partition-id 7, outside this run's 0\.\.3"):
        Membership(4, None).start([FakeNode("a", 7, 0)])


def test_why_a_client_did_not_answer_is_read_from_flowers_error_replies():
    # Flower's own reasons (importing them costs seconds, so the strategy matches their key phrases).
    from flwr.server.superlink.linkstate.utils import (
        MESSAGE_UNAVAILABLE_ERROR_REASON,
        NODE_UNAVAILABLE_ERROR_REASON,
        REPLY_MESSAGE_UNAVAILABLE_ERROR_REASON,
    )

    def proxy_error(reason: str) -> ValueError:  # as flwr.server.compat.grid_client_proxy raises it
        return ValueError(
            f"Message contains an Error (reason: {reason}). It originated during client-side execution of a message."
        )

    expired = proxy_error(MESSAGE_UNAVAILABLE_ERROR_REASON)
    assert classify_failure(expired, 30.2, 30.0) == (TIMED_OUT, "no answer within round-timeout=30 s")
    assert classify_failure(proxy_error(REPLY_MESSAGE_UNAVAILABLE_ERROR_REASON), 31, 30.0)[0] == TIMED_OUT
    assert classify_failure(expired, 2.0, 30.0) == (FAILED, "node left")  # deleted with its node, early
    assert classify_failure(proxy_error(NODE_UNAVAILABLE_ERROR_REASON), 2.0, None) == (FAILED, "node left")
    crashed = proxy_error(
        "<class 'flwr.clientapp.client_app.ClientAppException'>:<'\nException ClientAppException occurred. "
        "Message: CUDA out of memory'>"
    )
    assert classify_failure(crashed, 1.0, 30.0) == (FAILED, "CUDA out of memory")
    wrapped = RuntimeError(
        "ClientApp raised an exception\nTraceback (most recent call last):\n  File 'x.py'\n"
        "fedcond.errors.FedcondError: training loss became nan; lower learning-rate (now 1000000.0)"
    )
    assert failure_reason(wrapped) == "training loss became nan; lower learning-rate (now 1000000.0)"
    # A SuperNode's ClientApp that raised (deployment words it so): a FedcondError's message names the fix.
    deployed = proxy_error("<class 'fedcond.errors.FedcondError'>:<'this node was started for 4 partitions'>")
    assert failure_reason(deployed) == "this node was started for 4 partitions"
    assert failure_reason(proxy_error("<class 'ZeroDivisionError'>:<'division by zero'>")) == (
        "ZeroDivisionError: division by zero"
    )


def test_flowers_per_round_skipping_evaluation_line_is_not_printed():
    """fedcond's training clients evaluate in the next round's fit, so Flower's line for a round without
    evaluate messages would print every round; the filter drops exactly Flower's own wording."""
    import inspect
    import logging

    import flwr.server.server
    from flwr.common.logger import FLOWER_LOGGER

    from fedcond.federation.server_app import NO_EVALUATION_LINE

    assert f'"{NO_EVALUATION_LINE}"' in inspect.getsource(flwr.server.server)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    try:
        FLOWER_LOGGER.info(NO_EVALUATION_LINE)
        FLOWER_LOGGER.info("configure_fit: strategy sampled 4 clients (out of 4)")
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    assert seen == ["configure_fit: strategy sampled 4 clients (out of 4)"]

"""SCAFFOLD: FedAvg whose clients correct each local step by control variates (``clients/scaffold.py``,
``strategies/scaffold.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fedcond.clients.scaffold import ControlCorrection, step_weight, updated_control
from fedcond.strategies.scaffold import ScaffoldStrategy
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from torch import nn

from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.federation.messages import PAYLOAD_PARTS, TRAIN_LOSS, pack_parts, unpack_parts
from fedcond.federation.methods import run_config
from fedcond.federation.participation import FIT
from fedcond.federation.server_method import StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model.training import MomentumSGD
from fedcond.tools.experiment import read_history
from fedcond.tools.simulation import simulate


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_control_update_recovers_a_constant_task_gradient_under_momentum(momentum):
    """Option II measures a client's mean gradient from its displacement alone: with a constant task
    gradient g, whatever c and c_i corrected the steps, the new c_i is g (momentum included)."""
    model = nn.Linear(3, 2)
    received = [value.detach().numpy().copy() for value in model.state_dict().values()]
    rng = np.random.default_rng(0)
    task_gradient = [rng.normal(size=array.shape).astype(np.float32) for array in received]
    server = [rng.normal(size=array.shape).astype(np.float32) for array in received]
    own = [rng.normal(size=array.shape).astype(np.float32) for array in received]
    correction = ControlCorrection(model, server, own)
    optimiser = MomentumSGD(model.parameters(), 0.01, momentum)
    for _ in range(25):
        for parameter, gradient in zip(model.parameters(), task_gradient, strict=True):
            parameter.grad = torch.from_numpy(gradient.copy())
        correction.add_gradient(model, with_penalty=False)
        optimiser.step()
    trained = [value.detach().numpy().copy() for value in model.state_dict().values()]
    new_own = updated_control(own, server, received, trained, correction.trained, correction.steps, 0.01, momentum)
    assert correction.steps == 25
    for estimate, gradient in zip(new_own, task_gradient, strict=True):
        np.testing.assert_allclose(estimate, gradient, rtol=1e-3, atol=1e-4)


def test_batch_norm_buffers_get_no_control_variate():
    """Running statistics move without a gradient step: their entries of c_i stay zero."""
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    received = [value.detach().numpy().copy() for value in model.state_dict().values()]
    zeros = [np.zeros_like(array, dtype=np.float32) for array in received]
    correction = ControlCorrection(model, zeros, zeros)
    model(torch.randn(8, 3))  # moves the running mean and variance
    with torch.no_grad():
        model[0].weight.add_(1.0)
    trained = [value.detach().numpy().copy() for value in model.state_dict().values()]
    new_own = updated_control(zeros, zeros, received, trained, correction.trained, 1, 0.01, 0.0)
    names = list(model.state_dict())
    assert names.index("1.running_mean") and not correction.trained[names.index("1.running_mean")]
    for name, control in zip(names, new_own, strict=True):
        assert np.any(control != 0) == (name == "0.weight"), name


def test_step_weight_is_the_plain_step_count_without_momentum_and_more_with_it():
    assert step_weight(10, 0.0) == 10
    assert step_weight(1, 0.9) == pytest.approx(1.0)  # the first heavy-ball step is a plain one
    assert step_weight(1000, 0.9) == pytest.approx(1000 / 0.1, rel=0.01)  # 1 / (1 - momentum) times, at length


def strategy(**settings: object) -> ScaffoldStrategy:
    config = run_config({"method": "scaffold", "num-clusters": 2, "clients-per-cluster": 2, **settings}).resolved()
    inputs = StrategyInputs(config, 10, False, None, scenario=scenario_for(config))
    return FedcondStrategy(ScaffoldStrategy(inputs)).method


def reply(parts: dict[str, list[np.ndarray]], samples: int) -> FitRes:
    arrays, names = pack_parts(parts)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), samples, {TRAIN_LOSS: 1.0, PAYLOAD_PARTS: names})


def test_the_server_moves_c_by_the_answered_share_of_the_mean_change_and_x_to_the_weighted_mean():
    server = strategy()
    shapes = [array.shape for array in server.initial]
    models = {pid: [np.full(shape, float(pid), np.float32) for shape in shapes] for pid in (0, 2)}
    changes = {pid: [np.full(shape, 4.0 * (pid + 1), np.float32) for shape in shapes] for pid in (0, 2)}
    # Two of the four training clients answer, with 10 and 30 samples.
    answered = [(pid, reply({"model": models[pid], "control-change": changes[pid]}, 10 + 10 * pid)) for pid in (0, 2)]
    new_global = server.combine(1, answered)
    assert all(np.allclose(c, 0.5 * (4.0 + 12.0) / 2) for c in server.control)  # 2/4 x the unweighted mean change
    assert all(np.allclose(x, (0 * 10 + 2 * 30) / 40) for x in parameters_to_ndarrays(new_global))
    parameters, settings = server.instruction(FIT, 1, new_global, {})
    sent = unpack_parts(list(parameters_to_ndarrays(parameters)), settings[PAYLOAD_PARTS], ("model", "control"))
    assert all(np.allclose(c, 4.0) for c in sent["control"]) and all(np.allclose(x, 1.5) for x in sent["model"])


def test_a_reply_without_its_named_parts_is_refused_in_one_line():
    server = strategy()
    plain = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(server.initial), 10, {TRAIN_LOSS: 1.0})
    with pytest.raises(FedcondError, match=r"no named parts .* where model, control-change were expected"):
        server.combine(1, [(0, plain)])


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"secure-aggregation": "secaggplus"}, "needs each client's control-variate change"),
        ({"client-dp": "client-side"}, "client-dp needs a server that averages one global model"),
    ],
)
def test_what_scaffold_cannot_serve_is_refused_before_anything_starts(settings, refusal):
    from fedcond.federation.checks import check_run

    with pytest.raises(FedcondError, match=refusal):
        check_run(run_config({"method": "scaffold", **settings}).resolved())


@pytest.mark.slow
def test_round_one_is_fedavgs_and_the_corrections_change_what_follows(tmp_path, one_thread):
    """Every control variate starts at zero, so round 1 trains exactly as FedAvg; from round 2 on the
    corrections act, and the messages carry twice FedAvg's bytes."""
    rows = {}
    for method in ("fedavg", "scaffold"):
        config = run_config({"method": method, "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 2,
                             "data-fraction": 0.5, "results-dir": str(tmp_path), "run-name": method,
                             "verbose": False})  # fmt: skip
        simulate(config)
        rows[method] = read_history(tmp_path / method / "history.csv")
    fedavg, scaffold = rows["fedavg"], rows["scaffold"]
    assert scaffold[0]["accuracy"] == fedavg[0]["accuracy"] and scaffold[0]["train_loss"] == fedavg[0]["train_loss"]
    assert scaffold[1]["train_loss"] != fedavg[1]["train_loss"]
    assert int(scaffold[0]["bytes_down"]) == 2 * int(fedavg[0]["bytes_down"])

"""SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning"): FedAvg whose clients correct each local step by control variates."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedcond.federation.client import Evaluated, FedcondClient, Fitted
from fedcond.federation.messages import PAYLOAD_PARTS, TRAIN_LOSS, pack_parts, unpack_parts
from fedcond.model.networks import get_weights
from fedcond.model.training import LocalTerm

#: What a training instruction holds: the global model x and the server's control variate c.
RECEIVED = ("model", "control")
#: What a reply holds: the trained model y_i and the change of the client's control variate.
RETURNED = ("model", "control-change")
#: The client's own control variate c_i, kept between the rounds it trains.
OWN_CONTROL = "scaffold-control"


class ControlCorrection(LocalTerm):
    """Algorithm 1, line 10: each local step's gradient gets c - c_i added, towards the federation's
    mean gradient and away from this client's own. Counts the steps for the control update. The
    control variates are arrays in the order of the model's ``state_dict`` (zero for its buffers,
    which no gradient moves)."""

    def __init__(self, model: nn.Module, server: list[np.ndarray], own: list[np.ndarray]) -> None:
        trained = dict(model.named_parameters())
        #: Which entries of the ``state_dict`` are trained parameters (the rest are buffers).
        self.trained = [name in trained for name in model.state_dict()]
        self.corrections = {
            name: torch.from_numpy(np.asarray(c - c_own, dtype=np.float32))
            for name, c, c_own in zip(model.state_dict(), server, own, strict=True)
            if name in trained
        }
        self.steps = 0

    def to(self, device: torch.device) -> None:
        self.corrections = {name: tensor.to(device) for name, tensor in self.corrections.items()}

    @torch.no_grad()
    def add_gradient(self, model: nn.Module, with_penalty: bool) -> None:
        self.steps += 1
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:
                parameter.grad.add_(self.corrections[name].view_as(parameter.grad))


def step_weight(steps: int, momentum: float) -> float:
    """How many plain gradients K heavy-ball steps of one constant gradient move the model:
    sum over m = 1..K of (1 - momentum^m) / (1 - momentum); K for plain SGD. With it, option II's
    (x - y_i) / (K * learning rate) recovers the mean corrected gradient under the paper's momentum."""
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


def updated_control(
    own: list[np.ndarray], server: list[np.ndarray], received: list[np.ndarray], trained: list[np.ndarray],
    is_parameter: list[bool], steps: int, learning_rate: float, momentum: float,
) -> list[np.ndarray]:  # fmt: skip
    """Algorithm 1, line 12, option II: c_i+ = c_i - c + (x - y_i) / (K * learning rate), with K the
    steps' weight (``step_weight``): the mean gradient of this client's steps, without another pass
    over its data. Zero for buffers (running statistics move by no gradient step)."""
    scale = 1.0 / (step_weight(steps, momentum) * learning_rate) if steps else 0.0
    return [
        (c_own - c + (x.astype(np.float32) - y.astype(np.float32)) * scale).astype(np.float32)
        if parameter else np.zeros_like(c_own)
        for c_own, c, x, y, parameter in zip(own, server, received, trained, is_parameter, strict=True)
    ]  # fmt: skip


class ScaffoldClient(FedcondClient):
    """Trains the global model with each step corrected by c - c_i, returns the trained model and the
    change of c_i, and keeps c_i (zero before its first round). A newcomer is served the global model,
    as FedAvg serves it (its evaluate messages carry that model alone)."""

    state_lost_on_resume = "each client's control variate c_i (from zero again, as in its first round)"

    def received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> dict[str, list[np.ndarray]]:
        return unpack_parts(parameters, round_config.get(PAYLOAD_PARTS), RECEIVED)

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        received = self.received(parameters, round_config)
        x, server = received["model"], received["control"]
        self.receive(self.model, x)
        own = self.kept.arrays(OWN_CONTROL) or [np.zeros_like(array, dtype=np.float32) for array in x]
        correction = ControlCorrection(self.model, server, own)
        loss = self.train_locally(self.model, round_config, term=correction)
        trained = get_weights(self.model)
        settings = self.train_settings
        new_own = updated_control(own, server, x, trained, correction.trained, correction.steps,
                                  settings.learning_rate, settings.momentum)  # fmt: skip
        self.kept.put(OWN_CONTROL, new_own)
        change = [after - before for after, before in zip(new_own, own, strict=True)]
        arrays, names = pack_parts({"model": trained, "control-change": change})
        return arrays, len(self.data.train_y), {TRAIN_LOSS: loss, PAYLOAD_PARTS: names}

    def evaluate_received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        return self.evaluate_round(self.received(parameters, round_config)["model"], round_config)


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = ScaffoldClient

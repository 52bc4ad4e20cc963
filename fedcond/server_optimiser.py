"""``server-momentum``: FedAvgM, the server's heavy-ball step on the round's averaged update.

FedAvgM (Hsu et al. 2019, "Measuring the Effects of Non-Identical Data Distribution") treats
``current - average`` (the global model minus the round's sample-weighted average of the returned
models) as a gradient: ``velocity = momentum * velocity + (current - average)``, then
``new = current - server-learning-rate * velocity``; the first round's velocity is its update. With
``server-momentum = 0`` and ``server-learning-rate = 1`` the new model is the average: plain FedAvg.

Flower's ``FedAvgM`` applies the same rule, but to every array, batch norm's running statistics and
its integer step count included; here those buffers are the average as it is (a momentum on a
running variance can make it negative). Its class is a Flower ``FedAvg``, which fedcond's strategies
are not, so the rule lives here and the FedAvg-family strategies call it on the mean they already
have (``strategies/fedavg.py``), with or without SecAgg+.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedcond.aggregation import Model
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError

SERVER_MOMENTUM = Option(
    "server-momentum",
    0.0,
    "FedAvgM: the server's momentum on the round's averaged update (0: plain FedAvg; methods whose server "
    "averages one global model)",
    minimum=0.0,
    maximum=0.99,
)
SERVER_LEARNING_RATE = Option(
    "server-learning-rate",
    1.0,
    "FedAvgM: the server's step on its momentum (1 with server-momentum=0: plain FedAvg)",
    minimum=0.0,
)
OPTIONS = (SERVER_MOMENTUM, SERVER_LEARNING_RATE)


def check_server_optimiser(config: RunConfig) -> None:
    """A step that would never move the model is refused in one line, before anything starts."""
    if SERVER_LEARNING_RATE.of(config) <= 0:
        raise FedcondError(
            f"server-learning-rate must be positive (got {SERVER_LEARNING_RATE.of(config):g}); 1 is plain FedAvg"
        )


def is_plain_fedavg(config: RunConfig) -> bool:
    return SERVER_MOMENTUM.of(config) == 0 and SERVER_LEARNING_RATE.of(config) == 1


class ServerMomentum:
    """The server's FedAvgM state: its velocity, one array per trained array of the model.

    ``trained`` says, per array of the model (``state_dict`` order), whether it is a trained weight
    (stepped) or a buffer such as batch norm's running statistics (the round's average as it is).
    """

    def __init__(self, momentum: float, learning_rate: float, trained: Sequence[bool]) -> None:
        self.momentum = float(momentum)
        self.learning_rate = float(learning_rate)
        self.trained = tuple(trained)
        self.velocity: Model | None = None

    @classmethod
    def of(cls, config: RunConfig, trained: Sequence[bool]) -> ServerMomentum | None:
        """The run's server step, or None where it is plain FedAvg (the average is the new model)."""
        if is_plain_fedavg(config):
            return None
        return cls(SERVER_MOMENTUM.of(config), SERVER_LEARNING_RATE.of(config), trained)

    def step(self, current: Model, average: Model) -> Model:
        """The new global model from the current one and the round's average of the returned models."""
        if not (len(current) == len(average) == len(self.trained)):
            raise FedcondError(
                f"the server step got {len(current)} current and {len(average)} averaged arrays for a model "
                f"of {len(self.trained)}; server and clients disagree on the model"
            )
        updates = [
            (np.asarray(now, dtype=np.float64) - np.asarray(mean, dtype=np.float64)) if trained else None
            for now, mean, trained in zip(current, average, self.trained, strict=True)
        ]
        if self.velocity is None:
            velocity = [update if update is not None else np.zeros(0) for update in updates]
        else:
            velocity = [
                self.momentum * previous + update if update is not None else previous
                for previous, update in zip(self.velocity, updates, strict=True)
            ]
        self.velocity = velocity
        return [
            (np.asarray(now, dtype=np.float64) - self.learning_rate * moving).astype(np.asarray(mean).dtype)
            if trained
            else mean
            for now, mean, moving, trained in zip(current, average, velocity, self.trained, strict=True)
        ]

    def state(self) -> Model:
        """The velocity, for the run's checkpoint (empty before the first round)."""
        return [np.asarray(array, dtype=np.float64) for array in self.velocity] if self.velocity is not None else []

    def load_state(self, velocity: Model) -> None:
        self.velocity = [np.asarray(array, dtype=np.float64) for array in velocity] if velocity else None

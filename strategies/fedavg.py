"""FedAvg over every client, recording fedcond's per-round history."""

from __future__ import annotations

from flwr.common import FitRes, Parameters, ndarrays_to_parameters
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from fedcond.methods import ServerSetup
from fedcond.models import build_run_model, get_weights
from strategies.base import FedcondStrategy


def initial_weights(setup: ServerSetup, seed: int | None = None) -> list:
    """The seeded initial backbone (conditioned or not); ``seed`` defaults to the run's."""
    return get_weights(build_run_model(setup.config, setup.num_classes, setup.conditioned, seed))


class FedcondFedAvg(FedcondStrategy, FedAvg):
    """FedAvg (McMahan et al. 2017) with every client taking part in every round.

    Each round all clients train the global model locally and return it; Flower's FedAvg averages
    them weighted by training samples, in partition order so that the same seed gives the same
    numbers. Then every client evaluates the new global model on its own test set. Used by
    ``fedavg``, ``conditional`` (clients feed their fingerprint) and ``ditto`` (clients also keep a
    personal model).
    """

    def __init__(self, setup: ServerSetup) -> None:
        FedcondStrategy.__init__(self, setup)
        FedAvg.__init__(self, accept_failures=False)

    def initial_global(self) -> Parameters:
        return ndarrays_to_parameters(initial_weights(self.setup))

    def combine(self, server_round: int, results: list[tuple[ClientProxy, FitRes]]) -> Parameters | None:
        parameters, _ = FedAvg.aggregate_fit(self, server_round, results, [])
        return parameters

"""FedAvg over every client, recording fedcond's per-round history."""

from __future__ import annotations

from flwr.common import EvaluateIns, EvaluateRes, FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg

from clients.numpy_client import FINGERPRINT_MEAN, FINGERPRINT_STD, SERVER_ROUND, TRAIN_LOSS
from fedcond.datasets import dataset_spec
from fedcond.methods import ServerSetup
from fedcond.metrics import weighted_mean
from fedcond.models import build_model, get_weights
from fedcond.wire import array_to_bytes
from strategies.accounting import Failures, RoundTracker, by_partition, parameters_bytes, raise_on_failures
from strategies.setup import all_clients, federated_fingerprint_statistics


def initial_parameters(setup: ServerSetup) -> Parameters:
    """The seeded initial backbone (conditioned or not) every client starts from."""
    config = setup.config
    condition_dim = config.fingerprint_dim if setup.conditioned else 0
    model = build_model(dataset_spec(config.dataset).image_shape, setup.num_classes, condition_dim, config.seed)
    return ndarrays_to_parameters(get_weights(model))


def mean_train_loss(metrics: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
    return {TRAIN_LOSS: weighted_mean((float(m[TRAIN_LOSS]), count) for count, m in metrics)}


class FedcondFedAvg(FedAvg):
    """FedAvg (McMahan et al. 2017) with every client taking part in every round.

    Each round all clients train the global model locally and return it; the server averages them
    weighted by training samples, in partition order so that the same seed gives the same numbers.
    Then every client evaluates the new global model on its own test set; the strategy records
    sample-weighted accuracy and loss, accuracy per true cluster, seconds and model bytes each way.

    For conditioned methods with ``normalisation = "federated"``, a setup step before round 1 runs a
    secure sum of the clients' fingerprints and their squares; the resulting mean and standard
    deviation (aggregates only) are sent to clients with every instruction.
    """

    def __init__(self, setup: ServerSetup) -> None:
        num_clients = setup.config.num_clients
        super().__init__(
            fraction_fit=1.0,
            fraction_evaluate=1.0,
            min_fit_clients=num_clients,
            min_evaluate_clients=num_clients,
            min_available_clients=num_clients,
            accept_failures=False,
            initial_parameters=initial_parameters(setup),
            fit_metrics_aggregation_fn=mean_train_loss,
        )
        self.setup = setup
        self.tracker = RoundTracker(setup.recorder, setup.config.num_server_rounds, setup.config.verbose)
        self.shared_config: dict[str, Scalar] = {}
        self.setup_bytes = 0

    def __repr__(self) -> str:
        return f"FedcondFedAvg(method={self.setup.config.method})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        proxies = all_clients(client_manager, self.setup.config)
        if self.setup.conditioned and self.setup.config.normalisation == "federated":
            mean, std, self.setup_bytes = federated_fingerprint_statistics(proxies, self.setup.config.fingerprint_dim)
            self.shared_config = {FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}
        return super().initialize_parameters(client_manager)

    def round_config(self, server_round: int) -> dict[str, Scalar]:
        return {SERVER_ROUND: server_round, **self.shared_config}

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        self.tracker.start_round()
        instructions = [
            (proxy, FitIns(ins.parameters, {**ins.config, **self.round_config(server_round)}))
            for proxy, ins in super().configure_fit(server_round, parameters, client_manager)
        ]
        self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        raise_on_failures(failures, f"training round {server_round}")
        results = by_partition(results)
        self.tracker.received_fit(results)
        return super().aggregate_fit(server_round, results, failures)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        instructions = [
            (proxy, EvaluateIns(ins.parameters, {**ins.config, **self.round_config(server_round)}))
            for proxy, ins in super().configure_evaluate(server_round, parameters, client_manager)
        ]
        self.tracker.sent(sum(parameters_bytes(ins.parameters) for _, ins in instructions))
        return instructions

    def aggregate_evaluate(
        self, server_round: int, results: list[tuple[ClientProxy, EvaluateRes]], failures: Failures
    ) -> tuple[float | None, dict[str, Scalar]]:
        raise_on_failures(failures, f"evaluation round {server_round}")
        record = self.tracker.finish_round(server_round, results)
        if server_round == self.setup.config.num_server_rounds and self.setup.recorder is not None:
            self.setup.recorder.finish({"setup_bytes": self.setup_bytes})
        return record.loss, {"accuracy": record.accuracy}

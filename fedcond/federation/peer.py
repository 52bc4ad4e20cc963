"""The family base of the decentralised methods the server simulates (Gossip, DAC): every client owns a
model, held here only to simulate the network. The strategy is the network."""

from __future__ import annotations

from typing import Any

from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.federation.round_record import parameters_bytes
from fedcond.federation.server_method import ServerMethod, StrategyInputs
from fedcond.model.aggregation import (
    Model,
)
from fedcond.model.networks import build_run_model, get_weights, trained_arrays
from fedcond.model.store import CLIENT_MODELS_MEMORY_MB, SPILL_FOLDER, SpillingModels


class PeerToPeer(ServerMethod):
    """Every client owns a model, held here only to simulate the network; each client receives
    its own. After local training, ``mix`` lets the clients that answered exchange models; a client
    that did not answer is absent from the exchange and keeps its model. Only those peer exchanges
    are counted as communication (a real deployment would not route models through a server).

    A real deployment keeps each model on its client; this server holds at most
    ``client-models-memory-mb`` of them in memory and the rest in the run folder
    (``fedcond.model.store.SpillingModels``), so that a federation of thousands of sampled clients fits.
    """

    options = (CLIENT_MODELS_MEMORY_MB,)
    serves_held_out_clients = True

    peer_to_peer = True
    secure_aggregation_refusal = (
        "its clients average with chosen peers, so there is no sum over the federation to protect (each peer "
        "receives the others' models)"
    )
    server_step_refusal = "each client averages its peers' models"

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs)
        model = build_run_model(inputs.config, inputs.num_classes, inputs.conditioned)
        #: Partition id -> that client's model.
        self.models = self.client_models(get_weights(model))
        #: Per array of a model: whether it is a trained weight (what DAC compares; buffers are not).
        self.trained = trained_arrays(model)
        self.model_bytes = parameters_bytes(ndarrays_to_parameters(self.models.initial))

    def client_models(self, initial: Model) -> SpillingModels:
        recorder = self.inputs.recorder
        memory_bytes = int(CLIENT_MODELS_MEMORY_MB.of(self.inputs.config) * 2**20)
        return SpillingModels(initial, recorder.folder / SPILL_FOLDER if recorder else None, memory_bytes)

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        if partition_id < self.inputs.config.num_training_clients:  # its own model, to train or evaluate
            return ndarrays_to_parameters(self.models[partition_id]), config
        return self.newcomer_parameters(partition_id), config

    def newcomer_parameters(self, partition_id: int) -> Parameters:
        """What a newcomer (a held-out client, which has no model here) receives: its method's rule."""
        raise NotImplementedError

    def mix(self, server_round: int, models: list[Model]) -> tuple[list[Model], int]:
        """The models after this round's exchanges between the clients that answered (in partition
        order), and how many models were sent peer to peer."""
        raise NotImplementedError

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        trained = [parameters_to_ndarrays(res.parameters) for _, res in results]
        mixed, transfers = self.mix(server_round, trained)
        self.models.update(
            server_round, [(partition, model) for (partition, _), model in zip(results, mixed, strict=True)]
        )
        self.protocol.tracker.peer_exchange(transfers * self.model_bytes)
        return None

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        held, files = self.models.checkpoint_state()
        models.update({f"client-{pid}": model for pid, model in held.items()})
        return models, {**values, **files}

    def checkpoint_saved(self) -> None:
        self.models.checkpoint_saved()

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        super().load_state(models, values)
        prefix = "client-"
        held = {int(name[len(prefix) :]): model for name, model in models.items() if name.startswith(prefix)}
        self.models.load(held, values)

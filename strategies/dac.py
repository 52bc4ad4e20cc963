"""DAC (Zec et al.): a simulated peer-to-peer network; each client averages with its top-k peers by
cosine similarity."""

from __future__ import annotations

from flwr.common import Parameters, ndarrays_to_parameters

from fedcond.federation.declaration import KEEPS_MODEL_ON_DRIFT, PEER_MODEL_REPLY, Declaration, Facts
from fedcond.federation.peer import PeerToPeer
from fedcond.model.aggregation import (
    DAC_NEIGHBOURS,
    Model,
    cosine_similarities,
    neighbourhood_average,
    top_k_neighbours,
)


class DacStrategy(PeerToPeer):
    """DAC (Listo Zec et al. 2022), the paper's variant: after local training each client averages
    its model uniformly with its ``dac-neighbours`` most similar peers by cosine similarity of the
    model parameters (the trained weights alone: batch norm's buffers left out; deterministic top-k,
    ties to the lower partition id), among the clients that answered. Default k = 3.
    """

    options = (*PeerToPeer.options, DAC_NEIGHBOURS)
    server_step_refusal = "each client averages its model with its most similar peers' (dac-neighbours of them)"

    def newcomer_parameters(self, partition_id: int) -> Parameters:
        """Every training client's model, one after another: the newcomer averages the ones with the
        lowest loss on its own training data (fedcond.clients.dac), having no model to compare by cosine."""
        return ndarrays_to_parameters([array for pid in self.training_partitions for array in self.models[pid]])

    def mix(self, server_round: int, models: list[Model]) -> tuple[list[Model], int]:
        neighbours = top_k_neighbours(cosine_similarities(models, self.trained), DAC_NEIGHBOURS.of(self.inputs.config))
        return neighbourhood_average(models, neighbours), sum(len(chosen) for chosen in neighbours)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "averaging with the top-k cosine-similar peers",
    DacStrategy,
    Facts(
        "trains its own model", "simulates the network: each client averages with its top-k peers by cosine "
        "similarity", "own model", "k models received per client",
        "every training client's model; it averages (uniformly) the `dac-neighbours` with the lowest loss on its own "
        "training data. A newcomer has no model of its own to compare by cosine similarity, so this is the similarity "
        "of Listo Zec et al.'s original DAC (a peer model's training loss on the client's data), with the paper's "
        "top-k", "`DacStrategy.newcomer_parameters`, `DacClient.newcomer_model`", "lowest-loss peers",
        KEEPS_MODEL_ON_DRIFT,
        server_state=True,
        releases=(
            PEER_MODEL_REPLY,
        ),
    ),
)  # fmt: skip

"""CFL's client (Sattler et al. 2020): trains the one model of its cluster that the server sends and
returns it, as FedAvg's client does; the server compares the updates' directions to split clusters
(``fedcond.strategies.cfl``). A newcomer walks the paper's parameter tree (``fedcond.model.parameter_tree``): at
each split on its way it trains the split's model on its own data and follows the side its update
agrees with, down to the cluster whose model it is served."""

from __future__ import annotations

import numpy as np

from fedcond.errors import FedcondError
from fedcond.federation.client import FedcondClient
from fedcond.federation.messages import PARAMETER_TREE
from fedcond.model.networks import Network, get_weights, set_weights, trained_arrays
from fedcond.model.parameter_tree import unpack, walk, weight_update


class CflClient(FedcondClient):
    """FedAvg's client while training; a newcomer places itself by the parameter tree."""

    # Nothing beyond training: the server reads the direction of each trained model's update, and a
    # newcomer's walk down the tree trains models it never sends.

    def newcomer_model(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Network:
        if PARAMETER_TREE not in round_config:
            raise FedcondError(
                "a CFL newcomer's message has no parameter tree; server and client run other fedcond versions"
            )
        leaves, splits = unpack(parameters, str(round_config[PARAMETER_TREE]), len(self.model.state_dict()))

        def update_at(model: list[np.ndarray]) -> np.ndarray:
            trained = self.fresh_model()
            set_weights(trained, model)
            self.train_locally(trained, round_config)
            return weight_update(get_weights(trained), model, trained_arrays(trained))

        leaf, _ = walk(splits, update_at)
        set_weights(self.model, leaves[leaf])
        return self.model


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = CflClient

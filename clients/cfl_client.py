"""CFL's client (Sattler et al. 2020): trains the one model of its cluster that the server sends and
returns it, as FedAvg's client does; the server compares the updates' directions to split clusters
(``strategies.cfl``). A newcomer receives every cluster's model and is served the one with the
lowest loss on its training data (IFCA's rule: ``clients.ifca_client``)."""

from __future__ import annotations

import numpy as np

from clients.ifca_client import IfcaClient


class CflClient(IfcaClient):
    """IFCA's client, with one candidate while training: nothing to choose, nothing evaluated first."""

    released_beyond_training = "nothing: the server reads the direction of each trained model's update"

    def choose(self, candidates: list[list[np.ndarray]], round_config: dict[str, object]) -> int:
        return 0 if len(candidates) == 1 else super().choose(candidates, round_config)

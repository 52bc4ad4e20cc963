"""SCAFFOLD (Karimireddy et al., ICML 2020): the server averages the models as FedAvg does and keeps
the federation's control variate c, which it sends beside the global model."""

from __future__ import annotations

from typing import Any

import numpy as np
from fedcond.strategies.fedavg import FedcondFedAvg
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.federation.declaration import GLOBAL_NEWCOMER, Declaration, Facts, Release
from fedcond.federation.messages import PAYLOAD_PARTS, pack_parts, unpack_parts
from fedcond.federation.participation import FIT
from fedcond.federation.server_method import StrategyInputs
from fedcond.model.aggregation import Model, weighted_average


class ScaffoldStrategy(FedcondFedAvg):
    """Algorithm 1, lines 13-17: x moves to the sample-weighted mean of the returned models (FedAvg's
    weighting, where the paper's is uniform; ``server-learning-rate`` is its global step size eta_g,
    and ``server-momentum`` applies as for FedAvg), and c += (|S| / N) * mean of the returned
    changes of the clients' control variates, with S the clients that answered and N every
    training client, so that c stays the mean of every client's c_i."""

    secure_aggregation_refusal = "its server needs each client's control-variate change beside its model"
    averages_one_model = False  # a reply is [y_i, change of c_i]: no DP wrapper may clip it as one vector
    combines_the_mean = False
    reply_parts = ("model", "control-change")
    #: The named models of a training instruction: the global model x and the server's control c.
    SENT_PARTS = ("model", "control")
    #: The checkpoint's name for the server's control variate.
    CONTROL = "scaffold-control"

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs)
        self.control: Model = [np.zeros_like(array, dtype=np.float32) for array in self.initial]
        #: This round's training instruction and its part names, built once for every client (None:
        #: build it anew).
        self.sent: tuple[Parameters, str] | None = None

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        if stage != FIT:
            return current, config
        if self.sent is None:
            arrays, names = pack_parts(dict(zip(self.SENT_PARTS, (self.current, self.control), strict=True)))
            self.sent = ndarrays_to_parameters(arrays), names
        parameters, names = self.sent
        return parameters, {**config, PAYLOAD_PARTS: names}

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        if not results:
            return None
        replies = [unpack_parts(parameters_to_ndarrays(res.parameters), res.metrics.get(PAYLOAD_PARTS),
                                self.reply_parts) for _, res in results]  # fmt: skip
        share = len(results) / len(self.training_partitions)
        mean_change = weighted_average((reply["control-change"] for reply in replies), [1] * len(replies))
        self.control = [(c + share * change).astype(np.float32)
                        for c, change in zip(self.control, mean_change, strict=True)]  # fmt: skip
        self.sent = None
        models = (reply["model"] for reply in replies)
        return self.stepped(weighted_average(models, [res.num_examples for _, res in results]))

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        models[self.CONTROL] = self.control
        return models, values

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        super().load_state(models, values)
        self.control = list(models[self.CONTROL])
        self.sent = None


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "FedAvg with each client's local steps corrected by control variates",
    ScaffoldStrategy,
    Facts(
        "trains the global model with each step's gradient corrected by c \u2212 c_i (the server's and its own "
        "control variates), then updates c_i from its displacement (Karimireddy et al. 2020, option II; not in "
        "the paper)", "FedAvg (sample-weighted) for the model; c += (answered / all) \u00b7 mean change of c_i",
        "global model", "model and control variate, down and up: twice FedAvg's", *GLOBAL_NEWCOMER,
        "nothing to do: the global model is every client's, and its c_i follows its new data as it trains",
        server_state=True,
        releases=(
            Release(
                "each training round",
                "the model after local training and the change of its control variate c_i, n and its training loss",
                "the client's model update and the change of its control variate (another function of its "
                "gradients)",
            ),
        ),
    ),
    competitor=True,
)  # fmt: skip

"""FedAvg over every client, recording fedcond's per-round history."""

from __future__ import annotations

from flwr.common import FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.aggregation import Model, weighted_average
from strategies.base import FedcondStrategy, initial_weights
from strategies.declaration import GLOBAL_NEWCOMER, NOTHING_ON_DRIFT, Declaration, Facts


class FedcondFedAvg(FedcondStrategy):
    """FedAvg (McMahan et al. 2017) with every client asked in every round.

    Each round all clients train the global model locally and return it; the new global model is
    the average of the models that came back, weighted by training samples (so the weights are
    renormalised over the clients that answered), in partition order so that the same seed gives the
    same numbers. Then every client evaluates the new global model on its own test set. Used by
    ``fedavg``, ``conditional`` (clients feed their fingerprint) and ``ditto`` (clients also keep a
    personal model). A held-out client evaluates the global model (fed its own fingerprint).

    With ``secure-aggregation = "secaggplus"`` the server never sees a client's model: SecAgg+ gives
    it the sample-weighted mean of the models of the clients that finished the protocol, which is the
    new global model as it is (up to SecAgg+'s quantisation).
    """

    serves_held_out_clients = True
    #: Its server needs only the sample-weighted mean of the returned models: SecAgg+ gives exactly that.
    secure_aggregation_refusal = None

    def initial_global(self) -> Parameters:
        return ndarrays_to_parameters(initial_weights(self.inputs))

    #: Its server needs the sample-weighted mean alone: each reply is folded into it as it arrives.
    combines_the_mean = True

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        if self.fit_stream is not None:  # the replies' models were folded in as they came (same numbers)
            return ndarrays_to_parameters(self.fit_stream.result({p: res.num_examples for p, res in results}))
        # Decoded one at a time as the average consumes them (peak memory: one model, not one per client).
        models = (parameters_to_ndarrays(res.parameters) for _, res in results)
        return ndarrays_to_parameters(weighted_average(models, [res.num_examples for _, res in results]))

    def combine_sum(self, server_round: int, mean: Model) -> Parameters | None:
        # SecAgg+ weighted each model by its client's samples before summing: the mean is FedAvg's model.
        return ndarrays_to_parameters(mean)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "one global backbone CNN, FedAvg over all clients",
    FedcondFedAvg,
    Facts(
        "trains the global model", "FedAvg (sample-weighted)", "global model", "model down and up, every client",
        *GLOBAL_NEWCOMER, NOTHING_ON_DRIFT,
    ),
)  # fmt: skip

"""FedAvg over every client, recording fedcond's per-round history."""

from __future__ import annotations

from typing import Any

from flwr.common import FitRes, Parameters, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.federation.declaration import GLOBAL_NEWCOMER, MODEL_REPLY, NOTHING_ON_DRIFT, Declaration, Facts
from fedcond.federation.server_method import ServerMethod, StrategyInputs
from fedcond.model.aggregation import Model, weighted_average
from fedcond.model.networks import build_run_model, get_weights, trained_arrays
from fedcond.model.server_optimiser import ServerMomentum
from fedcond.records.checkpoint import GLOBAL_MODEL


class FedcondFedAvg(ServerMethod):
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

    With ``server-momentum`` (FedAvgM, ``fedcond.model.server_optimiser``) the average is not the new model
    but the end of the round's update, on which the server takes its own heavy-ball step; the
    velocity is part of the checkpoint.
    """

    serves_held_out_clients = True
    #: Its server needs only the sample-weighted mean of the returned models: SecAgg+ gives exactly that.
    secure_aggregation_refusal = None
    averages_one_model = True
    #: Its server averages the global model: FedAvgM steps it.
    server_step_refusal = None
    #: The checkpoint's name for FedAvgM's velocity.
    VELOCITY = "server-velocity"

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs)
        model = build_run_model(inputs.config, inputs.num_classes, inputs.conditioned)
        self.initial = get_weights(model)
        #: The model's arrays by name, in ``state_dict`` order (what travels).
        self.array_names = list(model.state_dict())
        self.server_momentum = ServerMomentum.of(inputs.config, trained_arrays(model))
        #: The global model the round's clients received (what FedAvgM steps from).
        self.current: Model = self.initial

    def initial_global(self) -> Parameters:
        return ndarrays_to_parameters(self.initial)

    #: Set by client-level DP (``fedcond/federation/client_dp.py``): ``stepped`` hands the round's mean on
    #: as it is, Flower's wrapper noises it, and the wrapper then takes the server's step on the noised
    #: mean (``server_step``), so that FedAvgM's velocity only ever holds what DP released.
    defers_server_step = False

    def stepped(self, average: Model) -> Parameters:
        """The new global model from the round's average: the average itself, or FedAvgM's step (the
        mean as it is where client-level DP steps after its noise)."""
        return ndarrays_to_parameters(average if self.defers_server_step else self.server_step(average))

    def server_step(self, average: Model) -> Model:
        """The new global model from the round's (under client-level DP: noised) average."""
        if self.server_momentum is not None:
            average = self.server_momentum.step(self.current, average)
        self.current = average
        return average

    def state(self) -> tuple[dict[str, Model], dict[str, Any]]:
        models, values = super().state()
        if self.server_momentum is not None:
            models[self.VELOCITY] = self.server_momentum.state()
        return models, values

    def load_state(self, models: dict[str, Model], values: dict[str, Any]) -> None:
        super().load_state(models, values)
        if GLOBAL_MODEL in models:
            self.current = list(models[GLOBAL_MODEL])
        if self.server_momentum is not None:
            self.server_momentum.load_state(models.get(self.VELOCITY, []))

    #: Its server needs the sample-weighted mean alone: each reply is folded into it as it arrives.
    combines_the_mean = True

    def combine(self, server_round: int, results: list[tuple[int, FitRes]]) -> Parameters | None:
        if self.protocol.folded.stream is not None:  # the replies' models were folded in as they came (same numbers)
            return self.stepped(self.protocol.folded.stream.result({p: res.num_examples for p, res in results}))
        # Decoded one at a time as the average consumes them (peak memory: one model, not one per client).
        models = (parameters_to_ndarrays(res.parameters) for _, res in results)
        return self.stepped(weighted_average(models, [res.num_examples for _, res in results]))

    def combine_sum(self, server_round: int, mean: Model) -> Parameters | None:
        # SecAgg+ weighted each model by its client's samples before summing: the mean is FedAvg's average.
        return self.stepped(mean)


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "one global backbone CNN, FedAvg over all clients",
    FedcondFedAvg,
    Facts(
        "trains the global model", "FedAvg (sample-weighted)", "global model", "model down and up, every client",
        *GLOBAL_NEWCOMER, NOTHING_ON_DRIFT, server_state=True,
        releases=(
            MODEL_REPLY,
        ),
    ),
)  # fmt: skip

"""Client-level differential privacy through Flower's own wrappers, around fedcond's strategies.

``client-dp = "server-side"`` wraps the method's strategy in Flower's
``DifferentialPrivacyServerSideFixedClipping`` (the server clips each client's update to
``client-dp-clipping-norm``), ``"client-side"`` in ``DifferentialPrivacyClientSideFixedClipping``
(each client clips its own update with Flower's ``fixedclipping_mod``, see fedcond/federation/clipping_mod.py); in
both, the server adds Gaussian noise of std noise-multiplier x clipping-norm / clients to the
average. The unit of privacy is a whole client: its every sample, in every round.

What the wrappers take for granted that fedcond must provide, done here rather than in
``fedcond/federation/strategy.py``:

- The noise is calibrated to an *unweighted* mean of clipped updates (sensitivity clip / clients);
  fedcond's FedAvg weights by sample counts, under which one client's weight can exceed 1 / clients.
  The wrapper therefore hands the inner strategy every result with one example, so FedAvg averages
  uniformly (the round's train_loss is then an unweighted mean too).
- Flower's wrappers return "no new model" on any failure, silently, and the server-side one clips
  an empty error reply against the model (a ValueError): the replies go through the inner
  strategy's failure accounting first (``answered_replies``, its failure policy), and a round that
  lost any client then stops the run in one line: the noise is calibrated to every training client
  answering, and a partial round would be less private than its recorded epsilon.
- The wrappers noise whatever the inner strategy returns. A server optimiser (``server-momentum``,
  ``server-learning-rate``) must step on the *noised* mean, or its velocity would carry each round's
  un-noised average into later rounds: the method hands its mean on unstepped
  (``defers_server_step``), the wrapper noises it and then takes the method's step
  (``server_step``). FedAvgM is then post-processing of what DP released, and every averaging arm of a
  comparison can run under DP with the server optimiser it runs without.
- A method's set-up may publish a sum of every client's statistics (conditional's fingerprint
  statistics under ``normalisation=federated``, through SecAgg+), which every client then receives:
  another release of each client's data, which Flower's wrappers never see. Each client clips its
  contribution to ``client-dp-statistics-clipping-norm``, the server noises the sum with the same
  multiplier (``noised_sum``), and the accountant composes it as one more release at rate 1
  (``describe``, through ``gaussian_rounds_epsilon``); a run without that bound is refused (``check_client_dp``).
- Flower's wrappers noise one global model; a server that averages one model per true cluster
  (Oracle: ``client_dp_per_model``) sends each client its cluster's model, against which the client's
  ``fixedclipping_mod`` clips, and ``PerModelClientDp`` has the method noise each cluster's unweighted
  mean of clipped updates with std multiplier x clip / that cluster's clients. Each client's update
  enters one cluster's sum only, whose noise has std multiplier x clip as FedAvg's does, so a round is
  the same Gaussian mechanism for every client and the accountant's epsilon is FedAvg's; what differs
  is the noise on each mean (a cluster has fewer clients than the federation).
- The noise lands on every array, batch norm's running statistics included (they are part of each
  clipped update, so they are covered too); a noised running variance can fall below zero, which
  no network can normalise by. The wrapper sets those values to zero after the noise (post-processing,
  so the guarantee stands); with ``feature-norm=local-batch`` clients use their own layers instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, cast

import numpy as np
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)
from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, add_gaussian_noise_to_params, compute_stdv

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.participation import FIT
from fedcond.federation.round_record import Failures, answered_replies
from fedcond.federation.sampling import clients_per_round
from fedcond.federation.secagg_workflow import SecureSum
from fedcond.federation.server_method import ServerMethod
from fedcond.federation.strategy import FedcondStrategy
from fedcond.model.aggregation import Model
from fedcond.privacy.dp import DP_DELTA, check_delta, gaussian_rounds_epsilon
from fedcond.privacy.secure_aggregation import SecureAggregation

CLIENT_DP_MODES = ("off", "server-side", "client-side")
CLIENT_DP = Option(
    "client-dp",
    "off",
    "client-level DP through Flower's wrappers: `off`, `server-side` or `client-side` clipping (methods whose "
    "server averages one global model; Oracle, one per true cluster, client-side only)",
)
CLIENT_DP_NOISE_MULTIPLIER = Option(
    "client-dp-noise-multiplier", 1.0, "client-level DP: noise std / clipping norm on the sum of updates", minimum=0
)
CLIENT_DP_CLIPPING_NORM = Option("client-dp-clipping-norm", 1.0, "client-level DP: L2 bound of each client's update")
CLIENT_DP_STATISTICS_CLIPPING_NORM = Option(
    "client-dp-statistics-clipping-norm",
    0.0,
    "client-level DP of a method whose set-up sums statistics of every client (conditional's fingerprint "
    "statistics under `normalisation=federated`): L2 bound of each client's contribution, whose sum the server "
    "noises with the same multiplier, accounted as one more release; 0: not set (such a run is refused)",
    minimum=0.0,
)
#: The client-level settings; the registry declares them for every method.
OPTIONS = (CLIENT_DP, CLIENT_DP_NOISE_MULTIPLIER, CLIENT_DP_CLIPPING_NORM, CLIENT_DP_STATISTICS_CLIPPING_NORM)


def client_dp_mode(config: RunConfig) -> str:
    return str(CLIENT_DP.of(config))


def check_client_dp(config: RunConfig, strategy: type[ServerMethod] | None, eligible: Sequence[str]) -> None:
    """Refuse, before anything starts, client-level DP a method cannot have (``eligible``: the methods
    that can, named in the refusal)."""
    mode = client_dp_mode(config)
    if mode not in CLIENT_DP_MODES:
        raise FedcondError(f"unknown client-dp '{mode}'; choose one of {', '.join(CLIENT_DP_MODES)}")
    if mode == "off":
        return
    if mode == "server-side" and SecureAggregation.of(config).model_updates:
        raise FedcondError(
            "client-dp=server-side clips each client's update on the server, which secure-aggregation=secaggplus "
            "never lets it see; use client-dp=client-side (clients clip, then SecAgg+ masks)"
        )
    if CLIENT_DP_CLIPPING_NORM.of(config) <= 0:
        raise FedcondError(f"client-dp-clipping-norm must be positive (got {CLIENT_DP_CLIPPING_NORM.of(config)})")
    check_delta(DP_DELTA.of(config))
    if strategy is None or not (strategy.averages_one_model or strategy.client_dp_per_model):
        raise FedcondError(
            f"client-dp needs a server that averages one global model, or one per true cluster "
            f"({', '.join(eligible)}); {config.method} does not: set client-dp=off"
        )
    if strategy.client_dp_per_model and mode == "server-side":
        raise FedcondError(
            f"client-dp=server-side clips each update against Flower's one global model, and {config.method} sends "
            "each client its cluster's; use client-dp=client-side (each client clips against the model it received)"
        )
    if strategy.client_dp_per_model and clients_per_round(config) < config.num_training_clients:
        raise FedcondError(
            f"client-dp with {config.method} noises each cluster's mean for that cluster's clients, so every training "
            "client must train every round; set clients-per-round=0, or client-dp=off"
        )
    if strategy.released_sums(config) and CLIENT_DP_STATISTICS_CLIPPING_NORM.of(config) <= 0:
        raise FedcondError(
            f"client-dp covers every release of a client's data, and {config.method}'s set-up also publishes a sum "
            "of every client's statistics (the fingerprint's mean and std under normalisation=federated): set "
            "client-dp-statistics-clipping-norm to a bound on each client's contribution (the sum is then noised "
            "and accounted as one more release), or client-dp=off"
        )


#: What a running variance's name ends with in a ``state_dict`` (torch's batch-norm layers).
RUNNING_VARIANCE = ".running_var"


class AveragesOneModel(Protocol):
    """What the wrappers need of a method whose server averages one model (``averages_one_model``,
    ``strategies/fedavg.py``): its arrays' names and its server step, taken after the noise."""

    defers_server_step: bool
    array_names: list[str]

    def server_step(self, average: Model) -> Model: ...


def valid_statistics(names: Sequence[str], arrays: Model) -> Model:
    """``arrays`` with every running variance below zero set to zero (post-processing of the noise)."""
    return [
        np.maximum(array, 0).astype(array.dtype) if name.endswith(RUNNING_VARIANCE) else array
        for name, array in zip(names, arrays, strict=True)
    ]


class _FedcondClientDp:
    """What both wrappers need on top of Flower's (see the module docstring)."""

    strategy: FedcondStrategy
    num_sampled_clients: int

    def stepped_after_noise(self, noised: Parameters | None) -> Parameters | None:
        """The new global model: the method's server step on the noised mean, its running variances valid."""
        if noised is None:
            return None
        method = cast(AveragesOneModel, self.strategy.method)
        names, arrays = method.array_names, parameters_to_ndarrays(noised)
        # After the model a reply may carry more (head-fit=ridge's Gram matrix, which its step makes valid).
        mean = [*valid_statistics(names, arrays[: len(names)]), *arrays[len(names) :]]
        return ndarrays_to_parameters(method.server_step(mean))

    def every_reply_counted_once(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> list[tuple[ClientProxy, FitRes]]:
        """The round's replies, each reporting one sample (an unweighted mean), once every sampled
        client answered; the run stops in one line otherwise."""
        inner = self.strategy
        answered = answered_replies(FIT, results, failures, inner.participation)
        inner.enforce_policy(FIT)  # records the failures; stops the run below min-answered-fraction
        if len(answered) < self.num_sampled_clients:
            first = inner.participation.failures[0].line() if inner.participation.failures else "none recorded"
            raise FedcondError(
                f"round {server_round}: {len(answered)} of {self.num_sampled_clients} clients answered fit, and "
                "client-dp's noise is calibrated to all of them (a partial round is less private than its "
                f"epsilon says); first: {first}; fix those clients or set client-dp=off"
            )
        return [(proxy, FitRes(res.status, res.parameters, 1, res.metrics)) for proxy, res in results]

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        uniform = self.every_reply_counted_once(server_round, results, failures)
        noised, metrics = super().aggregate_fit(server_round, uniform, [])  # type: ignore[misc]
        return self.stepped_after_noise(noised), metrics


class ServerSideClientDp(_FedcondClientDp, DifferentialPrivacyServerSideFixedClipping):
    """Flower's server-side fixed clipping, failures and weights as fedcond needs them."""


class ClientSideClientDp(_FedcondClientDp, DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side fixed clipping (clients run ``fixedclipping_mod``), failures and weights
    as fedcond needs them.

    It also serves SecAgg+ (``secure-aggregation = "secaggplus"``): each client clips its update and
    reports one sample (fedcond/federation/clipping_mod.py) before SecAgg+ masks it, so the protocol's mean is the
    unweighted mean of clipped updates, to which this adds Flower's noise as for a plain round. The
    server then never sees an update at all, clipped or not: only the noised mean.
    """

    def aggregate_secure_fit(self, server_round: int, outcome: SecureSum) -> Parameters | None:
        inner = self.strategy
        parameters = inner.aggregate_secure_fit(server_round, outcome)
        if len(outcome.contributors) < self.num_sampled_clients:
            raise FedcondError(
                f"round {server_round}: {len(outcome.contributors)} of {self.num_sampled_clients} clients are in the "
                "secure sum, and client-dp's noise is calibrated to all of them (a partial round is less private "
                "than its epsilon says); fix those clients or set client-dp=off"
            )
        if parameters is None:
            return None
        noise = (self.noise_multiplier, self.clipping_norm, self.num_sampled_clients)
        return self.stepped_after_noise(add_gaussian_noise_to_params(parameters, *noise))


class NoisesEachModel(Protocol):
    """What ``PerModelClientDp`` needs of a method that averages one model per true cluster
    (``client_dp_per_model``, ``fedcond/federation/cluster_models.py``)."""

    noised_mean: Callable[[Model, int], Model] | None

    def array_names(self) -> list[str]: ...


class PerModelClientDp(_FedcondClientDp, DifferentialPrivacyClientSideFixedClipping):
    """Client-side clipping for a server with one model per true cluster (see the module docstring):
    Flower's wrapper asks each client to clip (``configure_fit``), the round must be whole and
    unweighted as for one model, and the method noises each cluster's mean before its server step."""

    def aggregate_fit(
        self, server_round: int, results: list[tuple[ClientProxy, FitRes]], failures: Failures
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        uniform = self.every_reply_counted_once(server_round, results, failures)
        return self.strategy.aggregate_fit(server_round, uniform, [])


def noised_mean_of(names: Sequence[str], noise_multiplier: float, clip: float) -> Callable[[Model, int], Model]:
    """The noise on a mean of ``clients`` clipped updates, drawn as Flower draws it (std multiplier x
    clip / clients, NumPy's global generator), running variances kept valid."""

    def noised(mean: Model, clients: int) -> Model:
        arrays = [np.array(array, copy=True) for array in mean]
        add_gaussian_noise_inplace(arrays, compute_stdv(noise_multiplier, clip, clients))
        return valid_statistics(names, arrays)

    return noised


def with_client_dp(strategy: FedcondStrategy, config: RunConfig) -> Strategy:
    """``strategy`` wrapped as ``client-dp`` says (itself when off)."""
    mode = client_dp_mode(config)
    if mode == "off":
        return strategy
    noise, clip = CLIENT_DP_NOISE_MULTIPLIER.of(config), CLIENT_DP_CLIPPING_NORM.of(config)
    if strategy.method.client_dp_per_model:
        method = cast(NoisesEachModel, strategy.method)
        method.noised_mean = noised_mean_of(method.array_names(), noise, clip)
        return PerModelClientDp(strategy, noise, clip, clients_per_round(config))
    wrapper = ServerSideClientDp if mode == "server-side" else ClientSideClientDp
    cast(AveragesOneModel, strategy.method).defers_server_step = True
    return wrapper(strategy, noise, clip, clients_per_round(config))


def noise_std_on_the_mean(config: RunConfig) -> float:
    """The std of the noise on each value of a round's mean of one model (the wrappers' noise)."""
    return compute_stdv(
        CLIENT_DP_NOISE_MULTIPLIER.of(config), CLIENT_DP_CLIPPING_NORM.of(config), clients_per_round(config)
    )


def noised_sum(arrays: Model, config: RunConfig) -> Model:
    """A released sum of contributions each client clipped to client-dp-statistics-clipping-norm,
    with Gaussian noise of std noise-multiplier x that bound on each value: one client added or
    removed moves the sum by at most the bound. Drawn as Flower draws the rounds' noise (NumPy's
    global generator)."""
    noised = [np.asarray(array, dtype=np.float64).copy() for array in arrays]
    add_gaussian_noise_inplace(noised, noised_sum_std(config))
    return noised


def noised_sum_std(config: RunConfig) -> float:
    """The std of ``noised_sum``'s noise on each value: noise-multiplier x the statistics' bound."""
    return CLIENT_DP_NOISE_MULTIPLIER.of(config) * CLIENT_DP_STATISTICS_CLIPPING_NORM.of(config)


def describe(config: RunConfig, released_sums: int = 0, per_model: bool = False) -> dict[str, object] | None:
    """What run.json records of the client-level settings (None: off); ``released_sums``: the one-off
    sums of every client's statistics the method's set-up publishes, noised and accounted too;
    ``per_model``: the server noises one mean per true cluster (``client_dp_per_model``)."""
    mode = client_dp_mode(config)
    if mode == "off":
        return None
    noise, clip = CLIENT_DP_NOISE_MULTIPLIER.of(config), CLIENT_DP_CLIPPING_NORM.of(config)
    clients, delta = clients_per_round(config), DP_DELTA.of(config)
    sample_rate = clients / config.num_training_clients
    by_round = [
        gaussian_rounds_epsilon(noise, rounds, delta, sample_rate, released_sums)
        for rounds in range(1, config.num_server_rounds + 1)
    ]
    flower_wrapper = (ServerSideClientDp if mode == "server-side" else ClientSideClientDp).__bases__[1]
    averaging = "unweighted (each client's clipped update counts 1 / clients)"
    if per_model:
        averaging = "unweighted within each true cluster, each cluster's mean noised (std noise x clip / its clients)"
    return {
        "unit": "one client (all its samples, every round)",
        "mode": mode,
        "wrapper": f"flwr.server.strategy.{flower_wrapper.__name__}",
        "noise_multiplier": noise,
        "clipping_norm": clip,
        "clients_per_round": clients,
        "client_sampling_rate": sample_rate,
        "noise_std_on_the_sum": noise * clip,
        **({} if per_model else {"noise_std_on_the_average": compute_stdv(noise, clip, clients)}),
        "averaging": averaging,
        "delta": delta,
        "released_sums": released_sums,
        **(
            {
                "statistics_clipping_norm": CLIENT_DP_STATISTICS_CLIPPING_NORM.of(config),
                "noise_std_on_each_released_sum": noised_sum_std(config),
            }
            if released_sums
            else {}
        ),
        # None, not Infinity: run.json stays strict JSON (no noise: no finite epsilon).
        "epsilon_by_round": [round(value, 6) if value != float("inf") else None for value in by_round],
    }

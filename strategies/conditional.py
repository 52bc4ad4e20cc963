"""The paper's method on the server: FedAvg of the conditioned model, after the fingerprint statistics.

Its one step of its own comes before round 1: with ``normalisation = "federated"`` the server sums
every training client's (f, f^2, 1) through Flower's SecAgg+ and sends every client the mean and
standard deviation that result (``clients/conditional.py`` computes and normalises its own
fingerprint with them). Rounds are FedAvg's (``strategies/fedavg.py``); with ``head-fit = "ridge"``
the output layer's generator is not averaged but ridge-fitted to the clients' head changes from the
same means (``fedcond/model/head_fit.py``).
"""

from __future__ import annotations

import numpy as np
from fedcond.strategies.fedavg import FedcondFedAvg
from flwr.common import FitIns, Parameters, Scalar, ndarray_to_bytes
from flwr.server.client_manager import ClientManager

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.client_dp import (
    CLIENT_DP,
    CLIENT_DP_STATISTICS_CLIPPING_NORM,
    client_dp_mode,
    noise_std_on_the_mean,
    noised_sum,
    noised_sum_std,
)
from fedcond.federation.declaration import ALWAYS_SUMMED, Declaration, Facts, Release
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.messages import (
    FINGERPRINT_MEAN,
    FINGERPRINT_STD,
    SERVER_ROUND,
    STATISTICS_CLIPPING_NORM,
    STEP,
    STEP_STATISTICS,
    array_to_bytes,
)
from fedcond.federation.participation import FIT, STATISTICS, RoundParticipation
from fedcond.federation.server_method import EMPTY, StrategyInputs
from fedcond.fingerprint import fingerprints as fp
from fedcond.fingerprint import statistics_encoding as statistics
from fedcond.model import head_fit
from fedcond.model.aggregation import Model
from fedcond.model.networks import run_fingerprint_size
from fedcond.newcomers import NEWCOMER_FINGERPRINT, NEWCOMER_FINGERPRINTS


def check_newcomer_fingerprint(config: RunConfig) -> None:
    """``newcomer-fingerprint``: a known value, and for ``other-concept`` newcomers in clusters to swap."""
    from fedcond.data.scenarios import scenario_kind

    value = NEWCOMER_FINGERPRINT.of(config)
    if value not in NEWCOMER_FINGERPRINTS:
        raise FedcondError(f"newcomer-fingerprint must be one of {', '.join(NEWCOMER_FINGERPRINTS)} (got {value})")
    if value == "own":
        return
    if not config.held_out_clients:
        raise FedcondError(
            "newcomer-fingerprint=other-concept feeds newcomers another concept's fingerprint, and this run has "
            "none: set held-out-clients=1 (or more)"
        )
    if not scenario_kind(config.scenario).clustered or config.num_clusters < 2:
        raise FedcondError(
            f"newcomer-fingerprint=other-concept takes the fingerprint of another cluster's client, and scenario "
            f"{config.scenario} with num-clusters={config.num_clusters} has no other cluster; use a clustered "
            "scenario with 2 clusters or more"
        )


class ConditionalFedAvg(FedcondFedAvg):
    """FedAvg of the model every client feeds its own fingerprint, after the statistics' secure sum.

    A held-out client evaluates the global model fed its own fingerprint; it is not in the sum (it
    stands for a client that joins later) and receives the published statistics.

    With ``head-fit = "ridge"`` a training instruction carries a zero Gram matrix after the model, and
    each reply's mean the sent generator plus the clients' products in the output layer's place and
    their Gram matrix after the model: the new generator is the ridge fit, the rest of the model the
    average, then FedAvgM's step if configured (``server_step``; under client-level DP, on the noised
    mean).
    """

    options = (*FedcondFedAvg.options, head_fit.HEAD_FIT_RIDGE)

    @classmethod
    def check(cls, config: RunConfig) -> None:
        super().check(config)
        head_fit.check_head_fit(config)
        check_newcomer_fingerprint(config)
        if head_fit.fits_by_ridge(config) and CLIENT_DP.of(config) == "server-side":
            raise FedcondError(
                "client-dp=server-side clips each reply against Flower's global model, which has no head-fit=ridge "
                "Gram matrix; use client-dp=client-side (each client clips against its whole instruction)"
            )

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs)
        #: The last global parameters given a zero Gram matrix for head-fit=ridge, and the result (one
        #: encoding a round, whatever the number of clients).
        self.with_gram: tuple[Parameters, Parameters] | None = None

    def instruction(
        self, stage: str, partition_id: int, current: Parameters, config: dict[str, Scalar]
    ) -> tuple[Parameters, dict[str, Scalar]]:
        if stage != FIT or not head_fit.fits_by_ridge(self.inputs.config):
            return super().instruction(stage, partition_id, current, config)
        if self.with_gram is None or self.with_gram[0] is not current:
            zero = np.zeros(self.reply_extra_shapes()[0], dtype=np.float32)
            self.with_gram = current, Parameters([*current.tensors, ndarray_to_bytes(zero)], current.tensor_type)
        return self.with_gram[1], config

    def reply_extra_shapes(self) -> list[tuple[int, ...]]:
        if not head_fit.fits_by_ridge(self.inputs.config):
            return []
        # G has a row per fingerprint value (the generated blocks) and one for the shared head.
        size = len(self.current[self.array_names.index(head_fit.GENERATOR)]) + 1
        return [(size, size)]

    def server_step(self, average: Model) -> Model:
        if head_fit.fits_by_ridge(self.inputs.config):
            average = self.fitted_head(average)
        return super().server_step(average)

    def fitted_head(self, mean: Model) -> Model:
        """The round's model average with the generator ridge-fitted from the means of the clients'
        products (the arrays in the output layer's place, less the generator sent, and the Gram matrix
        after the model; under client-level DP, noised, and read along the directions above the noise)."""
        if len(mean) != len(self.current) + len(self.reply_extra_shapes()):
            raise FedcondError(
                f"head-fit=ridge expects the model's {len(self.current)} arrays and a Gram matrix in each reply, "
                f"got {len(mean)}; server and clients disagree on head-fit"
            )
        *model, gram = mean
        indices = head_fit.head_indices(self.array_names)
        generator = head_fit.generator_of(*(self.current[index] for index in indices))
        moment = head_fit.generator_of(*(model[index] for index in indices)) - generator
        ridge = head_fit.HEAD_FIT_RIDGE.of(self.inputs.config)
        if self.defers_server_step:  # client-level DP noised the mean
            noise = noise_std_on_the_mean(self.inputs.config)
            fitted = head_fit.noisy_ridge_step(generator, moment, np.asarray(gram), ridge, noise)
        else:
            fitted = head_fit.ridge_step(generator, moment, np.asarray(gram), ridge)
        dtype = self.current[indices[0]].dtype
        for index, array in zip(indices, head_fit.generator_arrays(fitted, dtype), strict=True):
            model[index] = array
        return model

    @classmethod
    def released_sums(cls, config: RunConfig) -> int:
        # The fingerprint statistics' sum, published to every client for federated normalisation.
        return int(config.normalisation == "federated")

    def set_up(self, client_manager: ClientManager) -> None:
        if self.released_sums(self.inputs.config):
            self.publish_fingerprint_statistics(client_manager)

    def publish_fingerprint_statistics(self, client_manager: ClientManager) -> None:
        """The federation's fingerprint mean and std from SecAgg+'s sum of every training client's
        (f, f^2, 1) (exact digits: fedcond.fingerprint.statistics_encoding), into every later instruction. A client that
        drops out is left out of the statistics; fewer than ``secagg-min-clients`` stop the run."""
        config = self.inputs.config
        num_classes = self.inputs.num_classes
        dim = run_fingerprint_size(config, num_classes)
        participation = RoundParticipation(0, self.training_partitions)
        private = client_dp_mode(config) != "off"  # client-level DP: clipped by the clients, noised here
        question: dict[str, Scalar] = {STEP: STEP_STATISTICS, SERVER_ROUND: 0}
        if private:
            question[STATISTICS_CLIPPING_NORM] = CLIENT_DP_STATISTICS_CLIPPING_NORM.of(config)
        instructions = [
            (PartitionProxy(self.protocol.membership.node_of[partition], partition, participation, STATISTICS),
             FitIns(EMPTY, dict(question)))
            for partition in self.training_partitions
        ]  # fmt: skip
        outcome = self.protocol.secure_rounds.sum(
            instructions, 0, client_manager, "the fingerprint statistics' secure sum",
            (statistics.CLIPPING_RANGE, statistics.QUANTIZATION_RANGE), max_weight=1.0,
        )  # fmt: skip
        self.protocol.secure_sum_bytes = outcome.bytes_down + outcome.bytes_up
        outcome.record_failures(participation, STATISTICS)
        failures = list(participation.failures)
        self.protocol.tracker.report_failures(failures)
        self.protocol.secure_rounds.check_outcome(outcome, "the fingerprint statistics", failures)
        count = len(outcome.contributors)
        total, total_of_squares = statistics.open_statistics(outcome.mean[0], count)  # type: ignore[index]
        variance_floor = 0.0
        if private:
            # Every client receives the statistics: client-level DP noises their sums (the count is public),
            # and a variance under the noise's std on it (noise std on a sum / count) is noise.
            total, total_of_squares = noised_sum([total, total_of_squares], config)
            variance_floor = noised_sum_std(config) / count
        if len(total) != dim:
            raise FedcondError(f"the secure sum gave {len(total)} statistics, expected {dim}; fingerprint-dim differs")
        mean, std = fp.mean_and_std(total, total_of_squares, count, variance_floor)
        self.protocol.shared_config = {FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "one global CNN fed each client's fingerprint",
    ConditionalFedAvg,
    Facts(
        "same, model fed its fingerprint", "FedAvg", "global model + own fingerprint",
        "as FedAvg, plus a one-off SecAgg+ sum of fingerprint statistics",
        "the global model, fed the newcomer's own fingerprint (normalised by the published statistics, which it "
        "never entered); with `feature-norm=local-batch`, its batch-norm statistics recomputed first on its own "
        "unlabelled training images (AdaBN)",
        "`FedcondClient.newcomer_model`, with `ConditionalClient.condition`", "global with its fingerprint",
        "recompute the fingerprint on the new data (`drift-fingerprint = \"recompute\"`, the default), or keep the "
        "`stale` one; normalised by the statistics published before round 1",
        server_state=True,
        releases=(
            Release(
                "before round 1, with `normalisation = federated` (the default)",
                "(f, f², 1): its fingerprint, its square and a 1, as exact digits",
                "the sum over the training clients that finished the protocol (so the mean and standard deviation "
                "it publishes to every client) and which clients those were",
                ALWAYS_SUMMED,
            ),
            Release(
                "each training round",
                "the model after local training, fed its fingerprint, n and its training loss",
                "the client's model update and, in the conditioned layer's change, its exact fingerprint (cosine "
                "1.000, [the attack](#the-fingerprint-reconstruction-attack))",
            ),
            Release(
                "each training round, with `head-fit = ridge`",
                "in the output layer's arrays the generator it was sent plus s~ (x) dH, then s~ s~^T (each a change "
                "from its instruction, as a model update is: `fedcond/model/head_fit.py`)",
                "its exact fingerprint (row 0 of s~ s~^T is [1, c]) and its head's exact change (row 0 of "
                "s~ (x) dH)",
            ),
        ),
    ),
)  # fmt: skip

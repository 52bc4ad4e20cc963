"""The paper's method on the client: the shared CNN fed this client's fingerprint.

Everything the fingerprint needs on a client lives here: computing it once from the local training
data (``fedcond.data.client_data.client_fingerprint``; with ``fingerprint-epsilon`` noised once, its
release entered in the privacy ledger), keeping it in ``context.state`` (it is never sent as such),
normalising it with the federation's published statistics, feeding it to the model, and this
client's part of those statistics: (f, f^2, 1) as exact digits for SecAgg+'s sum before round 1
(``strategies/conditional.py`` runs that sum). With ``head-fit = "ridge"`` it trains its generated
output layer as a plain one and returns what the server's fit of the generator needs
(``fedcond/model/head_fit.py``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from flwr.common import ArrayRecord

from fedcond.data.client_data import ClientData, cached_client_data, client_fingerprint
from fedcond.data.scenarios import scenario_for
from fedcond.federation.client import Evaluated, FedcondClient, Fitted
from fedcond.federation.messages import (
    FINGERPRINT_MEAN,
    FINGERPRINT_STD,
    STATISTICS_CLIPPING_NORM,
    STEP,
    STEP_STATISTICS,
    TRAIN_LOSS,
    array_from_bytes,
)
from fedcond.fingerprint import fingerprints as fp
from fedcond.fingerprint import statistics_encoding
from fedcond.model import head_fit
from fedcond.model.networks import get_weights
from fedcond.newcomers import NEWCOMER_FINGERPRINT, mismatched_participant, other_concept_cluster
from fedcond.privacy.dp import private_fingerprint

FINGERPRINT_KEY = "fingerprint"
#: A drifted client's fingerprint of its new data (drift-fingerprint = "recompute"), computed once.
DRIFTED_FINGERPRINT_KEY = "fingerprint-after-drift"


class ConditionalClient(FedcondClient):
    """A client of ``conditional`` (and its variants): FedAvg's behaviour, the model fed the fingerprint."""

    conditioned: ClassVar[bool] = True
    options = (head_fit.HEAD_FIT, NEWCOMER_FINGERPRINT)

    def fingerprinted_data(self) -> ClientData:
        """The data this client's fingerprint describes: its own; with ``newcomer-fingerprint =
        other-concept`` a newcomer's is a training client's of another concept (an ablation: the
        simulation reads that client's partition, which no real newcomer could)."""
        if not (self.is_newcomer and NEWCOMER_FINGERPRINT.of(self.run_config) == "other-concept"):
            return self.own_data
        config = self.run_config
        scenario = scenario_for(config)
        clusters = tuple(client.cluster for client in scenario.clients)
        own = clusters[self.own_data.partition_id]
        partner_cluster = other_concept_cluster(own, scenario.num_clusters, config.scenario, config.covariate_clusters)
        partner = mismatched_participant(clusters, config.num_training_clients, self.own_data.partition_id,
                                         partner_cluster)  # fmt: skip
        return cached_client_data(config, partner)

    def raw_fingerprint(self) -> np.ndarray:
        """The fingerprint before normalisation: with ``fingerprint-epsilon``, noised once, here, and
        only the noisy vector kept (the ledger records the release)."""
        recompute = self.data is not self.own_data and self.run_config.drift_fingerprint == "recompute"
        key = DRIFTED_FINGERPRINT_KEY if recompute else FINGERPRINT_KEY
        # Stale (or before any drift): the fingerprint of its own data, whenever it is first computed.
        data = self.data if recompute else self.fingerprinted_data()
        if key not in self.kept.state.array_records:
            vector = client_fingerprint(self.run_config, data)
            if self.privacy.private_fingerprint and fp.fingerprint_spec(self.run_config.fingerprint).needs_data:
                release = private_fingerprint(
                    vector, self.run_config.fingerprint, data.train_x, data.train_y,
                    data.num_classes, self.run_config.fingerprint_dim, self.privacy,
                )  # fmt: skip
                vector = release.vector
                ledger = self.kept.ledger()
                ledger.add(release.noise_multiplier, 1.0, 1)
                self.kept.save_ledger(ledger)
            self.kept.state.array_records[key] = ArrayRecord(numpy_ndarrays=[vector])
        return self.kept.state.array_records[key].to_numpy_ndarrays()[0]

    def condition(self, round_config: dict[str, object]) -> np.ndarray | None:
        """The normalised fingerprint the model is fed."""
        mean = std = None
        if self.run_config.normalisation == "federated":
            mean = array_from_bytes(round_config.get(FINGERPRINT_MEAN), FINGERPRINT_MEAN)
            std = array_from_bytes(round_config.get(FINGERPRINT_STD), FINGERPRINT_STD)
        return fp.normalise(self.raw_fingerprint(), self.run_config.normalisation, mean, std)

    def fit_instruction(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        if round_config.get(STEP) == STEP_STATISTICS:
            return self.statistics_contribution(round_config)
        return super().fit_instruction(parameters, round_config)

    def evaluate_received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        # Evaluate-in-fit: a head-fit=ridge training instruction carries a Gram matrix after the model.
        if head_fit.fits_by_ridge(self.run_config):
            parameters = head_fit.split_instruction(parameters, len(self.model.state_dict()))[0]
        return super().evaluate_received(parameters, round_config)

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        if not head_fit.fits_by_ridge(self.run_config):
            return super().train_round(parameters, round_config)
        # head-fit=ridge: the generated head trains as a plain layer; the instruction is the model and a
        # zero Gram matrix, and the reply the trunk, the sent generator plus s~ (x) dH in the output layer's
        # arrays, then the sent Gram plus s~ s~^T: each array minus the instruction's is the trunk's update
        # or a product (fedcond/model/head_fit.py), which client-level DP's clipping bounds together.
        model_arrays, sent_gram = head_fit.split_instruction(parameters, len(self.model.state_dict()))
        self.receive(self.model, model_arrays)
        indices = head_fit.head_indices(list(self.model.state_dict()))
        sent_generator = head_fit.generator_of(*(model_arrays[index] for index in indices))
        condition = head_fit.augmented(self.condition(round_config), self.model.condition_scale)
        with head_fit.PlainHead(self.model, condition) as head:
            loss = self.train_locally(self.model, round_config, term=self.local_term(model_arrays))
        arrays = get_weights(self.model)
        moment, gram = head_fit.client_products(condition, head.change())
        for index, array in zip(indices, head_fit.generator_arrays(sent_generator + moment, np.float32), strict=True):
            arrays[index] = array
        return [*arrays, (sent_gram + gram).astype(np.float32)], len(self.data.train_y), {TRAIN_LOSS: loss}

    def statistics_contribution(self, round_config: dict[str, object]) -> Fitted:
        """(f, f^2, 1) of the raw fingerprint as exact digits, weight 1: what SecAgg+ sums before round 1
        (a training instruction that only SecAgg+'s mod delivers: fedcond/federation/secagg_mod.py).
        Under client-level DP the instruction names a bound, and (f, f^2) is clipped to it: the server
        noises the sum for that bound."""
        clip = float(round_config.get(STATISTICS_CLIPPING_NORM, 0.0))  # type: ignore[arg-type]
        vector = statistics_encoding.statistics_vector(self.raw_fingerprint(), clip)
        return [statistics_encoding.encode(vector)], 1, {}


#: The class the ClientApp finds for this method by its name (fedcond.federation.client_app.client_class).
Client = ConditionalClient

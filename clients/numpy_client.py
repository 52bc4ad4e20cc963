"""The fedcond client: trains the shared (optionally fingerprint-conditioned) CNN on local data.

``FedcondClient`` is the behaviour of fedavg, conditional, oracle, gossip and dac (train what you
receive, return it); ``local``, ``ditto`` and ``ifca`` subclass it in their own modules.
"""

from __future__ import annotations

import numpy as np
from flwr.client import NumPyClient
from flwr.common import ArrayRecord, ConfigRecord, Context

from fedcond import fingerprint as fp
from fedcond import secure_sum
from fedcond.client_data import ClientData, client_fingerprint
from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.models import ConditionalCNN, build_run_model, get_weights, set_weights
from fedcond.protocol import (
    ACCURACY,
    CLUSTER,
    ERROR,
    FINGERPRINT_MEAN,
    FINGERPRINT_STD,
    PARTITION_ID,
    PUBLIC_KEY,
    PUBLIC_KEYS,
    SERVER_ROUND,
    SESSION,
    SHARE,
    STEP,
    STEP_IDENTITY,
    STEP_KEYS,
    STEP_SHARE,
    TRAIN_LOSS,
)
from fedcond.training import ProximalTerm, TrainSettings, evaluate, train
from fedcond.wire import UINT64, array_from_bytes, array_to_bytes

FINGERPRINT_KEY = "fingerprint"
SECURE_SUM_KEY = "secure-sum"


class FedcondClient(NumPyClient):
    """A client of ``fedavg`` (plain backbone) or ``conditional`` (backbone fed the fingerprint).

    Flower rebuilds the client for every message, so everything that must outlive one message (the
    fingerprint, the secure-sum key) lives in ``context.state``, never on ``self``.
    """

    def __init__(self, config: RunConfig, data: ClientData, context: Context, conditioned: bool) -> None:
        config = config.resolved()
        self.config = config
        self.data = data
        self.state = context.state
        self.conditioned = conditioned
        self.model = self.fresh_model()
        self.train_settings = TrainSettings(
            epochs=config.local_epochs,
            batch_size=config.batch_size,
            learning_rate=config.learning_rate,
            momentum=config.momentum,
        )

    def fresh_model(self) -> ConditionalCNN:
        """The seeded initial model: identical on every client and on the server."""
        return build_run_model(self.config, self.data.num_classes, self.conditioned)

    def stored_model(self, key: str) -> ConditionalCNN | None:
        """A model this client keeps between rounds in ``context.state`` (None before the first save)."""
        if key not in self.state.array_records:
            return None
        model = self.fresh_model()
        set_weights(model, self.state.array_records[key].to_numpy_ndarrays())
        return model

    def store_model(self, key: str, model: ConditionalCNN) -> None:
        self.state.array_records[key] = ArrayRecord(numpy_ndarrays=get_weights(model))

    def round_seed(self, config: dict[str, object], stream: int = 0) -> int:
        """Batch-order seed of this client in this round: independent of scheduling, so reproducible."""
        server_round = int(config.get(SERVER_ROUND, 0))
        sequence = np.random.SeedSequence([self.config.seed, server_round, self.data.partition_id, stream])
        return int(sequence.generate_state(1)[0])

    def train_locally(
        self,
        model: ConditionalCNN,
        config: dict[str, object],
        settings: TrainSettings | None = None,
        stream: int = 0,
        proximal: ProximalTerm | None = None,
    ) -> float:
        """Train ``model`` on this client's data (``stream`` separates several trainings per round)."""
        return train(
            model, self.data.train_x, self.data.train_y, self.condition(config), settings or self.train_settings,
            self.round_seed(config, stream), proximal,
        )  # fmt: skip

    def evaluate_model(self, model: ConditionalCNN, config: dict[str, object]) -> tuple[float, int, dict[str, object]]:
        result = evaluate(model, self.data.test_x, self.data.test_y, self.condition(config))
        return result.loss, result.num_samples, {**self.identity_metrics(), ACCURACY: result.accuracy}

    # -- the fingerprint: computed once, on local training data only, kept in client state --------
    def raw_fingerprint(self) -> np.ndarray:
        if FINGERPRINT_KEY not in self.state.array_records:
            vector = client_fingerprint(self.config, self.data)
            self.state.array_records[FINGERPRINT_KEY] = ArrayRecord(numpy_ndarrays=[vector])
        return self.state.array_records[FINGERPRINT_KEY].to_numpy_ndarrays()[0]

    def condition(self, config: dict[str, object]) -> np.ndarray | None:
        """The normalised fingerprint the model is fed, or None for an unconditioned method."""
        if not self.conditioned:
            return None
        mean = std = None
        if self.config.normalisation == "federated":
            mean = array_from_bytes(config.get(FINGERPRINT_MEAN), FINGERPRINT_MEAN)
            std = array_from_bytes(config.get(FINGERPRINT_STD), FINGERPRINT_STD)
        return fp.normalise(self.raw_fingerprint(), self.config.normalisation, mean, std)

    # -- Flower's entry points: a FedcondError becomes a one-line report, not a traceback ---------------
    def fit(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[list[np.ndarray], int, dict[str, object]]:
        try:
            return self.train_round(parameters, config)
        except FedcondError as error:
            return [], 0, {ERROR: str(error)}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, object]) -> tuple[float, int, dict[str, object]]:
        try:
            return self.evaluate_round(parameters, config)
        except FedcondError as error:
            return 0.0, 0, {ERROR: str(error)}

    def get_properties(self, config: dict[str, object]) -> dict[str, object]:
        try:
            return self.setup_step(config)
        except FedcondError as error:
            return {ERROR: str(error)}

    # -- setup: secure sum of (f, f^2, 1) for federated normalisation ---------------------------------
    def setup_step(self, config: dict[str, object]) -> dict[str, object]:
        step = config.get(STEP)
        if step == STEP_IDENTITY:
            # Ground truth for Oracle (a reference, not a competitor) and for reporting only.
            return self.identity_metrics()
        if step == STEP_KEYS:
            private_key = secure_sum.new_private_key()
            self.state.config_records[SECURE_SUM_KEY] = ConfigRecord({"private-key": private_key})
            return {PUBLIC_KEY: secure_sum.public_key(private_key)}
        if step == STEP_SHARE:
            if SECURE_SUM_KEY not in self.state.config_records:
                raise FedcondError("secure sum share requested before key exchange; restart the run")
            private_key = self.state.config_records[SECURE_SUM_KEY]["private-key"]
            raw = self.raw_fingerprint()
            values = np.concatenate([raw, raw**2, [1.0]])
            share = secure_sum.masked_share(values, private_key, config[PUBLIC_KEYS], config[SESSION])
            del self.state.config_records[SECURE_SUM_KEY]
            return {SHARE: array_to_bytes(share, UINT64)}
        raise FedcondError(f"unknown setup step {step!r}; server and client run different fedcond versions")

    # -- federated rounds --------------------------------------------------------------------------------
    def identity_metrics(self) -> dict[str, int]:
        # The cluster id is ground truth sent for reporting (per-cluster accuracy) only.
        return {PARTITION_ID: self.data.partition_id, CLUSTER: self.data.cluster}

    def train_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[list[np.ndarray], int, dict[str, object]]:
        set_weights(self.model, parameters)
        server_round = int(config.get(SERVER_ROUND, 0))
        seed = int(
            np.random.SeedSequence([self.config.seed, server_round, self.data.partition_id]).generate_state(1)[0]
        )
        loss = train(
            self.model, self.data.train_x, self.data.train_y, self.condition(config), self.train_settings, seed
        )
        return get_weights(self.model), len(self.data.train_y), {**self.identity_metrics(), TRAIN_LOSS: loss}

    def evaluate_round(
        self, parameters: list[np.ndarray], config: dict[str, object]
    ) -> tuple[float, int, dict[str, object]]:
        set_weights(self.model, parameters)
        result = evaluate(self.model, self.data.test_x, self.data.test_y, self.condition(config))
        return result.loss, result.num_samples, {**self.identity_metrics(), ACCURACY: result.accuracy}

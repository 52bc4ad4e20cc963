"""What a client keeps between messages: its models and arrays, and its privacy ledger.

Flower rebuilds the client for every message, so whatever must outlive one message lives in the
node's ``context.state`` (or, with ``client-state-dir``, in the client's own files:
``fedcond.model.store.ClientModelFiles``), never on the client object.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from flwr.common import ArrayRecord, ConfigRecord, RecordDict

from fedcond.federation.messages import EPSILON, TRAIN_LOSS
from fedcond.model.networks import Network, get_weights, set_weights
from fedcond.model.store import ClientModelFiles
from fedcond.privacy.dp import PrivacyLedger, SampleLevelPrivacy

#: Every DP mechanism this client ran on its training data (fedcond.privacy.dp.PrivacyLedger), in its state.
PRIVACY_LEDGER_KEY = "privacy-ledger"


class KeptState:
    """A client's arrays kept between rounds (a model's, a control variate's, its batch-norm layers),
    in ``context.state`` or its ``client-state-dir`` files, and its privacy ledger."""

    def __init__(self, state: RecordDict, files: ClientModelFiles | None) -> None:
        self.state = state
        self.files = files

    def arrays(self, key: str) -> list[np.ndarray] | None:
        """The arrays kept under ``key`` (None before the first ``put``)."""
        if self.files is not None:
            return self.files.get(key)
        if key in self.state.array_records:
            return self.state.array_records[key].to_numpy_ndarrays()
        return None

    def put(self, key: str, arrays: list[np.ndarray]) -> None:
        if self.files is not None:
            self.files.put(key, arrays)
        else:
            self.state.array_records[key] = ArrayRecord(numpy_ndarrays=arrays)

    def model(self, key: str, build: Callable[[], Network]) -> Network | None:
        """The model kept under ``key``, loaded into a model from ``build`` (None before the first save)."""
        weights = self.arrays(key)
        if weights is None:
            return None
        model = build()
        set_weights(model, weights)
        return model

    def put_model(self, key: str, model: Network) -> None:
        self.put(key, get_weights(model))

    def ledger(self) -> PrivacyLedger:
        """What this client has spent of its privacy so far (empty before its first DP mechanism)."""
        if PRIVACY_LEDGER_KEY not in self.state.config_records:
            return PrivacyLedger()
        return PrivacyLedger.from_record(dict(self.state.config_records[PRIVACY_LEDGER_KEY]))  # type: ignore[arg-type]

    def save_ledger(self, ledger: PrivacyLedger) -> None:
        if ledger.entries:
            self.state.config_records[PRIVACY_LEDGER_KEY] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    def privacy_metrics(self, privacy: SampleLevelPrivacy) -> dict[str, object]:
        """With any sample-level DP setting: ``EPSILON``, the composed epsilon of everything this client
        has released (inf when its training is not DP-SGD: the updates then are not private), and,
        under DP-SGD, the training loss withheld (NaN): it is computed from the data without noise."""
        if not privacy.enabled:
            return {}
        if not privacy.dp_sgd:
            return {EPSILON: math.inf}
        return {EPSILON: self.ledger().epsilon(privacy.delta), TRAIN_LOSS: math.nan}

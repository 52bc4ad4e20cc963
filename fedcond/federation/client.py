"""The fedcond client: trains the shared CNN on local data.

``FedcondClient`` is FedAvg's client (train what you receive, return it); every method's client in
``clients/<method>.py`` is this class or a subclass that overrides only what differs.

Names: ``run_config`` is the run's ``RunConfig``; ``round_config`` is the dict Flower delivers with
each instruction (the round number, the federation's fingerprint statistics, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import ClassVar

import numpy as np
from flwr.client import NumPyClient
from flwr.common import ArrayRecord, ConfigRecord, Context

from fedcond.config import Option, RunConfig
from fedcond.data.client_data import ClientData, cached_client_data, reuse_enabled
from fedcond.data.scenarios import drift_partners_of
from fedcond.errors import FedcondError
from fedcond.federation.messages import (
    ACCURACY,
    ADAPTED_ACCURACY,
    CLASS_CORRECT,
    CLASS_COUNT,
    EPSILON,
    ERROR,
    EVALUATE_FIRST,
    EVALUATED_ACCURACY,
    EVALUATED_EXAMPLES,
    EVALUATED_LOSS,
    INT64,
    PARTITION_ID,
    SERVER_ROUND,
    STEP,
    STEP_IDENTITY,
    TRAIN_LOSS,
    VALIDATION_ACCURACY,
    VALIDATION_EXAMPLES,
    VALIDATION_KEYS,
    array_to_bytes,
)
from fedcond.model import feature_norm
from fedcond.model.networks import Network, build_run_model, get_weights, set_weights
from fedcond.model.store import CLIENT_STATE_DIR, ClientModelFiles
from fedcond.model.training import DpSgd, EvalResult, LocalTerm, TrainSettings, evaluate, train, train_private
from fedcond.newcomers import NEWCOMER_STEPS, step_indices
from fedcond.privacy.dp import PrivacyLedger, SampleLevelPrivacy
from fedcond.records.metrics import PER_CLASS_ACCURACY

#: Every DP mechanism this client ran on its training data (fedcond.privacy.dp.PrivacyLedger), in its state.
PRIVACY_LEDGER_KEY = "privacy-ledger"
#: A client that keeps its own batch-norm layers (``keeps_local_norm``): them, in its state.
LOCAL_NORM_KEY = "local-batch-norm"

Fitted = tuple[list[np.ndarray], int, dict[str, object]]
Evaluated = tuple[float, int, dict[str, object]]


@functools.lru_cache(maxsize=4)
def _reusable_model(run_config: RunConfig, num_classes: int, conditioned: bool, thread: int) -> Network:
    # One model per thread and run, shared by every client the thread serves: each message sets all
    # of its state (parameters and buffers) before using it, so nothing carries over between
    # clients. A Ray actor handles one message at a time in one thread; a runtime that handles
    # messages in several threads of one process (the tests' in-process backend) gets one per thread.
    # Saves building the CNN per message.
    return build_run_model(run_config, num_classes, conditioned)


class FedcondClient(NumPyClient):
    """A client of ``fedavg``: trains the plain backbone it receives and returns it.

    Flower rebuilds the client for every message, so everything that must outlive one message (a
    personal model, the privacy ledger, the fingerprint; SecAgg+'s mod keeps its keys there too)
    lives in ``context.state``, never on ``self``.

    What a client sends says nothing of its cluster: fit replies carry the model (or, for IFCA, also
    its choice), the training loss and, with sample-level DP, the epsilon spent; evaluate replies the
    loss and accuracy on its test set. The one identity answer, before round 1, is the partition id
    the node's operator configured: the node's name, by which the server keeps per-client state.
    """

    #: Whether the model this client trains takes a fingerprint (``ConditionalClient``): the method's
    #: model, as the server builds it too (``fedcond.federation.methods.Method.conditioned``).
    conditioned: ClassVar[bool] = False

    #: Run-config settings of this client behaviour, declared here rather than in a central list.
    options: ClassVar[tuple[Option, ...]] = ()
    #: What else this client sends that depends on its training data, beyond what ``train_locally``
    #: (or the fingerprint) makes: DP-SGD's guarantee covers none of it ("": nothing else).
    released_beyond_training: ClassVar[str] = ""
    #: What this client keeps in ``context.state`` that a resumed run does not get back (a resume is
    #: a new Flower run, whose ``context.state`` starts empty); empty when nothing is lost (the
    #: fingerprint is computed again from the same data, SecAgg+'s keys live one aggregation).
    state_lost_on_resume: ClassVar[str] = ""

    def __init__(self, run_config: RunConfig, data: ClientData, context: Context) -> None:
        run_config = run_config.resolved()
        self.run_config = run_config
        #: This client's own partition; ``data`` is what it holds in the round of the message at hand
        #: (a drifting client holds its partner's from ``drift-round`` on: ``hold_round_data``).
        self.own_data = data
        self.data = data
        self.state = context.state
        # With client-state-dir, the models this client keeps go to its own files instead of
        # context.state, which a simulation holds in memory for every virtual node.
        state_dir = CLIENT_STATE_DIR.of(run_config)
        self.model_files = ClientModelFiles(state_dir, context.run_id, data.partition_id) if state_dir else None
        self.model = self.working_model()
        self.train_settings = TrainSettings.of(run_config)
        self.privacy = SampleLevelPrivacy.of(run_config)

    def fresh_model(self) -> Network:
        """The seeded initial model: identical on every client and on the server."""
        return build_run_model(self.run_config, self.data.num_classes, self.conditioned)

    def working_model(self) -> Network:
        """The model the received weights are loaded into: reused between messages within a process.

        Only for weights set from a message (``set_weights`` overwrites every parameter and buffer);
        a model that must start from the seeded initial weights is ``fresh_model``.
        """
        if not reuse_enabled():
            return self.fresh_model()
        return _reusable_model(self.run_config, self.data.num_classes, self.conditioned, threading.get_ident())

    def stored_arrays(self, key: str) -> list[np.ndarray] | None:
        """Arrays this client keeps between rounds (a model's, a control variate's), in
        ``context.state`` or its ``client-state-dir`` files (None before the first save)."""
        if self.model_files is not None:
            return self.model_files.get(key)
        if key in self.state.array_records:
            return self.state.array_records[key].to_numpy_ndarrays()
        return None

    def store_arrays(self, key: str, arrays: list[np.ndarray]) -> None:
        if self.model_files is not None:
            self.model_files.put(key, arrays)
        else:
            self.state.array_records[key] = ArrayRecord(numpy_ndarrays=arrays)

    def stored_model(self, key: str) -> Network | None:
        """A model this client keeps between rounds (``stored_arrays``; None before the first save)."""
        weights = self.stored_arrays(key)
        if weights is None:
            return None
        model = self.fresh_model()
        set_weights(model, weights)
        return model

    def store_model(self, key: str, model: Network) -> None:
        self.store_arrays(key, get_weights(model))

    def round_seed(self, round_config: dict[str, object]) -> int:
        """Batch-order seed of this client in this round: independent of scheduling, so reproducible."""
        server_round = int(round_config.get(SERVER_ROUND, 0))
        sequence = np.random.SeedSequence([self.run_config.seed, server_round, self.data.partition_id])
        return int(sequence.generate_state(1)[0])

    def train_locally(
        self,
        model: Network,
        round_config: dict[str, object],
        settings: TrainSettings | None = None,
        term: LocalTerm | None = None,
    ) -> float:
        """Train ``model`` on this client's data in this round's batch order; the last epoch's mean loss.
        ``term`` is what the method adds to each local step (``fedcond.model.training.LocalTerm``).

        With ``dp-noise-multiplier`` > 0, DP-SGD instead (random batches, see ``train_private``), its
        steps added to this client's privacy ledger.
        """
        condition = self.condition(round_config)  # first: a DP fingerprint enters the ledger when made
        if self.privacy.dp_sgd:
            ledger = self.privacy_ledger()
            dp_sgd = DpSgd(self.privacy.noise_multiplier, self.privacy.max_grad_norm)
            loss = train_private(
                model, self.data.train_x, self.data.train_y, condition, settings or self.train_settings, dp_sgd,
                ledger, term,
            )  # fmt: skip
            self.save_privacy_ledger(ledger)
            return loss
        return train(
            model, self.data.train_x, self.data.train_y, condition, settings or self.train_settings,
            self.round_seed(round_config), term,
        )  # fmt: skip

    def evaluate_model(self, model: Network, round_config: dict[str, object]) -> Evaluated:
        """``model`` on this client's test set, reported as Flower's evaluate expects."""
        condition = self.condition(round_config)
        result = self.evaluate_on(model, self.data.test_x, self.data.test_y, condition)
        metrics: dict[str, object] = {ACCURACY: result.accuracy}
        if self.data.has_validation:
            # The same model on the held-out share of the training data: what settings are chosen on.
            validation = self.evaluate_on(model, self.data.validation_x, self.data.validation_y, condition)
            metrics |= {VALIDATION_ACCURACY: validation.accuracy, VALIDATION_EXAMPLES: validation.num_samples}
        if self.scores_every_class(round_config) and result.class_correct is not None:
            counts = np.bincount(self.data.test_y, minlength=len(result.class_correct))
            metrics |= {CLASS_CORRECT: array_to_bytes(result.class_correct, INT64),
                        CLASS_COUNT: array_to_bytes(counts, INT64)}  # fmt: skip
        return result.loss, result.num_samples, metrics

    def scores_every_class(self, round_config: dict[str, object]) -> bool:
        """With ``per-class-accuracy``, in the final round: the reply also counts each class."""
        final = int(round_config.get(SERVER_ROUND, 0)) == self.run_config.num_server_rounds  # type: ignore[arg-type]
        return final and bool(PER_CLASS_ACCURACY.of(self.run_config))

    def evaluate_on(
        self, model: Network, images: np.ndarray, labels: np.ndarray, condition: np.ndarray | None
    ) -> EvalResult:
        """``fedcond.model.training.evaluate`` under this run's layout and task (a regression's RMSE)."""
        settings = self.train_settings
        return evaluate(model, images, labels, condition, settings.channels_last, settings.regression)

    def condition(self, round_config: dict[str, object]) -> np.ndarray | None:
        """What the model is fed beside the images: nothing here (``ConditionalClient`` feeds the fingerprint)."""
        return None

    # -- sample-level privacy: what the client has spent so far -----------------------------------------
    def privacy_ledger(self) -> PrivacyLedger:
        if PRIVACY_LEDGER_KEY not in self.state.config_records:
            return PrivacyLedger()
        return PrivacyLedger.from_record(dict(self.state.config_records[PRIVACY_LEDGER_KEY]))  # type: ignore[arg-type]

    def save_privacy_ledger(self, ledger: PrivacyLedger) -> None:
        if ledger.entries:
            self.state.config_records[PRIVACY_LEDGER_KEY] = ConfigRecord(ledger.to_record())  # type: ignore[arg-type]

    def privacy_metrics(self) -> dict[str, object]:
        """With any sample-level DP setting: ``EPSILON``, the composed epsilon of everything this client
        has released (inf when its training is not DP-SGD: the updates then are not private), and,
        under DP-SGD, the training loss withheld (NaN): it is computed from the data without noise."""
        if not self.privacy.enabled:
            return {}
        if not self.privacy.dp_sgd:
            return {EPSILON: math.inf}
        return {EPSILON: self.privacy_ledger().epsilon(self.privacy.delta), TRAIN_LOSS: math.nan}

    # -- Flower's entry points: a FedcondError becomes a one-line report, not a traceback ---------------
    def fit(self, parameters: list[np.ndarray], config: dict[str, object]) -> Fitted:
        try:
            self.hold_round_data(config)
            return self.fit_instruction(parameters, config)
        except FedcondError as error:
            return [], 0, {ERROR: str(error)}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, object]) -> Evaluated:
        try:
            self.hold_round_data(config)
            if self.is_newcomer:
                return self.evaluate_newcomer(parameters, config)
            return self.evaluate_round(parameters, config)
        except FedcondError as error:
            return 0.0, 0, {ERROR: str(error)}

    def get_properties(self, config: dict[str, object]) -> dict[str, object]:
        try:
            return self.answer_before_training(config)
        except FedcondError as error:
            return {ERROR: str(error)}

    # -- before round 1: who this node is, and its part of the fingerprint statistics ---------------
    def answer_before_training(self, question: dict[str, object]) -> dict[str, object]:
        if question.get(STEP) == STEP_IDENTITY:
            # The partition id its operator gave the node (--node-config): its name, not ground truth.
            return {PARTITION_ID: self.data.partition_id}
        raise FedcondError(
            f"unknown question {question.get(STEP)!r} before round 1; server and client run other fedcond versions"
        )

    def hold_round_data(self, round_config: dict[str, object]) -> None:
        """The data this client holds in the message's round: its own, or, if it drifts and the round is
        ``drift-round`` or later, its partner's (``fedcond.data.drift``), under its own partition id."""
        drift_round = self.run_config.drift_round
        server_round = int(round_config.get(SERVER_ROUND, 0))
        partner = drift_partners_of(self.run_config).get(self.own_data.partition_id) if drift_round else None
        if partner is None or server_round < drift_round:
            self.data = self.own_data
            return
        moved = cached_client_data(self.run_config, partner)
        self.data = dataclasses.replace(moved, partition_id=self.own_data.partition_id)

    @property
    def drifted(self) -> bool:
        return self.data is not self.own_data

    # -- federated rounds: what a method's client overrides --------------------------------------------
    def fit_instruction(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        """A training instruction: one round of training (a subclass may answer other steps). With
        ``EVALUATE_FIRST`` (evaluate-in-fit) the model the message brings is evaluated first, exactly as
        the last round's evaluate message would have evaluated it, and the result rides in the reply."""
        evaluated = self.evaluate_received(parameters, round_config) if round_config.get(EVALUATE_FIRST) else None
        weights, num_examples, metrics = self.train_round(parameters, round_config)
        if evaluated is not None:
            loss, examples, evaluation = evaluated
            metrics = {**metrics, EVALUATED_LOSS: loss, EVALUATED_EXAMPLES: examples,
                       EVALUATED_ACCURACY: evaluation[ACCURACY],
                       **{key: evaluation[key] for key in VALIDATION_KEYS if key in evaluation}}  # fmt: skip
        return weights, num_examples, {**metrics, **self.privacy_metrics()}

    def evaluate_received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        """What an evaluate message with the training instruction's parameters would answer (before this
        round's training changes any model the client keeps): ``evaluate_round`` unless a method's
        training instruction brings other parameters than its evaluate message (IFCA)."""
        return self.evaluate_round(parameters, round_config)

    # -- batch-norm layers kept by each client (FedBN; a newcomer recomputes their statistics: AdaBN) -----
    @property
    def keeps_local_norm(self) -> bool:
        """Whether this client keeps its own batch-norm layers (``fedcond.model.feature_norm``): with
        ``feature-norm=local-batch`` here; always for FedBN's client."""
        return self.run_config.feature_norm == "local-batch"

    def receive(self, model: Network, parameters: list[np.ndarray]) -> None:
        """Load the model a message brings into ``model``; a client that keeps its own batch-norm
        layers puts them back in place of the received ones (from its second round on)."""
        set_weights(model, parameters)
        kept = self.stored_arrays(LOCAL_NORM_KEY) if self.keeps_local_norm else None
        if kept is not None:
            feature_norm.load_local_state(model, kept)

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        self.receive(self.model, parameters)
        loss = self.train_locally(self.model, round_config, term=self.local_term(parameters))
        self.keep_local_norm()
        return get_weights(self.model), len(self.data.train_y), {TRAIN_LOSS: loss}

    def keep_local_norm(self) -> None:
        """After training: a client that keeps its own batch-norm layers stores them (``receive``
        puts them back next round)."""
        if self.keeps_local_norm:
            self.store_arrays(LOCAL_NORM_KEY, feature_norm.local_state(self.model))

    def local_term(self, parameters: list[np.ndarray]) -> LocalTerm | None:
        """What this method adds to each local step of the model it received (FedProx's pull towards
        it); nothing here."""
        return None

    def evaluate_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        self.receive(self.model, parameters)
        return self.evaluate_model(self.model, round_config)

    # -- newcomers (held-out clients): the model a method serves a client that never trained -----------
    @property
    def is_newcomer(self) -> bool:
        """A held-out client: partition ids after the training clients' (it never trains)."""
        return self.data.partition_id >= self.run_config.num_training_clients

    def newcomer_model(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Network:
        """The model this method serves a newcomer, from what the server sends it: that model as it is
        (FedAvg's and Ditto's global model, Oracle's cluster model, Gossip's peer model; Conditional feeds
        it the newcomer's fingerprint). A method with another rule overrides this (fedcond.newcomers).
        A client that would keep its own batch-norm layers has none yet: their statistics are recomputed
        on its own unlabelled training images (AdaBN)."""
        set_weights(self.model, parameters)
        if self.keeps_local_norm:
            feature_norm.recompute_statistics(self.model, self.data.train_x, self.train_settings.channels_last)
        return self.model

    def evaluate_newcomer(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        """The served model scored untouched (zero-shot) and, with ``newcomer-steps``, a copy of it after
        that many SGD steps on the newcomer's own training data (``ADAPTED_ACCURACY``)."""
        served = self.newcomer_model(parameters, round_config)
        loss, examples, metrics = self.evaluate_model(served, round_config)
        steps = NEWCOMER_STEPS.of(self.run_config)
        if steps:
            metrics = {**metrics, ADAPTED_ACCURACY: self.adapted_accuracy(served, steps, round_config)}
        return loss, examples, metrics

    def adapted_accuracy(self, served: Network, steps: int, round_config: dict[str, object]) -> float:
        adapted = self.fresh_model()
        set_weights(adapted, get_weights(served))
        self.train_newcomer_steps(adapted, round_config, 0, steps)
        return self.evaluate_model(adapted, round_config)[2][ACCURACY]  # type: ignore[return-value]

    def train_newcomer_steps(self, model: Network, round_config: dict[str, object], first: int, count: int) -> float:
        """Train ``model`` for ``count`` SGD steps, on the samples of batches ``first`` to
        ``first + count - 1`` of this round's ``newcomer-steps`` seeded batches (``step_indices``); the
        pass's mean loss. Every method's newcomer adapts on the same samples."""
        seed, batch = self.round_seed(round_config), self.train_settings.batch_size
        chosen = step_indices(len(self.data.train_y), NEWCOMER_STEPS.of(self.run_config), batch, seed)
        chosen = chosen[first * batch : (first + count) * batch]
        one_pass = dataclasses.replace(self.train_settings, epochs=1)
        condition = self.condition(round_config)
        return train(model, self.data.train_x[chosen], self.data.train_y[chosen], condition, one_pass, seed)

    def split_models(self, parameters: list[np.ndarray]) -> list[list[np.ndarray]]:
        """A message of several models (IFCA's K, DAC's peers) as models."""
        per_model = len(self.model.state_dict())
        if not parameters or len(parameters) % per_model:
            raise FedcondError(
                f"a {self.run_config.method} client received a partial set of models; server and client disagree "
                "on the model"
            )
        return [parameters[i : i + per_model] for i in range(0, len(parameters), per_model)]

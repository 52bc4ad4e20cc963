"""The fedcond client: trains the shared CNN on local data.

``FedcondClient`` is FedAvg's client (train what you receive, return it); every method's client in
``clients/<method>.py`` is this class or a subclass that overrides only what differs.

Names: ``run_config`` is the run's ``RunConfig``; ``round_config`` is the dict Flower delivers with
each instruction (the round number, the federation's fingerprint statistics, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import ClassVar

import numpy as np
from flwr.client import NumPyClient
from flwr.common import Context

from fedcond.config import Option, RunConfig
from fedcond.data.client_data import ClientData, cached_client_data, reuse_enabled
from fedcond.data.scenarios import drift_partners_of
from fedcond.errors import FedcondError
from fedcond.federation.client_state import KeptState
from fedcond.federation.messages import (
    ACCURACY,
    ADAPTED_ACCURACY,
    CLASS_CORRECT,
    CLASS_COUNT,
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
from fedcond.privacy.dp import SampleLevelPrivacy
from fedcond.records.metrics import PER_CLASS_ACCURACY

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


def evaluate_with(
    settings: TrainSettings, model: Network, images: np.ndarray, labels: np.ndarray, condition: np.ndarray | None
) -> EvalResult:
    """``fedcond.model.training.evaluate`` under a run's layout and task (a regression's RMSE)."""
    return evaluate(model, images, labels, condition, settings.channels_last, settings.regression)


def scores_every_class(run_config: RunConfig, round_config: dict[str, object]) -> bool:
    """With ``per-class-accuracy``, in the final round: the reply also counts each class."""
    final = int(round_config.get(SERVER_ROUND, 0)) == run_config.num_server_rounds  # type: ignore[call-overload]
    return final and bool(PER_CLASS_ACCURACY.of(run_config))


def data_in_round(run_config: RunConfig, own_data: ClientData, round_config: dict[str, object]) -> ClientData:
    """The data a client holds in the message's round: its own, or, if it drifts and the round is
    ``drift-round`` or later, its partner's (``fedcond.data.drift``), under its own partition id."""
    drift_round = run_config.drift_round
    server_round = int(round_config.get(SERVER_ROUND, 0))
    partner = drift_partners_of(run_config).get(own_data.partition_id) if drift_round else None
    if partner is None or server_round < drift_round:
        return own_data
    moved = cached_client_data(run_config, partner)
    return dataclasses.replace(moved, partition_id=own_data.partition_id)


def split_models(parameters: list[np.ndarray], model: Network, method: str) -> list[list[np.ndarray]]:
    """A message of several models of ``model``'s shape (IFCA's K, DAC's peers) as models."""
    per_model = len(model.state_dict())
    if not parameters or len(parameters) % per_model:
        raise FedcondError(
            f"a {method} client received a partial set of models; server and client disagree on the model"
        )
    return [parameters[i : i + per_model] for i in range(0, len(parameters), per_model)]


class FedcondClient(NumPyClient):
    """A client of ``fedavg``: trains the plain backbone it receives and returns it.

    Flower rebuilds the client for every message, so everything that must outlive one message (a
    personal model, the privacy ledger, the fingerprint; SecAgg+'s mod keeps its keys there too)
    lives in ``context.state`` (``self.kept``: ``fedcond.federation.client_state``), never on ``self``.

    A method's client overrides only its hooks: ``train_round`` and ``evaluate_round`` (what one
    training and one evaluation instruction do with the parameters received), ``local_term`` (what it
    adds to each local step), ``condition`` (what the model is fed beside the images),
    ``newcomer_model`` / ``evaluate_newcomer`` (what a client that never trained is served),
    ``answer_before_training`` and ``evaluate_received``. The protocol does the rest for every method:
    the round's data (drift), evaluate-in-fit, the privacy metrics, a one-line error in place of a
    traceback, and a client's own batch-norm layers (put back by ``receive``, kept after every
    training instruction).

    What a client sends says nothing of its cluster: fit replies carry the model (or, for IFCA, also
    its choice), the training loss and, with sample-level DP, the epsilon spent; evaluate replies the
    loss and accuracy on its test set. The one identity answer, before round 1, is the partition id
    the node's operator configured: the node's name, by which the server keeps per-client state.
    """

    #: Whether the model this client trains takes a fingerprint (``ConditionalClient``): the method's
    #: model, as the server builds it too (``fedcond.federation.methods.Method.conditioned``).
    conditioned: ClassVar[bool] = False
    #: Whether this method's clients always keep their own batch-norm layers (FedBN); otherwise only
    #: with ``feature-norm=local-batch`` (``fedcond.model.feature_norm``).
    always_keeps_local_norm: ClassVar[bool] = False

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
        #: (a drifting client holds its partner's from ``drift-round`` on: ``data_in_round``).
        self.own_data = data
        self.data = data
        # With client-state-dir, the models this client keeps go to its own files instead of
        # context.state, which a simulation holds in memory for every virtual node.
        state_dir = CLIENT_STATE_DIR.of(run_config)
        files = ClientModelFiles(state_dir, context.run_id, data.partition_id) if state_dir else None
        self.kept = KeptState(context.state, files)
        # The model the received weights are loaded into: reused between messages within a process.
        # Only for weights set from a message (``set_weights`` overwrites every parameter and buffer);
        # a model that must start from the seeded initial weights is ``fresh_model``.
        self.model = (
            _reusable_model(run_config, data.num_classes, self.conditioned, threading.get_ident())
            if reuse_enabled() else self.fresh_model()
        )  # fmt: skip
        self.train_settings = TrainSettings.of(run_config)
        self.privacy = SampleLevelPrivacy.of(run_config)
        #: Whether this client keeps its own batch-norm layers (``receive`` puts them back, the
        #: protocol keeps them after every training instruction).
        self.keeps_local_norm = self.always_keeps_local_norm or run_config.feature_norm == "local-batch"

    def fresh_model(self) -> Network:
        """The seeded initial model: identical on every client and on the server."""
        return build_run_model(self.run_config, self.data.num_classes, self.conditioned)

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
            ledger = self.kept.ledger()
            dp_sgd = DpSgd(self.privacy.noise_multiplier, self.privacy.max_grad_norm)
            loss = train_private(
                model, self.data.train_x, self.data.train_y, condition, settings or self.train_settings, dp_sgd,
                ledger, term,
            )  # fmt: skip
            self.kept.save_ledger(ledger)
            return loss
        return train(
            model, self.data.train_x, self.data.train_y, condition, settings or self.train_settings,
            self.round_seed(round_config), term,
        )  # fmt: skip

    def evaluate_model(self, model: Network, round_config: dict[str, object]) -> Evaluated:
        """``model`` on this client's test set, reported as Flower's evaluate expects."""
        condition = self.condition(round_config)
        result = evaluate_with(self.train_settings, model, self.data.test_x, self.data.test_y, condition)
        metrics: dict[str, object] = {ACCURACY: result.accuracy}
        if self.data.has_validation:
            # The same model on the held-out share of the training data: what settings are chosen on.
            validation = evaluate_with(
                self.train_settings, model, self.data.validation_x, self.data.validation_y, condition
            )
            metrics |= {VALIDATION_ACCURACY: validation.accuracy, VALIDATION_EXAMPLES: validation.num_samples}
        if scores_every_class(self.run_config, round_config) and result.class_correct is not None:
            counts = np.bincount(self.data.test_y, minlength=len(result.class_correct))
            metrics |= {CLASS_CORRECT: array_to_bytes(result.class_correct, INT64),
                        CLASS_COUNT: array_to_bytes(counts, INT64)}  # fmt: skip
        return result.loss, result.num_samples, metrics

    def condition(self, round_config: dict[str, object]) -> np.ndarray | None:
        """What the model is fed beside the images: nothing here (``ConditionalClient`` feeds the fingerprint)."""
        return None

    # -- Flower's entry points: a FedcondError becomes a one-line report, not a traceback ---------------
    def fit(self, parameters: list[np.ndarray], config: dict[str, object]) -> Fitted:
        try:
            self.data = data_in_round(self.run_config, self.own_data, config)
            return self.fit_instruction(parameters, config)
        except FedcondError as error:
            return [], 0, {ERROR: str(error)}

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, object]) -> Evaluated:
        try:
            self.data = data_in_round(self.run_config, self.own_data, config)
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

    # -- federated rounds: what a method's client overrides --------------------------------------------
    def fit_instruction(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        """A training instruction: one round of training (a subclass may answer other steps). With
        ``EVALUATE_FIRST`` (evaluate-in-fit) the model the message brings is evaluated first, exactly as
        the last round's evaluate message would have evaluated it, and the result rides in the reply.
        A client that keeps its own batch-norm layers keeps them as training left them, whatever the
        method's ``train_round`` did."""
        evaluated = self.evaluate_received(parameters, round_config) if round_config.get(EVALUATE_FIRST) else None
        weights, num_examples, metrics = self.train_round(parameters, round_config)
        if self.keeps_local_norm:
            self.kept.put(LOCAL_NORM_KEY, feature_norm.local_state(self.model))
        if evaluated is not None:
            loss, examples, evaluation = evaluated
            metrics = {**metrics, EVALUATED_LOSS: loss, EVALUATED_EXAMPLES: examples,
                       EVALUATED_ACCURACY: evaluation[ACCURACY],
                       **{key: evaluation[key] for key in VALIDATION_KEYS if key in evaluation}}  # fmt: skip
        return weights, num_examples, {**metrics, **self.kept.privacy_metrics(self.privacy)}

    def evaluate_received(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Evaluated:
        """What an evaluate message with the training instruction's parameters would answer (before this
        round's training changes any model the client keeps): ``evaluate_round`` unless a method's
        training instruction brings other parameters than its evaluate message (IFCA)."""
        return self.evaluate_round(parameters, round_config)

    def receive(self, model: Network, parameters: list[np.ndarray]) -> None:
        """Load the model a message brings into ``model``; a client that keeps its own batch-norm
        layers puts them back in place of the received ones (from its second round on)."""
        set_weights(model, parameters)
        kept = self.kept.arrays(LOCAL_NORM_KEY) if self.keeps_local_norm else None
        if kept is not None:
            feature_norm.load_local_state(model, kept)

    def train_round(self, parameters: list[np.ndarray], round_config: dict[str, object]) -> Fitted:
        """Train ``self.model`` from the parameters received; its weights, sample count and metrics."""
        self.receive(self.model, parameters)
        loss = self.train_locally(self.model, round_config, term=self.local_term(parameters))
        return get_weights(self.model), len(self.data.train_y), {TRAIN_LOSS: loss}

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
            adapted = self.fresh_model()
            set_weights(adapted, get_weights(served))
            self.train_newcomer_steps(adapted, round_config, 0, steps)
            metrics = {**metrics, ADAPTED_ACCURACY: self.evaluate_model(adapted, round_config)[2][ACCURACY]}
        return loss, examples, metrics

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

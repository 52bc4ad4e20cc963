"""Round bookkeeping every fedcond strategy shares: time, bytes, who answered, evaluations, printing."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TypeVar

from flwr.common import Code, EvaluateRes, FitRes, Parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from fedcond.config import Option
from fedcond.federation.exchange import failure_reason
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.messages import (
    ACCURACY,
    ADAPTED_ACCURACY,
    CLASS_CORRECT,
    CLASS_COUNT,
    EPSILON,
    ERROR,
    INT64,
    TRAIN_LOSS,
    VALIDATION_ACCURACY,
    VALIDATION_EXAMPLES,
    array_from_bytes,
)
from fedcond.federation.participation import Failure, RoundParticipation
from fedcond.model.aggregation import StreamingAverage
from fedcond.model.training import check_not_diverged
from fedcond.records.history import RoundRecord, RunRecorder
from fedcond.records.metrics import ClientEvaluation, Spread, class_accuracy, summarise_evaluations, weighted_mean

Failures = list[tuple[ClientProxy, FitRes] | tuple[ClientProxy, EvaluateRes] | BaseException]
Reply = TypeVar("Reply", FitRes, EvaluateRes)

MIN_ANSWERED_FRACTION = Option(
    "min-answered-fraction",
    0.8,
    "the fraction of a round's clients that must answer for the run to go on (Oracle, IFCA: also one per model)",
    minimum=0,
    maximum=1,
)
#: The tensor type of a fit reply whose model went into the round's running average on arrival.
FOLDED = "fedcond.folded"


def parameters_bytes(parameters: Parameters) -> int:
    return sum(len(tensor) for tensor in parameters.tensors)


def answered_replies(
    stage: str,
    results: Sequence[tuple[ClientProxy, Reply]],
    failures: Failures,
    participation: RoundParticipation,
) -> list[tuple[int, Reply]]:
    """The replies that answered ``stage``, as (partition id, reply) in partition order (float sums
    then do not depend on which client finished first); every other outcome goes to ``participation``.

    A reply carrying the client's own ``ERROR`` metric is a failure with that reason; so is a reply
    whose status is not OK. An exception (the client's, the transport's, an expired message) was
    recorded by the ``PartitionProxy`` it went through, which alone knows whose it was.
    """
    answered = []
    for proxy, res in results:
        partition = partition_of(proxy)
        if ERROR in res.metrics:
            participation.fail(stage, partition, str(res.metrics[ERROR]))
        else:
            answered.append((partition, res))
    for failure in failures:
        if not isinstance(failure, BaseException):
            participation.fail(stage, partition_of(failure[0]), failure_reason(failure[1].status.message))
    return sorted(answered, key=lambda pair: pair[0])


def validation_accuracy(results: Sequence[tuple[int, EvaluateRes]]) -> float:
    """The replies' validation accuracy (``validation-fraction``), weighted by each client's validation
    samples; NaN where no reply carries one."""
    return weighted_mean(
        (float(res.metrics[VALIDATION_ACCURACY]), int(res.metrics[VALIDATION_EXAMPLES]))  # type: ignore[arg-type]
        for _, res in results
        if VALIDATION_ACCURACY in res.metrics
    )


def partition_of(proxy: ClientProxy) -> int:
    if not isinstance(proxy, PartitionProxy):
        raise TypeError("fedcond strategies instruct PartitionProxy objects only; configure_fit/evaluate made these")
    return proxy.partition_id


class RoundTracker:
    """Times each round, counts model bytes both ways, and turns evaluations into history rows.

    ``true_clusters`` (partition id -> cluster, from the server's own scenario) groups the
    evaluations into per-cluster accuracies: the ground truth stays where it lives, no client sends it.
    """

    def __init__(
        self,
        recorder: RunRecorder | None,
        num_rounds: int,
        true_clusters: Sequence[int],
        verbose: bool = True,
        drifting: frozenset[int] = frozenset(),
        metric: str = "accuracy",
    ) -> None:
        self.recorder = recorder
        #: What the clients' score is (``DatasetSpec.metric``): which client is the worst, how rows print.
        self.metric = metric
        #: The training clients that drift (fedcond.data.drift): their accuracy is also recorded apart.
        self.drifting = drifting
        self.true_clusters = tuple(true_clusters)
        self.num_rounds = num_rounds
        self.verbose = verbose
        self.run_start: float | None = None
        # Seconds the rounds before a resume took: elapsed_seconds goes on from there.
        self.elapsed_before = 0.0
        self.round_start = 0.0
        self.bytes_down = 0
        self.bytes_up = 0
        self.train_loss = float("nan")
        self.ari = float("nan")
        self.epsilon = float("nan")
        #: With evaluate-in-fit: the last round's record, all but the training clients' evaluations,
        #: which the next round's fit replies bring (``complete_pending``), and who took part in it.
        self.pending: RoundRecord | None = None
        self.pending_participation: RoundParticipation | None = None

    def start_round(self) -> None:
        self.round_start = time.perf_counter()
        if self.run_start is None:
            self.run_start = self.round_start
        self.bytes_down = self.bytes_up = 0

    def resume_after(self, history: Sequence[RoundRecord]) -> None:
        """Go on from the rounds a resumed run finished before."""
        self.elapsed_before = history[-1].elapsed_seconds if history else 0.0

    def sent(self, num_bytes: int) -> None:
        self.bytes_down += num_bytes

    def received_bytes(self, num_bytes: int) -> None:
        """Bytes of replies that are not a round's fit or evaluate replies (a newcomer's exchanges)."""
        self.bytes_up += num_bytes

    def peer_exchange(self, num_bytes: int) -> None:
        """Bytes one client sends another directly: up for the sender, down for the receiver."""
        self.bytes_up += num_bytes
        self.bytes_down += num_bytes

    def set_ari(self, value: float) -> None:
        self.ari = value

    def received_fit(self, results: Sequence[tuple[int, FitRes]], count_bytes: bool = True) -> None:
        if count_bytes:
            self.bytes_up += sum(parameters_bytes(res.parameters) for _, res in results)
        self.train_loss = weighted_mean((float(res.metrics[TRAIN_LOSS]), res.num_examples) for _, res in results)
        # Sample-level DP: the worst-off client's cumulative epsilon (clients report it, fedcond.privacy.dp).
        spent = [float(res.metrics[EPSILON]) for _, res in results if EPSILON in res.metrics]
        self.epsilon = max(spent, default=float("nan"))

    def received_secure_fit(self, bytes_up: int, train_loss: float, epsilon: float) -> None:
        """A SecAgg+ fit step: what its messages brought up, the mean training loss (from the sum) and
        the largest epsilon a contributor reported (NaN: none did)."""
        self.bytes_up += bytes_up
        self.train_loss = train_loss
        self.epsilon = epsilon

    def finish_round(
        self,
        server_round: int,
        results: Sequence[tuple[int, EvaluateRes]],
        held_out: Sequence[tuple[int, EvaluateRes]] = (),
        participation: RoundParticipation | None = None,
        deferred: bool = False,
    ) -> RoundRecord:
        """The round's record from the training clients' evaluations (``results``) and, kept apart,
        the held-out clients' (``heldout_accuracy``: NaN when there are none); ``participation`` says
        who took part. Only evaluations that came back count.

        ``deferred``: the training clients evaluate this round's model in the next round's fit
        (evaluate-in-fit); the record waits in ``pending`` until ``complete_pending`` fills it in."""
        counts = participation.counts() if participation is not None else {}
        accuracy, loss, per_cluster = summarise_evaluations(self.evaluations(results))
        newcomers = self.evaluations(held_out)
        heldout_accuracy = summarise_evaluations(newcomers)[0] if held_out else float("nan")
        now = time.perf_counter()
        record = RoundRecord(
            round=server_round,
            accuracy=accuracy,
            loss=loss,
            train_loss=self.train_loss,
            seconds=now - self.round_start,
            elapsed_seconds=self.elapsed_before + now - (self.run_start or self.round_start),
            bytes_down=self.bytes_down,
            bytes_up=self.bytes_up,
            cluster_accuracy=per_cluster,
            ari=self.ari,
            heldout_accuracy=heldout_accuracy,
            epsilon=self.epsilon,
            **counts,
            **Spread.of(self.evaluations(results), self.metric).as_fields(),
            **Spread.of(newcomers, self.metric).as_fields("heldout_"),
            clients_evaluated=len(results),
            drifted_accuracy=self.drifted_accuracy(results),
            heldout_adapted_accuracy=weighted_mean(
                (float(res.metrics[ADAPTED_ACCURACY]), res.num_examples)
                for _, res in held_out
                if ADAPTED_ACCURACY in res.metrics
            ),
            validation_accuracy=validation_accuracy(results),
            heldout_validation_accuracy=validation_accuracy(held_out),
        )
        if deferred:
            self.pending, self.pending_participation = record, participation
        else:
            self.record(record)
        return record

    def complete_pending(
        self, results: Sequence[tuple[int, EvaluateRes]], expected: Sequence[int], carrier: RoundParticipation
    ) -> list[Failure]:
        """Record (and print) the pending round's record with the training clients' evaluations of its
        model, which the fit replies of the round after it (``carrier``) brought from the ``expected``
        clients. A client whose evaluation did not come has not answered the pending round: its
        counts say so, and the returned failures (none when nothing was pending) name each one."""
        pending, participation = self.pending, self.pending_participation
        if pending is None:
            return []
        if participation is None:
            participation = RoundParticipation(pending.round, [p for p, _ in results])
        participation.missed_evaluations(expected, (p for p, _ in results), carrier)
        evaluations = self.evaluations(results)
        accuracy, loss, per_cluster = summarise_evaluations(evaluations)
        record = dataclasses.replace(
            pending,
            accuracy=accuracy,
            loss=loss,
            cluster_accuracy=per_cluster,
            clients_evaluated=len(evaluations),
            validation_accuracy=validation_accuracy(results),
            **participation.counts(),
            **Spread.of(evaluations, self.metric).as_fields(),
        )
        self.pending = self.pending_participation = None
        self.record(record)
        return participation.new_failures()

    def drifted_accuracy(self, results: Sequence[tuple[int, EvaluateRes]]) -> float:
        """The drifting clients' sample-weighted accuracy (NaN without drift)."""
        if not self.drifting:
            return float("nan")
        return weighted_mean(
            (float(res.metrics[ACCURACY]), res.num_examples) for pid, res in results if pid in self.drifting
        )

    def report_failures(self, failures: list[Failure]) -> None:
        """The round's new failures, into ``run.json`` (and printed when verbose)."""
        if failures and self.recorder is not None:
            self.recorder.add_events("failures", [failure.as_json() for failure in failures])
        if self.verbose:
            for failure in failures:
                print(f"fedcond: {failure.line()}", flush=True)

    def check_not_diverged(self, server_round: int, num_classes: int, fix: str) -> None:
        """Stop the run when the round's mean training loss exploded (``fedcond.model.training``)."""
        # Before round 1's row, and without a recorder, the round's own loss is the first.
        recorder = self.recorder
        first = recorder.first_train_loss if recorder is not None and recorder.records else self.train_loss
        check_not_diverged(server_round, self.train_loss, num_classes, first, fix)

    def record(self, record: RoundRecord) -> None:
        if self.recorder is not None:
            self.recorder.add(record)
        if self.verbose:
            print(record.progress_line(self.num_rounds, self.metric), flush=True)

    def evaluations(self, results: Sequence[tuple[int, EvaluateRes]]) -> list[ClientEvaluation]:
        return [
            ClientEvaluation(
                cluster=self.true_clusters[partition],
                num_samples=res.num_examples,
                loss=float(res.loss),
                accuracy=float(res.metrics[ACCURACY]),
            )
            for partition, res in results
        ]


class FoldedReplies:
    """The round's running sample-weighted mean of the fit replies' models, each folded in as it
    arrives (where nothing needs each reply's own model: the round then keeps one running sum
    instead of every client's model, 1,000 x 1.7 MB at 1,000 MNIST clients)."""

    def __init__(self, tracker: RoundTracker) -> None:
        self.tracker = tracker
        #: The round's running mean (None: this round folds nothing).
        self.stream: StreamingAverage | None = None
        self._lock = threading.Lock()

    def start(self, expected: dict[int, float] | None) -> None:
        """A new round: the clients whose replies will be folded in and their weights (None: none)."""
        self.stream = StreamingAverage(expected) if expected is not None else None

    def fold(self, partition_id: int, res: FitRes | None) -> FitRes | None:
        """Called as each fit reply arrives (None: the instruction failed): its model goes into the
        round's running average and the reply is passed on without it (its bytes already counted)."""
        with self._lock:
            stream = self.stream
            if stream is None:
                return res
            if res is None or res.status.code != Code.OK or ERROR in res.metrics or not res.parameters.tensors:
                stream.withdraw(partition_id)
                return res
            self.tracker.bytes_up += parameters_bytes(res.parameters)
            stream.add(partition_id, parameters_to_ndarrays(res.parameters), res.num_examples)
            return FitRes(res.status, Parameters(tensors=[], tensor_type=FOLDED), res.num_examples, res.metrics)


def record_class_accuracy(
    recorder: RunRecorder | None,
    class_names: Sequence[str],
    participating: Iterable[tuple[int, EvaluateRes]],
    held_out: Iterable[tuple[int, EvaluateRes]],
) -> None:
    """With ``per-class-accuracy``, the final round's accuracy per class over the participants' and
    over the newcomers' test sets, into ``run.json`` (``final_class_accuracy``)."""
    if recorder is None:
        return
    record = {
        group: class_accuracy(
            ((array_from_bytes(res.metrics[CLASS_CORRECT], CLASS_CORRECT, INT64),
              array_from_bytes(res.metrics[CLASS_COUNT], CLASS_COUNT, INT64))
             for _, res in replies if CLASS_COUNT in res.metrics),
            class_names,
        )
        for group, replies in (("participants", participating), ("newcomers", held_out))
    }  # fmt: skip
    if any(record.values()):
        recorder.note("final_class_accuracy", record)

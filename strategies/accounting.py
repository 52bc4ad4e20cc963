"""Round bookkeeping every fedcond strategy shares: time, bytes, evaluations, failures, printing."""

from __future__ import annotations

import time
from collections.abc import Sequence

from flwr.common import EvaluateRes, FitRes, Parameters
from flwr.server.client_proxy import ClientProxy

from fedcond.errors import FedcondError
from fedcond.history import RoundRecord, RunRecorder
from fedcond.messages import ACCURACY, CLUSTER, ERROR, PARTITION_ID, TRAIN_LOSS
from fedcond.metrics import ClientEvaluation, summarise_evaluations, weighted_mean

Failures = list[tuple[ClientProxy, FitRes] | tuple[ClientProxy, EvaluateRes] | BaseException]


def parameters_bytes(parameters: Parameters) -> int:
    return sum(len(tensor) for tensor in parameters.tensors)


def raise_on_failures(
    failures: Failures, stage: str, results: Sequence[tuple[ClientProxy, FitRes | EvaluateRes]] = ()
) -> None:
    """A failed client makes the round's numbers wrong: stop with the client's own message.

    Clients report their own errors as an ``ERROR`` metric (a one-line reason); anything else that
    went wrong reaches here as an exception with a traceback, from which the reason is extracted.
    """
    reported = [str(res.metrics[ERROR]) for _, res in results if ERROR in res.metrics]
    if reported:
        raise FedcondError(f"{len(reported)} client(s) failed in {stage}: {reported[0]}")
    if not failures:
        return
    first = failures[0]
    reason = str(first) if isinstance(first, BaseException) else str(first[1].status.message)
    # A client's FedcondError arrives wrapped in a traceback: surface its one-line message.
    for line in reversed(reason.splitlines()):
        if "FedcondError:" in line:
            reason = line.split("FedcondError:", 1)[1].strip()
            break
    raise FedcondError(f"{len(failures)} client(s) failed in {stage}: {reason}")


def by_partition(results: Sequence[tuple[ClientProxy, FitRes]]) -> list[tuple[ClientProxy, FitRes]]:
    """Results in partition order: float sums then do not depend on which client finished first."""
    return sorted(results, key=lambda pair: int(pair[1].metrics[PARTITION_ID]))


class RoundTracker:
    """Times each round, counts model bytes both ways, and turns evaluations into history rows."""

    def __init__(self, recorder: RunRecorder | None, num_rounds: int, verbose: bool = True) -> None:
        self.recorder = recorder
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

    def peer_exchange(self, num_bytes: int) -> None:
        """Bytes one client sends another directly: up for the sender, down for the receiver."""
        self.bytes_up += num_bytes
        self.bytes_down += num_bytes

    def set_ari(self, value: float) -> None:
        self.ari = value

    def received_fit(self, results: Sequence[tuple[ClientProxy, FitRes]], count_bytes: bool = True) -> None:
        if count_bytes:
            self.bytes_up += sum(parameters_bytes(res.parameters) for _, res in results)
        self.train_loss = weighted_mean((float(res.metrics[TRAIN_LOSS]), res.num_examples) for _, res in results)

    def finish_round(
        self,
        server_round: int,
        results: Sequence[tuple[ClientProxy, EvaluateRes]],
        held_out: Sequence[tuple[ClientProxy, EvaluateRes]] = (),
    ) -> RoundRecord:
        """The round's record from the training clients' evaluations (``results``) and, kept apart,
        the held-out clients' (``heldout_accuracy``: NaN when there are none)."""
        accuracy, loss, per_cluster = summarise_evaluations(_evaluations(results))
        heldout_accuracy = summarise_evaluations(_evaluations(held_out))[0] if held_out else float("nan")
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
        )
        if self.recorder is not None:
            self.recorder.add(record)
        if self.verbose:
            print(record.progress_line(self.num_rounds), flush=True)
        return record


def _evaluations(results: Sequence[tuple[ClientProxy, EvaluateRes]]) -> list[ClientEvaluation]:
    return [
        ClientEvaluation(
            cluster=int(res.metrics[CLUSTER]),
            num_samples=res.num_examples,
            loss=float(res.loss),
            accuracy=float(res.metrics[ACCURACY]),
        )
        for _, res in results
    ]

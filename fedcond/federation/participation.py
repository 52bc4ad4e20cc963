"""Who took part in a round: every client's outcome, the failures' reasons, and the failure policy.

A round asks every expected client (a training client: fit, then evaluate; a held-out client:
evaluate only). A client **answered** the round when every instruction it was given that round came
back OK; otherwise its outcome is that of the first instruction that did not: **failed** (its own
reported error, an exception on its side or in transport, or its node left) or **timed out** (no
answer within ``round-timeout``). So answered + failed + timed out = asked, every round.

With one message a round (evaluate-in-fit) a training client evaluates round r's model in round
r + 1's fit message: that evaluation is still one of round r's instructions, so a client whose round
r + 1 fit never answered has not answered round r either (``RoundParticipation.missed_evaluations``),
and round r's record says so instead of counting an evaluation that never came.

The policy: a round goes on when at least ``required_answers`` of its clients can still answer;
below that the run stops with one line naming the round, the counts and the first reason.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fedcond import stopping
from fedcond.errors import FedcondError

FIT = "fit"
EVALUATE = "evaluate"
#: Before round 1 (round 0): the fingerprint statistics' secure sum.
STATISTICS = "fingerprint statistics"
FAILED = "failed"
TIMED_OUT = "timed out"
#: The reason recorded for a client whose node is not connected when the round asks it.
NODE_LEFT = "node left"


@dataclass(frozen=True)
class Failure:
    """One client that did not answer one instruction of a round, and why (one line)."""

    round: int
    stage: str
    partition_id: int
    outcome: str  # FAILED or TIMED_OUT
    reason: str

    def as_json(self) -> dict[str, Any]:
        """The entry ``run.json``'s ``failures`` list holds (kebab-case keys, as run-config keys)."""
        return {
            "round": self.round, "stage": self.stage, "partition-id": self.partition_id,
            "outcome": self.outcome, "reason": self.reason,
        }  # fmt: skip

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Failure:
        return cls(int(entry["round"]), str(entry["stage"]), int(entry["partition-id"]), str(entry["outcome"]),
                   str(entry["reason"]))  # fmt: skip

    def line(self) -> str:
        return f"round {self.round}: partition {self.partition_id} {self.outcome} in {self.stage}: {self.reason}"


def required_answers(fraction: float, asked: int, floor: int = 1) -> int:
    """How many of ``asked`` clients must answer: ``fraction`` of them rounded up, never fewer than
    ``floor`` (one, or one per model for methods with a model per cluster), never more than asked."""
    # round(): 0.8 * 5 is 4.000000000000001 in floating point, which must still need 4, not 5.
    return min(asked, max(floor, math.ceil(round(fraction * asked, 9))))


class RoundParticipation:
    """The outcome of every client asked in one round; safe to update from Flower's worker threads."""

    def __init__(self, server_round: int, asked: Iterable[int]) -> None:
        self.round = server_round
        self.asked = sorted(set(asked))
        self.failures: list[Failure] = []
        self._first_failure: dict[int, Failure] = {}
        self._published = 0
        self._lock = threading.Lock()

    def fail(self, stage: str, partition_id: int, reason: str, outcome: str = FAILED) -> None:
        """Record that ``partition_id`` did not answer ``stage``; its round outcome is its first such.

        Refused (``fedcond.stopping.Interrupted``) once a stop is under way: the stop ends the round,
        whose clients' failures are then the stop's doing (Ray's workers die with it), never data."""
        stopping.check(f"round {self.round}: partition {partition_id}'s failure in {stage}")
        failure = Failure(self.round, stage, partition_id, outcome, " ".join(reason.split()) or "no reason given")
        with self._lock:
            self.failures.append(failure)
            self._first_failure.setdefault(partition_id, failure)

    def missed_evaluations(
        self, expected: Iterable[int], evaluated: Iterable[int], carrier: RoundParticipation
    ) -> None:
        """Record the evaluations of this round's model that were to come in ``carrier``'s fit replies
        (the next round's, evaluate-in-fit) from the ``expected`` clients and did not: each such client
        failed this round as it failed ``carrier``'s fit (its reason, or "answered without it").
        A client expected here that this round did not ask (another sample) is asked now."""
        came = set(evaluated)
        with self._lock:
            self.asked = sorted({*self.asked, *expected, *came})
        for partition_id in sorted(set(expected) - came):
            cause = carrier.first_failure(partition_id)
            reason = f"{cause.outcome}: {cause.reason}" if cause else "answered without it"
            outcome = cause.outcome if cause else FAILED
            why = f"its evaluation was to come with round {carrier.round}'s fit, which {reason}"
            self.fail(EVALUATE, partition_id, why, outcome)

    def first_failure(self, partition_id: int) -> Failure | None:
        with self._lock:
            return self._first_failure.get(partition_id)

    def as_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of a round whose record is pending (``from_state`` takes it back)."""
        with self._lock:
            return {"round": self.round, "asked": list(self.asked), "failures": [f.as_json() for f in self.failures]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RoundParticipation:
        participation = cls(int(state["round"]), (int(p) for p in state["asked"]))
        for entry in state["failures"]:
            failure = Failure.from_json(entry)
            participation.fail(failure.stage, failure.partition_id, failure.reason, failure.outcome)
        participation._published = len(participation.failures)  # reported before the checkpoint
        return participation

    def has_failed(self, partition_id: int) -> bool:
        with self._lock:
            return partition_id in self._first_failure

    def new_failures(self) -> list[Failure]:
        """Failures recorded since the last call (each is reported once)."""
        with self._lock:
            fresh = self.failures[self._published :]
            self._published = len(self.failures)
        return fresh

    @property
    def answered(self) -> int:
        """Clients with no failure so far: after the round's last stage, those that answered it."""
        with self._lock:
            return len(self.asked) - len(self._first_failure)

    def counts(self) -> dict[str, int]:
        """``clients_asked``, ``clients_answered``, ``clients_failed``, ``clients_timed_out``."""
        with self._lock:
            outcomes = [failure.outcome for failure in self._first_failure.values()]
        return {
            "clients_asked": len(self.asked),
            "clients_answered": len(self.asked) - len(outcomes),
            "clients_failed": outcomes.count(FAILED),
            "clients_timed_out": outcomes.count(TIMED_OUT),
        }

    def check(self, fraction: float, floor: int = 1, stage: str = "", asking: bool = False) -> None:
        """Stop the run when too few clients can still answer this round (one line, naming the fix).

        ``asking``: checked before ``stage``'s instructions go out (only absent nodes have failed it
        yet), rather than after its answers came back.
        """
        needed = required_answers(fraction, len(self.asked), floor)
        possible = self.answered
        if possible >= needed:
            return
        with self._lock:
            first = self.failures[0] if self.failures else None
        if asking:
            counted = f"{possible} of {len(self.asked)} clients are left to ask{f' in {stage}' if stage else ''}"
        else:
            counted = f"{possible} of {len(self.asked)} clients answered{f' in {stage}' if stage else ''}"
        rule = f"min-answered-fraction={fraction:g}" + (f" and one per cluster model ({floor})" if floor > 1 else "")
        why = f"; first: {first.line()}" if first else ""
        raise FedcondError(
            f"round {self.round}: {counted}, fewer than the {needed} that {rule} require{why}; every failure is "
            "listed in run.json: fix those clients or lower min-answered-fraction"
        )

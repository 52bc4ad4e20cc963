"""Which node holds which client: the federation's members, known by the partition id each reports.

Flower names a node by a random node id (``ClientProxy.cid``) that changes when a SuperNode
restarts; a client is its partition (``--node-config partition-id=...``). The server asks every new
node its identity, maps it to its partition, and keys every piece of per-client state by partition
id, so a node that comes back under a new node id takes its partition's place again. A node that
claims a partition another connected node holds is refused (never instructed) until that partition
is free. Every join, departure and refusal is one line on the terminal and an entry of ``run.json``'s
``membership`` list.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable

from flwr.common import (
    DisconnectRes,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    GetParametersRes,
    GetPropertiesIns,
    GetPropertiesRes,
    ReconnectIns,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from fedcond import stopping
from fedcond.errors import FedcondError
from fedcond.federation.exchange import NODE_UNAVAILABLE, ask_all, ask_each, classify_failure, raised_by_client
from fedcond.federation.messages import PARTITION_ID, STEP, STEP_IDENTITY
from fedcond.federation.participation import RoundParticipation
from fedcond.records.history import RunRecorder

NODE_CONFIG_FIX = "give each SuperNode its own --node-config partition-id=..."


def silent_node_line(server_round: int, partition_id: int, node_id: str, stage: str) -> str:
    """What the ServerApp says the moment Flower answers a message with "Node Unavailable": the node
    stopped sending heartbeats (its machine or SuperNode died without a goodbye)."""
    return (
        f"round {server_round}: partition {partition_id} (node {node_id}) stopped sending heartbeats: the SuperLink "
        f"gave up on it, so its {stage} failed (node left); the run goes on while min-answered-fraction allows, and "
        f"the node rejoins when its SuperNode starts again with its key and --node-config partition-id={partition_id}"
    )


class PartitionProxy(ClientProxy):
    """A node's proxy under its partition id, for one stage of one round.

    Flower hands a strategy the exceptions of failed instructions without saying whose they were;
    this proxy records each one as its partition's failure (or time-out) before passing it on, so
    every client that did not answer is known by its partition and its reason.
    """

    def __init__(self, node: ClientProxy, partition_id: int, participation: RoundParticipation, stage: str) -> None:
        super().__init__(node.cid)
        if hasattr(node, "node_id"):  # Flower's grid proxies: SecAgg+ addresses nodes by it
            self.node_id = node.node_id
        self.node = node
        self.partition_id = partition_id
        self.participation = participation
        self.stage = stage
        #: Where a fit reply goes as soon as it arrives (None when it failed); what it returns is what
        #: the round loop keeps (``fedcond.federation.round_record.FoldedReplies``).
        self.on_fit_reply: Callable[[int, FitRes | None], FitRes | None] | None = None

    def _recorded(self, call: Callable[[], object], timeout: float | None) -> object:
        started = time.monotonic()
        try:
            return call()
        except Exception as error:
            if not raised_by_client(error):
                # Its worker died or its message went unanswered: perhaps a stop's doing, seen first.
                stopping.settled(f"round {self.participation.round}: partition {self.partition_id}'s failure")
            outcome, reason = classify_failure(error, time.monotonic() - started, timeout)
            if NODE_UNAVAILABLE in str(error):
                # The SuperLink gave up on the node after two missed heartbeats (about a minute of
                # silence): said now, naming it, rather than only in the round's counts at its end.
                print(f"fedcond: {silent_node_line(self.participation.round, self.partition_id, self.cid, self.stage)}",
                      file=sys.stderr, flush=True)  # fmt: skip
            self.participation.fail(self.stage, self.partition_id, reason, outcome)
            raise

    def fit(self, ins: FitIns, timeout: float | None, group_id: int | None) -> FitRes:
        try:
            res = self._recorded(lambda: self.node.fit(ins, timeout, group_id), timeout)
        except Exception:
            if self.on_fit_reply is not None:
                self.on_fit_reply(self.partition_id, None)
            raise
        return res if self.on_fit_reply is None else self.on_fit_reply(self.partition_id, res)  # type: ignore[arg-type,return-value]

    def evaluate(self, ins: EvaluateIns, timeout: float | None, group_id: int | None) -> EvaluateRes:
        return self._recorded(lambda: self.node.evaluate(ins, timeout, group_id), timeout)  # type: ignore[return-value]

    def get_properties(self, ins: GetPropertiesIns, timeout: float | None, group_id: int | None) -> GetPropertiesRes:
        return self.node.get_properties(ins, timeout, group_id)

    def get_parameters(self, ins: GetParametersIns, timeout: float | None, group_id: int | None) -> GetParametersRes:
        return self.node.get_parameters(ins, timeout, group_id)

    def reconnect(self, ins: ReconnectIns, timeout: float | None, group_id: int | None) -> DisconnectRes:
        return self.node.reconnect(ins, timeout, group_id)


class Membership:
    """Partition id <-> connected node, for partitions ``0 .. num_partitions - 1``.

    A node's identity is the partition id its operator configured, its one answer to the identity
    question: the node's name, by which the server keeps per-client state. It is not ground truth:
    the true clusters are the simulation's bookkeeping, which the server reads from its own scenario
    (``StrategyInputs.true_clusters``); no client sends its cluster.
    """

    def __init__(
        self, num_partitions: int, timeout: float | None, recorder: RunRecorder | None = None, verbose: bool = True
    ) -> None:
        self.num_partitions = num_partitions
        self.timeout = timeout
        self.recorder = recorder
        self.verbose = verbose
        self.node_of: dict[int, ClientProxy] = {}
        self._partition_of: dict[str, int] = {}
        # Connected nodes not mapped: those whose partition another node holds (cid -> partition),
        # and those whose identity is no partition of this run.
        self._claims: dict[str, int] = {}
        self._rejected: set[str] = set()

    def start(self, proxies: list[ClientProxy]) -> None:
        """Map every node of the starting federation; two nodes with one partition stop the run."""
        answers = ask_all(proxies, {STEP: STEP_IDENTITY}, self.timeout)
        claims = {proxy.cid: self._identity(answer) for proxy, answer in zip(proxies, answers, strict=True)}
        doubles = sorted(partition for partition, count in Counter(claims.values()).items() if count > 1)
        if doubles:
            raise FedcondError(
                f"partition-id {doubles[0]} is claimed by {Counter(claims.values())[doubles[0]]} nodes and "
                f"{self.num_partitions - len(set(claims.values()))} partition(s) by none; {NODE_CONFIG_FIX} "
                f"(0..{self.num_partitions - 1})"
            )
        for proxy in proxies:
            self._map(proxy, claims[proxy.cid])

    def refresh(self, client_manager: ClientManager, server_round: int) -> dict[int, ClientProxy]:
        """The nodes connected now, by partition: departures noted, newcomers identified and mapped."""
        connected = client_manager.all()
        for cid in [cid for cid in self._partition_of if cid not in connected]:
            partition = self._partition_of.pop(cid)
            del self.node_of[partition]
            self._event(server_round, "left", partition, cid, "node left")
        self._claims = {cid: partition for cid, partition in self._claims.items() if cid in connected}
        self._rejected &= set(connected)
        known = self._partition_of.keys() | self._claims.keys() | self._rejected
        unknown = [proxy for cid, proxy in connected.items() if cid not in known]
        first_claims = set()
        for proxy, answer in zip(unknown, ask_each(unknown, {STEP: STEP_IDENTITY}, self.timeout), strict=True):
            if isinstance(answer, str):  # asked again next round: it may still be starting
                self._event(server_round, "unidentified", None, proxy.cid, answer)
                continue
            try:
                self._claims[proxy.cid] = self._identity(answer)
                first_claims.add(proxy.cid)
            except FedcondError as error:
                self._rejected.add(proxy.cid)
                self._event(server_round, "refused", None, proxy.cid, str(error), warn=True)
        for cid, partition in sorted(self._claims.items(), key=lambda claim: claim[1]):
            if partition in self.node_of:
                if cid in first_claims:  # said once, when the node first claims it
                    self._event(
                        server_round, "refused", partition, cid,
                        f"partition-id {partition} is held by a connected node, so this node is never instructed; "
                        f"{NODE_CONFIG_FIX}", warn=True,
                    )  # fmt: skip
                continue
            del self._claims[cid]
            self._map(connected[cid], partition)
            self._event(server_round, "joined", partition, cid, "identified by its partition-id; takes part again")
        return dict(self.node_of)

    def _identity(self, answer: dict[str, object]) -> int:
        partition = int(answer[PARTITION_ID])  # type: ignore[call-overload]
        if not 0 <= partition < self.num_partitions:
            raise FedcondError(
                f"a node reports partition-id {partition}, outside this run's 0..{self.num_partitions - 1}; "
                f"{NODE_CONFIG_FIX}"
            )
        return partition

    def _map(self, proxy: ClientProxy, partition: int) -> None:
        self.node_of[partition] = proxy
        self._partition_of[proxy.cid] = partition

    def _event(
        self, server_round: int, event: str, partition: int | None, node: str, reason: str, warn: bool = False
    ) -> None:
        """One line on the terminal (standard error for what needs action) and one ``run.json`` entry."""
        where = f"partition {partition}" if partition is not None else f"node {node}"
        line = f"fedcond: round {server_round}: {where} {event}: {reason}"
        if warn:
            print(line, file=sys.stderr, flush=True)
        elif self.verbose:
            print(line, flush=True)
        if self.recorder is not None:
            entry = {"round": server_round, "event": event, "partition-id": partition, "node-id": node}
            self.recorder.add_events("membership", [{**entry, "reason": reason}])

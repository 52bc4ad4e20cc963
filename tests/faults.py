"""Faults injected into real ClientApps for the tests: Flower mods, never part of the product.

``Fault(partition_id, server_round, stage, how)`` wraps every message a client handles and, for one
partition in one round and stage, raises (an exception on the client's side, as a crash would),
reports a client error (fedcond's ``ERROR`` metric, as a ``FedcondError`` does) or hangs past the
message's lifetime (as a stuck client would). A stage is ``fit``, ``evaluate`` or one of SecAgg+'s
(``setup``, ``share_keys``, ``collect_masked_vectors``, ``unmask``; round 0 is the fingerprint
statistics' sum before round 1): a client that raises there drops out mid-protocol.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import ray.cloudpickle
from flwr.app import Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, Context, EvaluateRes, FitRes, Parameters, Status
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from fedcond.federation.messages import ERROR, SERVER_ROUND

# Ray actors unpickle the ClientApp, mods included: by value, as tests/ need not be importable there
# (Ray adds only the driver's working directory to their path, and the tests change it).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

FIT, EVALUATE = "fit", "evaluate"
SECAGG_STAGES = Stage.all()
RAISE, REPORT, HANG = "raise", "report", "hang"


@dataclass(frozen=True)
class Fault:
    partition_id: int
    server_round: int = 0
    stage: str = FIT
    how: str = RAISE

    @property
    def reason(self) -> str:
        return f"injected fault: partition {self.partition_id} round {self.server_round} {self.stage}"

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if not self.applies(message, context):
            return call_next(message, context)
        if self.how == HANG:
            # Past the message's lifetime (round-timeout), then answer: too late to count.
            time.sleep(max(0.0, message.metadata.created_at + message.metadata.ttl - time.time()) + 2.0)
            return call_next(message, context)
        if self.how == REPORT:
            return Message(self.reported_error(), reply_to=message)
        raise RuntimeError(self.reason)

    def applies(self, message: Message, context: Context) -> bool:
        if int(context.node_config["partition-id"]) != self.partition_id:
            return False
        kind = message.metadata.message_type
        secagg = kind == "train" and RECORD_KEY_CONFIGS in message.content.config_records
        secagg_stage = message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) if secagg else None
        if self.stage in SECAGG_STAGES:
            return secagg_stage == self.stage and message.metadata.group_id == str(self.server_round)
        if secagg and secagg_stage != Stage.COLLECT_MASKED_VECTORS:
            return False  # SecAgg+'s other stages carry no training instruction
        if self.stage == FIT and kind == "train":
            config = compat.recorddict_to_fitins(message.content, keep_input=True).config
        elif self.stage == EVALUATE and kind == "evaluate":
            config = compat.recorddict_to_evaluateins(message.content, keep_input=True).config
        else:
            return False
        return int(config[SERVER_ROUND]) == self.server_round

    def reported_error(self) -> RecordDict:
        if self.stage == FIT:
            empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
            return compat.fitres_to_recorddict(FitRes(Status(Code.OK, ""), empty, 0, {ERROR: self.reason}), False)
        return compat.evaluateres_to_recorddict(EvaluateRes(Status(Code.OK, ""), 0.0, 0, {ERROR: self.reason}))

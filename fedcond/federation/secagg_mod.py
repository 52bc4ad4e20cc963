"""The client's side of secure aggregation: Flower's ``secaggplus_mod``, with what fedcond adds.

Every message of a SecAgg+ aggregation is a training message carrying Flower's ``secaggplus_configs``
record: the mod answers the protocol's stages itself and runs the client only at
``collect_masked_vectors``, masking what it returns. Messages without that record pass through, so
one ClientApp serves every setting; but a run with ``secure-aggregation = "secaggplus"`` refuses a
plain training instruction (it would send the model in the clear).

Around the client's answer, before SecAgg+ masks it (``contribution``):

- a client error (fedcond's ``ERROR`` metric) or a failed reply becomes an exception: the node drops
  out of the protocol, and the server learns the one-line reason from the error reply;
- model updates: a parameter beyond SecAgg+'s clipping range, or more samples than its largest
  weight, is refused (SecAgg+ would clip or overflow silently); the training loss is appended as one
  more array, so the server gets the sample-weighted mean loss from the same sum and no client's own.

After masking, the reply keeps no metric but ``EPSILON`` (the DP accounting, public by design) and a
sample count of 0: the count is inside the masked vector, as SecAgg+'s weight. What remains in the
clear is listed in docs/privacy.md (tests/test_messages.py checks every key).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common import (
    ConfigRecord,
    Context,
    FitRes,
    Message,
    MessageType,
    MetricRecord,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.messages import EPSILON, ERROR, STEP, STEP_STATISTICS, TRAIN_LOSS
from fedcond.privacy.secure_aggregation import SecureAggregation

FIT_METRICS = "fitres.metrics"
FIT_NUM_EXAMPLES = "fitres.num_examples"


def secure_aggregation_mod(run_config: Callable[[Context], RunConfig]) -> Mod:
    """The mod for a ClientApp whose settings ``run_config`` reads from a message's context."""

    def mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        if message.metadata.message_type != MessageType.TRAIN:
            return call_next(message, context)
        if RECORD_KEY_CONFIGS not in message.content.config_records:
            if SecureAggregation.of(run_config(context)).model_updates:
                raise FedcondError(
                    "this run has secure-aggregation=secaggplus, so a plain training instruction, whose reply would "
                    "carry the model in the clear, is refused; server and client run other fedcond versions"
                )
            return call_next(message, context)
        stage = message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)

        def contribution(instruction: Message, inner_context: Context) -> Message:
            return checked_contribution(instruction, call_next(instruction, inner_context), inner_context)

        reply = secaggplus_mod(message, context, contribution)
        if stage == Stage.COLLECT_MASKED_VECTORS:
            withhold_metadata(reply)
        return reply

    return mod


def checked_contribution(instruction: Message, reply: Message, context: Context) -> Message:
    """The client's answer as SecAgg+ may mask it (see the module docstring), or an exception."""
    if reply.has_error():
        raise FedcondError(reply.error.reason)
    fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
    if ERROR in fitres.metrics:
        raise FedcondError(str(fitres.metrics[ERROR]))
    if compat.recorddict_to_fitins(instruction.content, keep_input=True).config.get(STEP) == STEP_STATISTICS:
        return reply  # exact digits, already in range (fedcond.fingerprint.statistics_encoding)
    protocol = context.state.config_records[RECORD_KEY_STATE]
    clipping_range, max_weight = float(protocol["clipping_range"]), float(protocol["max_weight"])  # type: ignore[arg-type]
    arrays = parameters_to_ndarrays(fitres.parameters)
    largest = max((float(np.max(np.abs(array))) for array in arrays if array.size), default=0.0)
    if not largest <= clipping_range:  # also NaN
        raise FedcondError(
            f"a model parameter of magnitude {largest:.4g} exceeds secagg-clipping-range={clipping_range:g}, which "
            "SecAgg+ would clip silently; raise secagg-clipping-range"
        )
    if fitres.num_examples > max_weight:
        raise FedcondError(
            f"{fitres.num_examples} training samples exceed SecAgg+'s largest weight {max_weight:g}; the server "
            "and this client disagree on the scenario"
        )
    loss = float(fitres.metrics.get(TRAIN_LOSS, 0.0))  # type: ignore[arg-type]
    # NaN (withheld under DP-SGD): 0, and the server records NaN; capped at the range SecAgg+ carries.
    loss_array = np.array([min(loss, clipping_range) if np.isfinite(loss) else 0.0])
    fitres = FitRes(fitres.status, ndarrays_to_parameters([*arrays, loss_array]), fitres.num_examples, fitres.metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=instruction)


def withhold_metadata(reply: Message) -> None:
    """Leave in the masked reply no metric but ``EPSILON``, and no sample count."""
    if reply.has_error():
        return
    content = reply.content
    if FIT_METRICS in content.config_records:
        metrics = content.config_records[FIT_METRICS]
        content.config_records[FIT_METRICS] = ConfigRecord({k: v for k, v in metrics.items() if k == EPSILON})
    if FIT_NUM_EXAMPLES in content.metric_records:
        content.metric_records[FIT_NUM_EXAMPLES] = MetricRecord({"num_examples": 0})

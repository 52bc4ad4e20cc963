"""Client-side clipping for client-level DP: Flower's ``fixedclipping_mod``, where the server asks for it.

With ``client-dp = "client-side"`` the server's wrapper (fedcond/federation/client_dp.py) puts the clipping
norm into every training instruction; this mod then lets Flower's ``fixedclipping_mod`` clip the
update (returned model minus received model) to that norm before it leaves the client. Without the
key it does nothing, so one ClientApp serves every setting. A client that reports an error (no
model: ``fedcond/federation/client.py``) is passed through as it is, for the server to report its reason.

A clipped reply reports one training sample: the noise is calibrated to an unweighted mean of the
clipped updates, and under SecAgg+ (fedcond/federation/secagg_mod.py, which masks this reply) the
weight travels inside the masked sum, where the server could not make it uniform afterwards.
"""

from __future__ import annotations

from flwr.client.mod import fixedclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Context,
    FitIns,
    FitRes,
    Message,
    MessageType,
    MetricRecord,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common import recorddict_compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_clip_model_update

from fedcond.federation.messages import ERROR


def client_dp_clipping_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``fixedclipping_mod`` for training instructions that carry a clipping norm."""
    asks_for_clipping = message.metadata.message_type == MessageType.TRAIN and any(
        KEY_CLIPPING_NORM in record for record in message.content.config_records.values()
    )
    if not asks_for_clipping:
        return call_next(message, context)
    replies: list[Message] = []

    def answer(inner: Message, inner_context: Context) -> Message:
        reply = call_next(inner, inner_context)
        replies.append(reply)
        return reply

    try:
        clipped = fixedclipping_mod(message, context, answer)
    except ValueError:
        # An error reply holds no model to clip (zip of no arrays against the model's).
        if replies and not replies[0].has_error() and _reports_error(replies[0]):
            return replies[0]
        raise
    if not clipped.has_error():
        clipped.content.metric_records["fitres.num_examples"] = MetricRecord({"num_examples": 1})
    return clipped


def _reports_error(reply: Message) -> bool:
    return ERROR in recorddict_compat.recorddict_to_fitres(reply.content, keep_input=True).metrics


def clipped_without_messages(instruction: FitIns, reply: FitRes) -> FitRes:
    """What the mod makes of a reply, for a runner that calls clients without messages
    (fedcond/tools/in_process.py): Flower's own clip (``compute_clip_model_update``, which
    ``fixedclipping_mod`` calls) of the reply minus the instruction, and one sample; a reply without the
    server's clipping norm, or one that reports an error, as it is."""
    if KEY_CLIPPING_NORM not in instruction.config or ERROR in reply.metrics:
        return reply
    arrays = parameters_to_ndarrays(reply.parameters)
    sent = parameters_to_ndarrays(instruction.parameters)
    compute_clip_model_update(arrays, sent, float(instruction.config[KEY_CLIPPING_NORM]))  # type: ignore[arg-type]
    return FitRes(reply.status, ndarrays_to_parameters(arrays), 1, reply.metrics)

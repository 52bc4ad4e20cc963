"""What travels between strategy and client: the names of the values (Flower configs, properties,
metrics) and how small vectors are encoded in them (those carry scalars and bytes only).

Shared by the adapters in ``clients/`` and ``strategies/``; kept here so that a move to another
Flower API changes how values travel, not what they are called or how they are packed.
"""

from __future__ import annotations

import numpy as np

from fedcond.errors import FedcondError

STEP = "fedcond-step"
#: Before round 1: the node's name (its operator-configured partition id), the one identity answer.
STEP_IDENTITY = "identity"
#: Before round 1: the fingerprint statistics through SecAgg+ (a training instruction with this step).
STEP_STATISTICS = "fingerprint-statistics"
#: In that instruction under client-level DP: the bound each client clips its (f, f^2) to before the
#: sum, which the server then noises (fedcond/federation/client_dp.py).
STATISTICS_CLIPPING_NORM = "statistics-clipping-norm"
#: Before round 1: a descriptor-clustering client's descriptor of its training data (sent in the clear).
STEP_DESCRIPTOR = "descriptor"
DESCRIPTOR = "descriptor"
#: A pFedHN newcomer's training instruction: one SGD step (number ``NEWCOMER_STEP``) on its own data
#: from the model its embedding generates, whose update moves only that embedding.
STEP_NEWCOMER_EMBEDDING = "newcomer-embedding"
NEWCOMER_STEP = "newcomer-step"
#: A pFedHN newcomer's evaluate message once it has learned its embedding: two named models
#: (``pack_parts``), the zero-shot one (the mean embedding's) and the one its learned embedding generates.
PFEDHN_NEWCOMER_PARTS = ("zero-shot", "adapted")
SERVER_ROUND = "server-round"
FINGERPRINT_MEAN = "fingerprint-mean"
FINGERPRINT_STD = "fingerprint-std"
PARTITION_ID = "partition-id"
TRAIN_LOSS = "train-loss"
ACCURACY = "accuracy"
CHOICE = "choice"
EPSILON = "epsilon"
ERROR = "fedcond-error"
#: In a training instruction (evaluate-in-fit): evaluate, before training, the model this message
#: brings (the last round's aggregate), as the evaluate message would have; IFCA: with this choice.
EVALUATE_FIRST = "evaluate-first"
EVALUATE_CHOICE = "evaluate-choice"
#: In a fit reply to such an instruction: that evaluation on the client's test set.
EVALUATED_LOSS = "evaluated-loss"
EVALUATED_ACCURACY = "evaluated-accuracy"
EVALUATED_EXAMPLES = "evaluated-examples"
#: In an evaluate reply (and an evaluate-in-fit reply) with ``validation-fraction``: the same model's
#: score on the client's validation share, and that share's size (its weight in the round's mean).
VALIDATION_ACCURACY = "validation-accuracy"
VALIDATION_EXAMPLES = "validation-examples"
VALIDATION_KEYS = (VALIDATION_ACCURACY, VALIDATION_EXAMPLES)
#: In a held-out client's evaluate reply (newcomer-steps > 0): the accuracy of the model it was served
#: after that many local steps on its own training data (fedcond.newcomers).
ADAPTED_ACCURACY = "adapted-accuracy"
#: In a final round's evaluate reply with per-class-accuracy: the client's correct predictions and
#: test samples per class (int64 arrays as bytes; fedcond.records.metrics.class_accuracy).
CLASS_CORRECT = "class-correct"
CLASS_COUNT = "class-count"
INT64 = "<i8"
#: In a CFL newcomer's evaluate message: the shape of the parameter tree its arrays hold
#: (fedcond.model.parameter_tree.header).
PARAMETER_TREE = "parameter-tree"

FLOAT64 = "<f8"


def array_to_bytes(vector: np.ndarray, dtype: str = FLOAT64) -> bytes:
    return np.ascontiguousarray(vector, dtype=dtype).tobytes()


def array_from_bytes(payload: object, name: str, dtype: str = FLOAT64) -> np.ndarray:
    if not isinstance(payload, bytes) or len(payload) % 8:
        raise FedcondError(f"'{name}' is missing or malformed; server and client run different fedcond versions")
    return np.frombuffer(payload, dtype=dtype).copy()


#: In an instruction's config and in a reply's metrics: the names of the models its arrays hold, in
#: order ("model,control"), where a method's message carries more than one (SCAFFOLD's [x, c]).
PAYLOAD_PARTS = "payload-parts"


def pack_parts(parts: dict[str, list[np.ndarray]]) -> tuple[list[np.ndarray], str]:
    """Named models of one architecture as one flat list of arrays, and the ``PAYLOAD_PARTS`` value
    that names them."""
    if len({len(arrays) for arrays in parts.values()}) > 1:
        raise ValueError(f"the parts {sorted(parts)} are not models of one architecture")
    return [array for arrays in parts.values() for array in arrays], ",".join(parts)


def unpack_parts(arrays: list[np.ndarray], names: object, expected: tuple[str, ...]) -> dict[str, list[np.ndarray]]:
    """The named models of a message packed by ``pack_parts``: ``expected`` by name, whatever their
    order; a message that holds other parts, or arrays that do not split into them, is refused."""
    given = tuple(str(names).split(",")) if isinstance(names, str) and names else ()
    if sorted(given) != sorted(expected) or len(arrays) % len(given):
        raise FedcondError(
            f"a message holds {', '.join(given) or 'no named parts'} in {len(arrays)} arrays where "
            f"{', '.join(expected)} were expected; server and client run different fedcond versions"
        )
    size = len(arrays) // len(given)
    return {name: arrays[index * size : (index + 1) * size] for index, name in enumerate(given)}

"""The fingerprint reconstruction attack: what an honest-but-curious server learns from one update.

Every conditioning mechanism feeds the fingerprint s through a layer that is *linear in s* and whose
gradient is an outer product with s; a companion block of the same network receives exactly the
other factor (each mechanism says which, ``Mechanism.linear_blocks`` in ``fedcond.model.conditioning``):
``concat``'s first FC layer (grad W[:, fingerprint columns] = e s^T, grad bias = e, e the per-unit
error of the hidden layer), ``film``'s generator (grad weight = e s^T, grad bias = e), ``hyper``'s
generated head (grad W_j = s_j grad [W0 | b0]).

SGD with momentum moves parameters by a fixed linear combination of the gradients, and s never
changes, so the update keeps the structure exactly: Delta W_s = Delta b s^T. The least-squares s
then comes out of one plain update to float precision; ``undo_zscore`` turns the z-scored s the model
was fed into the raw eigenvalues with the federation's published mean and std.

On an aggregate of several clients' updates (FedAvg, or a secure-aggregation sum) the same formula
returns a mixture of their fingerprints weighted by their companion updates: the function applies
as it is, and how close that comes to any one client is what an aggregate protects.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedcond.errors import FedcondError
from fedcond.fingerprint.fingerprints import STD_FLOOR
from fedcond.model.networks import Network


def _updates(model: Network, sent: Sequence[np.ndarray], returned: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """returned - sent, by state_dict name (the arrays as they travel, in ``get_weights`` order)."""
    shapes = [tuple(tensor.shape) for tensor in model.state_dict().values()]
    if [np.shape(array) for array in sent] != shapes or [np.shape(array) for array in returned] != shapes:
        raise FedcondError(
            f"the attack needs the {len(shapes)} arrays of this model, sent and returned, in its shapes; "
            "build the model with the run's settings"
        )
    names = list(model.state_dict())
    return {
        name: np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
        for name, before, after in zip(names, sent, returned, strict=True)
    }


def linear_blocks(model: Network, update: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(P, Q): the update of the block linear in s, shaped (d, k), and of its companion, shaped (k,),
    so that P = s Q^T for one client's update."""
    if not model.condition_dim:
        raise FedcondError("the model is not conditioned: there is no fingerprint to reconstruct")
    return model.mechanism.linear_blocks(model, update)


def reconstruct_condition(model: Network, sent: Sequence[np.ndarray], returned: Sequence[np.ndarray]) -> np.ndarray:
    """The fingerprint (as the model was fed it: z-scored under federated normalisation) that best
    explains ``returned - sent``: s = P Q / |Q|^2.

    ``model`` is any model built with the run's settings (only its structure is read); ``sent`` is
    the global model the client received, ``returned`` what it sent back, or an aggregate of several
    clients' returns (then the answer mixes their fingerprints).
    """
    block, companion = linear_blocks(model, _updates(model, sent, returned))
    energy = float(companion @ companion)
    if energy == 0.0:
        raise FedcondError("the update leaves the companion block unchanged: nothing to reconstruct from")
    return block @ companion / energy


def undo_zscore(standardised: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The raw fingerprint from the z-scored one and the federation's published mean and std."""
    return standardised * np.maximum(std, STD_FLOOR) + mean


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b); 0 when either is zero."""
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms else 0.0


def relative_error(estimate: np.ndarray, truth: np.ndarray) -> float:
    """|estimate - truth| / |truth|."""
    return float(np.linalg.norm(estimate - truth) / max(np.linalg.norm(truth), 1e-300))

"""``head-fit = "ridge"``: the server fits the generated output layer to the clients' trained heads.

With ``conditioning = "hyper"`` a client's output layer is generated from its fingerprint:
``H(s) = s~ . G`` with ``s~ = [1, c]`` (c the fingerprint as the model reads it, after
``condition-scale``) and ``G`` the generator, row 0 the shared head ``[W0 | b0]`` and row j the
block ``[W_j | b_j]`` (``fedcond/model/conditioning/hyper.py``). Averaging G as FedAvg does moves every
client's head by ``sum_i w_i (s~_k . s~_i) dH_i``: each client's change reaches every other in
proportion to how alike their fingerprints are, so with more than two groups of clients one group's
head takes part of every other group's (and the head steps ``|s~|^2`` times faster than a plain
one while it trains).

Here each client instead trains its own head as a plain layer: it writes its generated head into the
base head, holds the generator's blocks at zero (frozen) and trains as Oracle's or FedAvg's client
would; it returns the trunk as it is and the products ``s~ (x) dH`` (the generator's shape) and
``s~ s~^T`` ((d + 1) x (d + 1)), each as a change from what it was sent: the training instruction
carries the model and a zero Gram matrix (one array more), and the reply the sent generator plus
``s~ (x) dH`` in the output layer's arrays and the sent Gram plus ``s~ s~^T`` after them. A reply
minus its instruction is then the trunk's update and the two products, which Flower's client-side
clipping (client-level DP) bounds as one vector. The server subtracts the generator it sent from
the mean; the sample-weighted means of the products are all it needs to take the ridge step

    G <- G + (P + ridge I)^-1 M,    P = sum_i w_i s~_i s~_i^T,    M = sum_i w_i s~_i dH_i^T,

the least-squares generator change that gives each client its own head change, shrunk by ``ridge``.
Clients whose fingerprints are the same share their mean change; clients whose fingerprints differ
in independent directions keep theirs apart; ``ridge`` pools fingerprints that differ only slightly
(one client alone keeps ``|s~|^2 / (|s~|^2 + ridge)`` of its change). Means are what SecAgg+ and the
streamed average give the server, so the step works under both. What one client's reply gives away
in the clear is exact: since ``s~_0 = 1``, row 0 of its ``s~ s~^T`` is ``[1, c]``, its fingerprint as
the model reads it, sign included, and row 0 of ``s~ (x) dH`` is ``dH``, its head's exact change in
the round (a plain update of a hyper head gives the fingerprint away too, ``tests/test_adversary.py``).
Under SecAgg+ the server sees the sample-weighted means alone; with ``fingerprint-epsilon`` both
products are computed from the noised fingerprint. Under client-level DP each client's trunk update
and products are clipped together, the server noises their unweighted mean (a clipped client counts
as a client whose products are scaled down, as in a weighted least-squares fit), and the step reads
the noised Gram matrix only along the directions it holds above its noise (``noisy_ridge_step``:
post-processing, so the guarantee stands). The step is the same whatever scale the fingerprint is
read at, up to ``ridge``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.model.conditioning.hyper import GENERATOR, HEAD_BIAS, HEAD_WEIGHT, head_of

HEAD_FIT = Option(
    "head-fit",
    "average",
    "`conditioning=hyper`: how the server updates the generated output layer, `average` (FedAvg of the "
    "generator, the paper's way) or `ridge` (each client trains its generated head as a plain layer; the "
    "server ridge-fits the generator to their changes, fedcond/model/head_fit.py)",
)
HEAD_FIT_RIDGE = Option(
    "head-fit-ridge",
    0.1,
    "`head-fit=ridge`: the ridge of the server's fit; a client alone keeps n / (n + ridge) of its head's change, "
    "n = ‖[1, s]‖² (about 2 with `condition-scale=unit`)",
    minimum=0.0,
)
HEAD_FITS = ("average", "ridge")

#: The output layer's arrays (``fedcond/model/conditioning/hyper.py``), in the order G is built from them.
HEAD_ARRAYS = (HEAD_WEIGHT, HEAD_BIAS, GENERATOR)


def fits_by_ridge(config: RunConfig) -> bool:
    return HEAD_FIT.of(config) == "ridge"


def check_head_fit(config: RunConfig) -> None:
    """A head fit that cannot apply is refused in one line, before anything starts."""
    fit = HEAD_FIT.of(config)
    if fit not in HEAD_FITS:
        raise FedcondError(f"unknown head-fit '{fit}'; choose one of {', '.join(HEAD_FITS)}")
    if fit == "ridge" and config.conditioning != "hyper":
        raise FedcondError(
            f"head-fit=ridge fits a generated output layer, and conditioning={config.conditioning} generates none; "
            "set conditioning=hyper, or head-fit=average"
        )
    if fit == "ridge" and HEAD_FIT_RIDGE.of(config) <= 0:
        raise FedcondError(
            f"head-fit-ridge must be positive (got {HEAD_FIT_RIDGE.of(config):g}): the fit is underdetermined "
            "without it wherever fingerprints span fewer directions than they have values"
        )


def head_indices(names: Sequence[str]) -> tuple[int, int, int]:
    """Where the output layer's three arrays are in a model's ``state_dict`` order."""
    missing = [name for name in HEAD_ARRAYS if name not in names]
    if missing:
        raise FedcondError(f"head-fit=ridge needs a hyper-conditioned model; this one has no {', '.join(missing)}")
    return tuple(list(names).index(name) for name in HEAD_ARRAYS)  # type: ignore[return-value]


def generator_of(weight: np.ndarray, bias: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """G, (d + 1, classes, hidden + 1): row 0 the shared head [W0 | b0], row j the block [W_j | b_j]."""
    return np.concatenate([head_of(weight, bias)[None], blocks], axis=0).astype(np.float64)


def generator_arrays(generator: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """G back into the model's three arrays (``generator_of``'s inverse)."""
    base, blocks = generator[0], generator[1:]
    return base[:, :-1].astype(dtype), base[:, -1].astype(dtype), blocks.astype(dtype)


def augmented(condition: np.ndarray, scale: float) -> np.ndarray:
    """s~ = [1, c]: the fingerprint as the model reads it (``condition-scale``), after the head's 1."""
    return np.concatenate([[1.0], np.asarray(condition, dtype=np.float64).ravel() * scale])


def generated_head(generator: np.ndarray, condition: np.ndarray) -> np.ndarray:
    """The client's output layer [W | b] = s~ . G, (classes, hidden + 1)."""
    return np.tensordot(condition, generator, axes=1)


def split_instruction(parameters: Sequence[np.ndarray], model_arrays: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A training instruction's model and the Gram matrix the reply's is a change from (zero)."""
    if len(parameters) != model_arrays + 1:
        raise FedcondError(
            f"head-fit=ridge expects the model's {model_arrays} arrays and a Gram matrix in a training instruction, "
            f"got {len(parameters)}; server and clients disagree on head-fit"
        )
    return list(parameters[:-1]), np.asarray(parameters[-1], dtype=np.float64)


def noisy_ridge_step(generator: np.ndarray, moment: np.ndarray, gram: np.ndarray, ridge: float, noise_std: float
                     ) -> np.ndarray:  # fmt: skip
    """``ridge_step`` from means noised by client-level DP (std ``noise_std`` on each value): the Gram
    matrix made symmetric, and the step taken only along its eigenvectors whose eigenvalue stands above
    the noise's spectral norm (2 x std x sqrt(size), the edge of a symmetric Gaussian matrix's spectrum).
    The other directions are those no client's fingerprint spans, where P holds noise alone and
    (P + ridge I)^-1 would multiply M's noise by up to 1 / ridge; there the generator keeps its rows.
    Post-processing of what DP released: the guarantee stands."""
    _check_shapes(generator, moment, gram)
    size = len(generator)
    symmetric = (np.asarray(gram, dtype=np.float64) + np.asarray(gram, dtype=np.float64).T) / 2
    values, vectors = np.linalg.eigh(symmetric)
    kept = values > 2 * noise_std * np.sqrt(size)
    inverse = np.where(kept, 1.0 / (np.maximum(values, 0.0) + ridge), 0.0)
    change = (vectors * inverse) @ (vectors.T @ np.asarray(moment, dtype=np.float64).reshape(size, -1))
    return generator + change.reshape(generator.shape)


def client_products(condition: np.ndarray, head_change: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a client sends for the fit: s~ (x) dH (the generator's shape) and s~ s~^T."""
    return np.multiply.outer(condition, head_change), np.outer(condition, condition)


def ridge_step(generator: np.ndarray, moment: np.ndarray, gram: np.ndarray, ridge: float) -> np.ndarray:
    """G + (P + ridge I)^-1 M, from the means P (``gram``) and M (``moment``) of the clients' products."""
    _check_shapes(generator, moment, gram)
    size = len(generator)
    system = np.asarray(gram, dtype=np.float64) + ridge * np.eye(size)
    change = np.linalg.solve(system, np.asarray(moment, dtype=np.float64).reshape(size, -1))
    return generator + change.reshape(generator.shape)


def _check_shapes(generator: np.ndarray, moment: np.ndarray, gram: np.ndarray) -> None:
    size = len(generator)
    if gram.shape != (size, size) or moment.shape != generator.shape:
        raise FedcondError(
            f"the head fit got a {gram.shape} Gram matrix and a {moment.shape} moment for a {generator.shape} "
            "generator; server and clients disagree on the model"
        )


class PlainHead:
    """The client's generated output layer written into the base head, with the generator's blocks
    held at zero and frozen: the model then computes s~ . G as before, and trains it as a plain layer
    (the steps of Oracle's or FedAvg's head). Restores the blocks' ``requires_grad`` on exit; what
    training changed is ``change``."""

    def __init__(self, model: nn.Module, condition: np.ndarray) -> None:
        self.model = model
        self.head = generated_head(generator_of(*(self._array(name) for name in HEAD_ARRAYS)), condition)

    def _array(self, name: str) -> np.ndarray:
        return self.model.state_dict()[name].detach().cpu().numpy()

    def __enter__(self) -> PlainHead:
        state = self.model.state_dict()
        weight, bias, _ = generator_arrays(self.head[None], np.float32)
        with torch.no_grad():
            state[HEAD_WEIGHT].copy_(torch.from_numpy(weight))
            state[HEAD_BIAS].copy_(torch.from_numpy(bias))
            state[GENERATOR].zero_()
        self.model.hyper.weight.requires_grad_(False)
        return self

    def __exit__(self, *exc: object) -> None:
        self.model.hyper.weight.requires_grad_(True)

    def change(self) -> np.ndarray:
        """The trained head minus the generated one it started from, (classes, hidden + 1)."""
        return head_of(self._array(HEAD_WEIGHT), self._array(HEAD_BIAS)) - self.head

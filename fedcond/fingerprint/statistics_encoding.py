"""The fingerprint statistics' secure sum: exact fixed point, carried by Flower's SecAgg+.

Before round 1 every training client contributes (f, f^2, 1) for its raw fingerprint f; the server
learns only the sum over the clients that finished the protocol (SecAgg+ tolerates dropouts) and
publishes the mean and standard deviation (fedcond.fingerprint.fingerprints.mean_and_std).

SecAgg+ quantises floats stochastically, which would make the published statistics, and with them
a whole run, differ between two runs with the same seed. So each value travels as exact integers:
its fixed-point form round(v x 2^30) split into ``LIMBS`` signed digits of base 2^22, each in
[-2^21, 2^21). With SecAgg+'s clipping range 2^22 and quantisation range 2^23 (one level per
integer, ``CLIPPING_RANGE``, ``QUANTIZATION_RANGE``) an integer input is quantised to itself, the
weights are all 1, and the sum of each digit over the clients comes back exact; the server
recombines the digits with Python integers, so the total cannot wrap either. The range check:
a client refuses a value of magnitude 2^33 or more (``MAX_MAGNITUDE``), and the sum of n clients'
digits stays below SecAgg+'s modulus 2^32 for n <= ``MAX_CLIENTS``; the decoded count must equal the
number of clients the protocol says took part.
"""

from __future__ import annotations

import numpy as np

from fedcond.errors import FedcondError

FRACTION_BITS = 30
LIMB_BITS = 22
LIMBS = 3
#: The largest |value| (a fingerprint coordinate or its square) a client may contribute.
MAX_MAGNITUDE = 2.0**33
#: SecAgg+'s settings for the statistics: every integer digit d in [-2^21, 2^21) becomes the level d + 2^22.
CLIPPING_RANGE = float(2**LIMB_BITS)
QUANTIZATION_RANGE = 2 ** (LIMB_BITS + 1)
#: The most clients whose digits and weights (2^23 each) sum below SecAgg+'s modulus 2^32.
MAX_CLIENTS = 2**32 // QUANTIZATION_RANGE - 1


def statistics_vector(raw_fingerprint: np.ndarray, clip: float = 0.0) -> np.ndarray:
    """What one client contributes: (f, f^2, 1); with ``clip`` > 0, (f, f^2) scaled to an L2 norm of at
    most ``clip`` (the count stays 1), the bound a noised sum is calibrated to (client-level DP)."""
    raw = np.asarray(raw_fingerprint, dtype=np.float64)
    moments = np.concatenate([raw, raw**2])
    norm = float(np.linalg.norm(moments))
    if clip > 0 and norm > clip:
        moments = moments * (clip / norm)
    return np.concatenate([moments, [1.0]])


def encode(values: np.ndarray) -> np.ndarray:
    """``values`` as exact integer digits, shape (LIMBS, len(values)), float64 (SecAgg+'s input type)."""
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)) or np.any(np.abs(values) >= MAX_MAGNITUDE):
        worst = values[~np.isfinite(values) | (np.abs(values) >= MAX_MAGNITUDE)][0]
        raise FedcondError(
            f"a fingerprint statistic of {worst:g} is outside the secure sum's range (|value| < 2^33); "
            "check the client's fingerprint (fingerprint-encoder, data)"
        )
    half = 1 << (LIMB_BITS - 1)
    digits = np.zeros((LIMBS, len(values)))
    for column, value in enumerate(values):
        remaining = round(float(value) * 2**FRACTION_BITS)  # a Python int: exact at any size
        for limb in range(LIMBS):
            digit = (remaining + half) % (1 << LIMB_BITS) - half
            digits[limb, column] = digit
            remaining = (remaining - digit) >> LIMB_BITS
    return digits


def decode(mean_digits: np.ndarray, count: int) -> np.ndarray:
    """The sum of the clients' values from SecAgg+'s mean of their digits over ``count`` clients."""
    digit_sums = np.rint(np.asarray(mean_digits, dtype=np.float64) * count)
    if digit_sums.shape[0] != LIMBS:
        raise FedcondError("the secure sum returned malformed digits; server and clients run other fedcond versions")
    totals = [
        sum(int(digit_sums[limb, column]) << (LIMB_BITS * limb) for limb in range(LIMBS))
        for column in range(digit_sums.shape[1])
    ]
    return np.array([total / 2**FRACTION_BITS for total in totals])


def check_clients(count: int) -> None:
    """Refuse a federation whose digit sums could wrap modulo 2^32."""
    if count > MAX_CLIENTS:
        raise FedcondError(
            f"the fingerprint statistics' secure sum holds up to {MAX_CLIENTS} clients (its digits sum below 2^32), "
            f"this federation trains {count}; use normalisation=log or none, or fewer clients"
        )


def open_statistics(mean_digits: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(sum of f, sum of f^2) from the protocol's output, after checking the decoded count."""
    total = decode(mean_digits, count)
    if round(total[-1]) != count:
        raise FedcondError(
            f"the fingerprint statistics' secure sum decoded a count of {total[-1]:g} from {count} clients: "
            "the sum is corrupt; restart the run"
        )
    dim = (len(total) - 1) // 2
    return total[:dim], total[dim : 2 * dim]

"""Secure aggregation's settings: which sums go through Flower's SecAgg+ and with what protocol values.

The protocol itself is Flower's (``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on the
clients; fedcond/federation/secagg_workflow.py and fedcond/federation/secagg_mod.py). Two kinds of sum use it:

- the fingerprint statistics (sum of f, f^2 and a count) before round 1, always
  (fedcond.fingerprint.statistics_encoding);
- with ``secure-aggregation = "secaggplus"``, every round's model update of the methods whose server
  needs only the sample-weighted sum of the returned models (fedavg, conditional, fedprox, ditto's global model).

SecAgg+ quantises each value to an integer in [0, quantization-range) after clipping it to
[-clipping-range, clipping-range], and sums modulo 2^32 (Flower's modulus): the sum of n clients'
values never wraps while n x quantization-range <= 2^32, checked before a run starts. A client whose
parameter lies outside the clipping range refuses to send (fedcond never lets SecAgg+ clip silently).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint.statistics_encoding import check_clients as check_statistics_clients

MODES = ("none", "secaggplus")
#: Flower's SecAgg+ modulus (its default; the masks and sums are taken modulo this).
MODULUS = 2**32

SECURE_AGGREGATION = Option(
    "secure-aggregation",
    "none",
    "`none`, or `secaggplus`: every round's model update goes through Flower's SecAgg+, so the server sees only "
    "the sample-weighted mean of the updates (methods whose server averages one global model; with client-dp "
    "only client-side)",
)
SECAGG_NUM_SHARES = Option(
    "secagg-num-shares", 1.0, "SecAgg+: the fraction of a round's clients each client secret-shares its keys with",
    maximum=1,
)  # fmt: skip
SECAGG_RECONSTRUCTION_THRESHOLD = Option(
    "secagg-reconstruction-threshold", 0.67,
    "SecAgg+: the fraction of a client's shares needed to rebuild its secrets (more: harder to unmask, "
    "fewer dropouts tolerated)",
    maximum=1,
)  # fmt: skip
SECAGG_CLIPPING_RANGE = Option(
    "secagg-clipping-range",
    8.0,
    "SecAgg+: the largest absolute parameter value a client may send (beyond it: that client fails)",
)
SECAGG_QUANTIZATION_RANGE = Option(
    "secagg-quantization-range", 2**22, "SecAgg+: integer levels over [-clipping-range, clipping-range]", minimum=2
)
SECAGG_MIN_CLIENTS = Option(
    "secagg-min-clients", 2,
    "the fewest clients a secure sum may combine (fingerprint statistics; model updates with secaggplus)",
    minimum=2,
)  # fmt: skip
#: Every secure-aggregation setting; the registry declares them for every federated method.
OPTIONS = (
    SECURE_AGGREGATION, SECAGG_NUM_SHARES, SECAGG_RECONSTRUCTION_THRESHOLD, SECAGG_CLIPPING_RANGE,
    SECAGG_QUANTIZATION_RANGE, SECAGG_MIN_CLIENTS,
)  # fmt: skip


@dataclass(frozen=True)
class SecureAggregation:
    """A run's secure-aggregation settings (the Options above, read once)."""

    mode: str
    num_shares: float
    reconstruction_threshold: float
    clipping_range: float
    quantization_range: int
    min_clients: int

    @classmethod
    def of(cls, config: RunConfig) -> SecureAggregation:
        return cls(
            str(SECURE_AGGREGATION.of(config)), float(SECAGG_NUM_SHARES.of(config)),
            float(SECAGG_RECONSTRUCTION_THRESHOLD.of(config)), float(SECAGG_CLIPPING_RANGE.of(config)),
            int(SECAGG_QUANTIZATION_RANGE.of(config)), int(SECAGG_MIN_CLIENTS.of(config)),
        )  # fmt: skip

    @property
    def model_updates(self) -> bool:
        """Whether every round's model update goes through SecAgg+."""
        return self.mode == "secaggplus"

    @property
    def quantization_step(self) -> float:
        """The spacing of the values SecAgg+ can represent (its rounding is stochastic, unbiased)."""
        return 2 * self.clipping_range / self.quantization_range


def describe(config: RunConfig) -> dict[str, object] | None:
    """What run.json records of secure aggregation of model updates (None: none)."""
    settings = SecureAggregation.of(config)
    if not settings.model_updates:
        return None
    return {
        "protocol": "SecAgg+ (flwr.server.workflow.SecAggPlusWorkflow, flwr.client.mod.secaggplus_mod)",
        "num_shares": settings.num_shares,
        "reconstruction_threshold": settings.reconstruction_threshold,
        "clipping_range": settings.clipping_range,
        "quantization_range": settings.quantization_range,
        "quantization_step": settings.quantization_step,
        "modulus": MODULUS,
        "min_clients": settings.min_clients,
    }


def check_secure_aggregation(config: RunConfig, refusal: str | None, sums_statistics: bool) -> None:
    """The secure-aggregation settings on their own and against the method, in one line naming the fix.

    ``refusal``: why the method's server cannot work from a sum (None: it can); ``sums_statistics``:
    whether the run sums fingerprint statistics before round 1 (conditioned, federated normalisation).
    """
    settings = SecureAggregation.of(config)
    if settings.mode not in MODES:
        raise FedcondError(f"unknown secure-aggregation '{settings.mode}'; choose one of {', '.join(MODES)}")
    if settings.model_updates and refusal is not None:
        raise FedcondError(f"secure-aggregation=secaggplus cannot serve {config.method}: {refusal}")
    if not (settings.model_updates or sums_statistics):
        return
    if not 0 < settings.num_shares <= 1 or not 0 < settings.reconstruction_threshold <= 1:
        raise FedcondError("secagg-num-shares and secagg-reconstruction-threshold are fractions in (0, 1]")
    clients = config.num_training_clients
    if settings.min_clients > clients:
        what = "the fingerprint statistics" if sums_statistics else "each round's updates"
        raise FedcondError(
            f"{what} are summed securely over at least secagg-min-clients={settings.min_clients} clients, but the "
            f"federation trains {clients}; lower secagg-min-clients, add clients"
            + (", or use normalisation=log or none" if sums_statistics else "")
        )
    if sums_statistics:
        check_statistics_clients(clients)
    if not settings.model_updates:
        return
    if settings.clipping_range <= 0:
        raise FedcondError(f"secagg-clipping-range must be positive (got {settings.clipping_range:g})")
    if clients * settings.quantization_range >= MODULUS:
        raise FedcondError(
            f"{clients} clients x secagg-quantization-range={settings.quantization_range} reach SecAgg+'s modulus "
            f"2^32, so the sum could wrap; set secagg-quantization-range below {MODULUS // clients}"
        )

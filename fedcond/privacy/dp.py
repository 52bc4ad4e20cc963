"""Sample-level differential privacy of everything a client releases: DP-SGD for its training (Opacus,
see ``fedcond.model.training.train_private``), a differentially private fingerprint, and the accounting.

The unit of privacy is one training sample of one client; two data sets are neighbours when one is
the other plus one sample (add/remove). The client's sample count n is treated as public, as Opacus
does (its sampling rate is batch-size / n) and as the client itself does when it reports n to the
server for weighted averaging. docs/privacy.md derives every bound below.

Why the fingerprint needs its own mechanism: it is a function of the *whole* local data set and it
is an input of the model, so one sample more or less changes every per-sample gradient through it;
DP-SGD's per-sample clipping does not bound that. Released once with Gaussian noise calibrated to
its add/remove sensitivity, it becomes a DP output, and everything the model then does with it is
post-processing; the two mechanisms compose (Renyi DP, one accountant for both).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from torch import nn

from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.fingerprint.fingerprints import FINGERPRINTS, per_class_width, public_projection

DP_NOISE_MULTIPLIER = Option(
    "dp-noise-multiplier", 0.0, "DP-SGD: noise std / dp-max-grad-norm at every local step (0: no DP-SGD)", minimum=0
)
DP_MAX_GRAD_NORM = Option("dp-max-grad-norm", 1.0, "DP-SGD: the L2 bound each sample's gradient is clipped to")
DP_DELTA = Option("dp-delta", 1e-5, "the delta of every (epsilon, delta) fedcond reports, sample- and client-level")
FINGERPRINT_EPSILON = Option(
    "fingerprint-epsilon", 0.0, "epsilon of the Gaussian noise added once to the fingerprint (0: exact fingerprint)",
    minimum=0,
)  # fmt: skip
#: The sample-level settings; the registry declares them for every method (fedcond/federation/methods.py).
OPTIONS = (DP_NOISE_MULTIPLIER, DP_MAX_GRAD_NORM, DP_DELTA, FINGERPRINT_EPSILON)

#: The fewest training samples a client may hold for a DP fingerprint: the bound compares the data
#: set with its neighbour one sample smaller, whose covariance needs two samples.
MIN_FINGERPRINT_SAMPLES = 3


@dataclass(frozen=True)
class SampleLevelPrivacy:
    """A run's sample-level settings (the Options above, read once)."""

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    fingerprint_epsilon: float

    @classmethod
    def of(cls, config: RunConfig) -> SampleLevelPrivacy:
        return cls(
            DP_NOISE_MULTIPLIER.of(config), DP_MAX_GRAD_NORM.of(config), DP_DELTA.of(config),
            FINGERPRINT_EPSILON.of(config),
        )  # fmt: skip

    @property
    def dp_sgd(self) -> bool:
        return self.noise_multiplier > 0

    @property
    def private_fingerprint(self) -> bool:
        return self.fingerprint_epsilon > 0

    @property
    def enabled(self) -> bool:
        return self.dp_sgd or self.private_fingerprint


def check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise FedcondError(f"dp-delta must be in (0, 1), typically below 1 / (samples per client) (got {delta})")


def check_sample_level(config: RunConfig, conditioned: bool) -> None:
    """The sample-level settings that need no method: each value, the fingerprint, the model."""
    privacy = SampleLevelPrivacy.of(config)
    check_delta(privacy.delta)
    if privacy.max_grad_norm <= 0:
        raise FedcondError(f"dp-max-grad-norm must be positive (got {privacy.max_grad_norm})")
    if privacy.private_fingerprint:
        if not conditioned:
            raise FedcondError(
                f"fingerprint-epsilon applies to conditioned methods; {config.method} feeds no fingerprint: "
                "set fingerprint-epsilon=0"
            )
        if config.fingerprint not in SENSITIVITY_BOUNDS:
            why = (
                "reads no training sample, so it costs no privacy and needs no noise"
                if not fingerprint_needs_data(config.fingerprint)
                else "has no sensitivity bound to calibrate noise to (fedcond.privacy.dp.SENSITIVITY_BOUNDS)"
            )
            raise FedcondError(
                f"fingerprint {config.fingerprint} {why}: set fingerprint-epsilon=0 "
                f"(DP fingerprints: {', '.join(SENSITIVITY_BOUNDS)})"
            )
        if config.fingerprint_encoder != "pixels":
            raise FedcondError(
                "fingerprint-epsilon needs fingerprint-encoder=pixels: the sensitivity bound needs features in "
                f"[0, 1], and the {config.fingerprint_encoder} encoder's embeddings have no such bound"
            )
    if privacy.dp_sgd:
        if conditioned and fingerprint_needs_data(config.fingerprint) and not privacy.private_fingerprint:
            raise FedcondError(
                "dp-noise-multiplier with a conditioned method needs fingerprint-epsilon > 0: the exact fingerprint "
                "depends on every sample, which DP-SGD's per-sample clipping does not bound (see docs/privacy.md)"
            )
        check_per_sample_gradients(config, conditioned)


def fingerprint_needs_data(name: str) -> bool:
    return FINGERPRINTS[name].needs_data


# -- sensitivity of the fingerprints -----------------------------------------------------------------
def covariance_change_bound(diameter_squared: float, smaller_count: int) -> float:
    """An L2 (Frobenius) bound on how much the sample covariance C = S / (m - 1) of ``smaller_count``
    = m >= 2 rows changes when one row is added, all rows lying in a set of squared diameter D^2.

    C' - C = -C / m + v v^T / (m + 1) with v the new row minus the old mean (|v| <= D), and
    |C|_F <= sqrt(|C|_2 tr C) <= D^2 sqrt(m / (8 (m - 1))) (Popoviciu for |C|_2, pairwise distances
    for tr C), so |C' - C|_F <= D^2 (sqrt(m / (8 (m - 1))) / m + 1 / (m + 1)).
    """
    m = smaller_count
    if m < 2:
        raise ValueError("the bound needs at least two rows in the smaller data set")
    return diameter_squared * (math.sqrt(m / (8 * (m - 1))) / m + 1 / (m + 1))


def spectrum_change_bound(diameter_squared: float, smaller_count: int, dim: int) -> float:
    """An L2 bound on how much the top-``dim`` eigenvalues of that covariance change (same setting).

    Two bounds, the smaller wins: (a) interlacing: the eigenvalues move by -lambda_i(C) / m and then
    up by a non-negative amount summing to |v|^2 / (m + 1), giving ``covariance_change_bound``;
    (b) Weyl: every eigenvalue moves by at most |C' - C|_2 <= max(|C|_2 / m, |v|^2 / (m + 1))
    (a difference of two PSD matrices), i.e. sqrt(dim) D^2 max(1 / (4 (m - 1)), 1 / (m + 1)).
    """
    m = smaller_count
    weyl = math.sqrt(dim) * diameter_squared * max(1 / (4 * (m - 1)), 1 / (m + 1))
    return min(covariance_change_bound(diameter_squared, m), weyl)


def projection_norm(num_features: int, width: int) -> float:
    """|P|_2 of the public projection the sketches use (its largest singular value)."""
    return float(np.linalg.norm(public_projection(num_features, width), 2))


def _eigen_sensitivity(num_samples: int, num_features: int, _num_classes: int, dim: int) -> float:
    # Rows [x || onehot(y)] have squared diameter D^2 = p + 2; the neighbour pairs are (n - 1, n) and
    # (n, n + 1), the first the worse.
    return spectrum_change_bound(num_features + 2.0, num_samples - 1, dim)


def _class_eigen_sensitivity(_num_samples: int, num_features: int, num_classes: int, dim: int) -> float:
    # Only the sample's class block changes; its count is private and may be tiny: the worst case
    # over all counts (1 -> 2 rows: D^2 / 2, m -> m + 1: decreasing in m) with D^2 = p.
    width = per_class_width(dim, num_classes)
    return max(num_features / 2.0, spectrum_change_bound(float(num_features), 2, width))


def _projected_diameter_squared(num_features: int, num_classes: int, dim: int) -> float:
    return projection_norm(num_features, per_class_width(dim, num_classes)) ** 2 * num_features


def _class_mean_sensitivity(_num_samples: int, num_features: int, num_classes: int, dim: int) -> float:
    # One block, the class mean projected on P; worst when a class goes from 0 to 1 sample (0 -> P^T x).
    return math.sqrt(_projected_diameter_squared(num_features, num_classes, dim))


def _label_cov_sensitivity(num_samples: int, num_features: int, num_classes: int, dim: int) -> float:
    # The pixel-label block of the covariance of [P^T x || onehot(y)]; a symmetric change holds that
    # block twice, so its Frobenius norm is at most |C' - C|_F / sqrt(2).
    diameter_squared = _projected_diameter_squared(num_features, num_classes, dim) + 2.0
    return covariance_change_bound(diameter_squared, num_samples - 1) / math.sqrt(2)


#: Every fingerprint with an L2 sensitivity bound, (samples, pixels, classes, dim) -> bound: the ones
#: ``fingerprint-epsilon`` can noise (a fingerprint without one is refused with it; the controls read
#: no sample and need no noise at all). A new fingerprint adds its bound here to be made private.
SENSITIVITY_BOUNDS: dict[str, Callable[[int, int, int, int], float]] = {
    "eigen": _eigen_sensitivity,
    "class-eigen": _class_eigen_sensitivity,
    "class-mean": _class_mean_sensitivity,
    "label-cov": _label_cov_sensitivity,
}


def fingerprint_sensitivity(name: str, num_samples: int, num_features: int, num_classes: int, dim: int) -> float:
    """The L2 sensitivity of fingerprint ``name`` to adding or removing one training sample, for a client
    holding ``num_samples`` samples of ``num_features`` pixels in [0, 1] and labels in ``num_classes``
    (``SENSITIVITY_BOUNDS`` holds each fingerprint's bound and why it holds)."""
    if name not in SENSITIVITY_BOUNDS:
        raise FedcondError(f"fingerprint {name} has no sensitivity bound; set fingerprint-epsilon=0")
    if num_samples < MIN_FINGERPRINT_SAMPLES:
        raise FedcondError(
            f"a DP fingerprint needs at least {MIN_FINGERPRINT_SAMPLES} training samples, the client holds "
            f"{num_samples}; use more data per client or fingerprint-epsilon=0"
        )
    return SENSITIVITY_BOUNDS[name](num_samples, num_features, num_classes, dim)


# -- calibration and release -----------------------------------------------------------------------
@functools.cache
def gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """The noise multiplier z (std / sensitivity) of one Gaussian release that the Renyi-DP accountant
    (the one that composes it with DP-SGD) puts at ``epsilon`` for ``delta``."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's note on the alpha grid's ends
        return float(
            get_noise_multiplier(
                target_epsilon=epsilon, target_delta=delta, sample_rate=1.0, steps=1, accountant="rdp",
                epsilon_tolerance=0.001,
            )
        )  # fmt: skip


@dataclass(frozen=True)
class FingerprintRelease:
    """A fingerprint with its Gaussian noise, and what calibrated it."""

    vector: np.ndarray
    sensitivity: float
    noise_multiplier: float

    @property
    def noise_std(self) -> float:
        return self.sensitivity * self.noise_multiplier


def private_fingerprint(
    raw: np.ndarray, name: str, images: np.ndarray, labels: np.ndarray, num_classes: int, dim: int,
    privacy: SampleLevelPrivacy,
) -> FingerprintRelease:  # fmt: skip
    """``raw`` (fingerprint ``name`` of ``images``, ``labels``) plus Gaussian noise for
    ``privacy.fingerprint_epsilon`` at ``privacy.delta``.

    The noise comes from the operating system's entropy, never from the run's seed: whoever knows
    the seed (the server does) could otherwise subtract it.
    """
    pixels = images.reshape(len(images), -1)
    if pixels.size and (pixels.min() < 0 or pixels.max() > 1):
        raise FedcondError("a DP fingerprint needs pixels in [0, 1]; this client's images are not")
    sensitivity = fingerprint_sensitivity(name, len(labels), pixels.shape[1], num_classes, dim)
    multiplier = gaussian_noise_multiplier(privacy.fingerprint_epsilon, privacy.delta)
    noise = np.random.default_rng().normal(0.0, sensitivity * multiplier, size=raw.shape)
    return FingerprintRelease(raw + noise, sensitivity, multiplier)


# -- accounting ------------------------------------------------------------------------------------
@dataclass
class PrivacyLedger:
    """Every Gaussian mechanism a client ran on its training data, as Opacus's RDP accountant keeps
    them: (noise multiplier, sampling rate, steps). A one-off release (the fingerprint) is one step
    at sampling rate 1. Kept in the client's state between rounds."""

    entries: list[tuple[float, float, int]] = field(default_factory=list)

    def add(self, noise_multiplier: float, sample_rate: float, steps: int) -> None:
        """Record ``steps`` runs of one mechanism. Renyi DP composes by addition, in any order, so steps
        of a mechanism already recorded join its entry: the ledger, and the cost of ``epsilon``, stay
        the size of the number of distinct mechanisms (not of rounds)."""
        if steps <= 0:
            return
        mechanism = (float(noise_multiplier), float(sample_rate))
        for index, (z, q, earlier) in enumerate(self.entries):
            if (z, q) == mechanism:
                self.entries[index] = (z, q, earlier + int(steps))
                return
        self.entries.append((*mechanism, int(steps)))

    def epsilon(self, delta: float) -> float:
        """The composed epsilon of every entry at ``delta`` (0 with none)."""
        if not self.entries:
            return 0.0
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = list(self.entries)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(accountant.get_epsilon(delta))

    def to_record(self) -> dict[str, list[float] | list[int]]:
        return {
            "noise-multipliers": [entry[0] for entry in self.entries],
            "sample-rates": [entry[1] for entry in self.entries],
            "steps": [entry[2] for entry in self.entries],
        }

    @classmethod
    def from_record(cls, record: dict[str, list[float] | list[int]]) -> PrivacyLedger:
        columns = (record["noise-multipliers"], record["sample-rates"], record["steps"])
        return cls([(float(z), float(q), int(steps)) for z, q, steps in zip(*columns, strict=True)])


def gaussian_rounds_epsilon(
    noise_multiplier: float, rounds: int, delta: float, sample_rate: float = 1.0, releases: int = 0
) -> float:
    """Epsilon of ``rounds`` Gaussian releases, each over a sample of the clients at ``sample_rate``
    (client-level DP: 1 when every client takes part in every round; clients-per-round / clients
    with sampling, accounted as Poisson subsampling at that rate, the usual approximation for a
    fixed-size sample, as in McMahan et al. 2018), composed with ``releases`` one-off releases of the
    same multiplier over every client (a set-up's noised sum): inf without noise."""
    if noise_multiplier <= 0:
        return math.inf
    ledger = PrivacyLedger()
    ledger.add(noise_multiplier, sample_rate, rounds)
    ledger.add(noise_multiplier, 1.0, releases)
    return ledger.epsilon(delta)


# -- what Opacus can train -------------------------------------------------------------------------
@functools.cache
def per_sample_gradient_layers() -> frozenset[type]:
    """The module types Opacus computes per-sample gradients of: its own, and every conditioning
    mechanism's layers (each mechanism registers its own, ``Mechanism.register_grad_samplers``)."""
    from opacus.grad_sample import GradSampleModule

    from fedcond.model.conditioning import MECHANISMS, mechanism

    for name in MECHANISMS:
        mechanism(name).register_grad_samplers()
    return frozenset(GradSampleModule.GRAD_SAMPLERS)


def unsupported_layers(model: nn.Module) -> list[str]:
    """Why Opacus cannot train ``model`` with per-sample gradients (empty: it can)."""
    from opacus.validators import ModuleValidator

    supported = per_sample_gradient_layers()
    problems = [str(error).splitlines()[0] for error in ModuleValidator.validate(model, strict=False)]
    for name, module in model.named_modules():
        own = [parameter for parameter in module.parameters(recurse=False) if parameter.requires_grad]
        if own and type(module) not in supported:
            problems.append(f"no per-sample gradients for {type(module).__name__} ({name or 'the network'})")
    return problems


def check_per_sample_gradients(config: RunConfig, conditioned: bool) -> None:
    """Refuse, in one line, a model Opacus cannot train privately (e.g. CIFAR's BatchNorm network)."""
    from fedcond.data.datasets import dataset_spec
    from fedcond.model.networks import build_run_model

    model = build_run_model(config, dataset_spec(config.dataset).num_classes, conditioned)
    problems = unsupported_layers(model)
    if problems:
        raise FedcondError(
            f"dp-noise-multiplier needs per-sample gradients, which Opacus cannot compute for the {config.dataset} "
            f"network ({problems[0]}); use digits, mnist or fashion-mnist, or dp-noise-multiplier=0"
        )


def describe(config: RunConfig, conditioned: bool) -> dict[str, object] | None:
    """What run.json records of the sample-level settings (None: none is on)."""
    privacy = SampleLevelPrivacy.of(config)
    if not privacy.enabled:
        return None
    fingerprint = None
    if privacy.private_fingerprint and conditioned:
        fingerprint = {
            "epsilon": privacy.fingerprint_epsilon,
            "noise_multiplier": gaussian_noise_multiplier(privacy.fingerprint_epsilon, privacy.delta),
            "noise_std": "noise_multiplier x the sensitivity at the client's own sample count (docs/privacy.md)",
        }
    return {
        "unit": "one training sample of one client (add/remove; sample counts public)",
        "delta": privacy.delta,
        "dp_sgd": {
            "noise_multiplier": privacy.noise_multiplier,
            "max_grad_norm": privacy.max_grad_norm,
            "sampling": "poisson",
        }
        if privacy.dp_sgd
        else None,
        "fingerprint": fingerprint,
        "accountant": "Renyi DP (Opacus RDPAccountant), fingerprint and DP-SGD composed; history column epsilon",
    }

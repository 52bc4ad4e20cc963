"""The run configuration: Flower's kebab-case run config, typed, validated and resolved.

Every key lives in ``[tool.flwr.app.config]`` of ``pyproject.toml`` and can be overridden with
``flwr run . --run-config 'key=value'``. ``RunConfig.from_mapping`` is the single place where those
raw values become typed settings, so ServerApp, ClientApp and CLI all agree on them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fedcond.conditioning import check_conditioning
from fedcond.errors import FedcondError
from fedcond.fingerprint import check_fingerprint

NORMALISATIONS = ("none", "log", "federated")
# numpy's and torch's generators both take any seed in [0, 2**32); IFCA's per-cluster model seeds
# (seed * 1000 + k) stay far inside torch's 64-bit range, and a negative seed is a numpy traceback.
MAX_SEED = 2**32 - 1
# The fingerprint is the conditioned model's input and each client's secure-sum message (2 x dim + 1
# values), and spectral fingerprints have at most as many values as the features have dimensions
# (794 for MNIST's pixels + labels): beyond 1024 a run only pays memory and time for zero padding.
MAX_FINGERPRINT_DIM = 1024


@dataclass(frozen=True)
class RunConfig:
    """All settings of one run; field ``foo_bar`` is run-config key ``foo-bar``."""

    method: str = "conditional"
    dataset: str = "digits"
    scenario: str = "label-shift"
    num_clusters: int = 3
    clients_per_cluster: int = 5
    num_server_rounds: int = 10
    # Scenario details: E2b's angles (C1..C4, degrees "0,90,180", or "" for K evenly spaced) and a
    # uniform subsample of every cluster's data for quick runs (recorded in run.json).
    rotations: str = ""
    data_fraction: float = 1.0
    covariate_clusters: int = 2
    # 0 means "the dataset's default" (see fedcond.datasets.DATASETS); run.json records the value used.
    local_epochs: int = 0
    batch_size: int = 0
    learning_rate: float = 0.01
    momentum: float = 0.9
    fingerprint_dim: int = 32
    # phi in Z = [phi(x) || onehot(y)]: "pixels", or the dataset a frozen encoder is trained on.
    fingerprint_encoder: str = "pixels"
    normalisation: str = "federated"
    # What each client computes (fedcond.fingerprint.FINGERPRINTS) and how the model uses it.
    fingerprint: str = "eigen"
    conditioning: str = "concat"
    # Units of the FC hidden layer; 0: the paper's (128 for 28x28 images and digits, 256 for CIFAR).
    # For size-matched controls: a wider concat network with as many parameters as another mechanism's.
    hidden_units: int = 0
    # Extra clients per cluster that never train, only evaluate the shared model each round.
    held_out_clients: int = 0
    seed: int = 0
    data_dir: str = ""
    results_dir: str = ""
    run_name: str = ""
    # How long the server waits for all num-clusters x clients-per-cluster nodes to connect.
    node_timeout: int = 60
    verbose: bool = True
    # Settings the methods declare next to themselves (``Option``), as sorted (key, value) pairs.
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_mapping(
        cls, mapping: Mapping[str, Any], declared: Sequence[Option] = (), keep_unknown: bool = False
    ) -> RunConfig:
        """Build from a run-config mapping (kebab-case keys); unknown keys and bad types are errors.

        ``declared`` are the methods' own options (the method registry knows them all); those not
        in ``mapping`` take their defaults, so ``run.json`` records every value a run could read.
        With ``keep_unknown`` (a ClientApp, which declares only what it reads), a key that is no
        field and no declared option is kept as given among the options instead of refused.
        """
        by_key = {field.name.replace("_", "-"): field for field in fields(cls) if field.name != "options"}
        options = {option.key: option for option in declared}
        values: dict[str, Any] = {}
        chosen = {key: option.default for key, option in options.items()}
        for key, raw in mapping.items():
            if key in options:
                chosen[key] = options[key].coerce(raw)
                continue
            field = by_key.get(key)
            if field is None and keep_unknown:
                chosen[key] = raw
                continue
            if field is None:
                known = ", ".join(sorted([*by_key, *options]))
                raise FedcondError(f"unknown run-config key '{key}'; known keys: {known}")
            values[field.name] = _coerce(key, raw, _field_type(field))
        config = cls(**values, options=tuple(sorted(chosen.items())))
        config.validate()
        return config

    def to_mapping(self) -> dict[str, Any]:
        """The kebab-case mapping ``from_mapping`` accepts (and ``run.json`` stores)."""
        mapping = {
            field.name.replace("_", "-"): getattr(self, field.name) for field in fields(self) if field.name != "options"
        }
        return {**mapping, **dict(self.options)}

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some settings changed, validated again."""
        config = dataclasses.replace(self, **changes)
        config.validate()
        return config

    def validate(self) -> None:
        """Check the settings that need no data; data-dependent checks happen in ``scenarios``."""
        positive = {
            "num-clusters": self.num_clusters,
            "clients-per-cluster": self.clients_per_cluster,
            "num-server-rounds": self.num_server_rounds,
            "fingerprint-dim": self.fingerprint_dim,
            "node-timeout": self.node_timeout,
        }
        for key, value in positive.items():
            if value < 1:
                raise FedcondError(f"{key} must be at least 1 (got {value})")
        defaults = {"local-epochs": self.local_epochs, "batch-size": self.batch_size, "hidden-units": self.hidden_units}
        for key, value in defaults.items():
            if value < 0:
                raise FedcondError(f"{key} must be 0 (the default) or positive (got {value})")
        if self.held_out_clients < 0:
            raise FedcondError(f"held-out-clients must be 0 or more per cluster (got {self.held_out_clients})")
        if not 0 < self.data_fraction <= 1:
            raise FedcondError(f"data-fraction must be in (0, 1] (got {self.data_fraction})")
        if self.fingerprint_dim > MAX_FINGERPRINT_DIM:
            raise FedcondError(f"fingerprint-dim must be at most {MAX_FINGERPRINT_DIM} (got {self.fingerprint_dim})")
        if not 0 <= self.seed <= MAX_SEED:
            raise FedcondError(f"seed must be an integer in 0..{MAX_SEED} (got {self.seed})")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise FedcondError(f"learning-rate must be positive and finite (got {self.learning_rate})")
        if not 0 <= self.momentum < 1:
            raise FedcondError(f"momentum must be in [0, 1) (got {self.momentum})")
        if self.normalisation not in NORMALISATIONS:
            raise FedcondError(
                f"unknown normalisation '{self.normalisation}'; choose one of {', '.join(NORMALISATIONS)}"
            )
        check_conditioning(self.conditioning)
        check_fingerprint(self.fingerprint, self.normalisation)
        check_run_name(self.run_name)

    def resolved(self) -> RunConfig:
        """A copy with "dataset default" (0) settings replaced by the dataset's values."""
        from fedcond.datasets import dataset_spec

        spec = dataset_spec(self.dataset)
        return self.replace(
            local_epochs=self.local_epochs or spec.local_epochs,
            batch_size=self.batch_size or spec.batch_size,
        )

    @property
    def num_clients(self) -> int:
        """How many Flower nodes the run needs: one per client, held-out clients included."""
        return self.num_clusters * (self.clients_per_cluster + self.held_out_clients)

    @property
    def num_training_clients(self) -> int:
        """Clients that train: partition ids below this; held-out clients come after them."""
        return self.num_clusters * self.clients_per_cluster

    def resolved_data_dir(self) -> Path | None:
        """``data-dir``, else ``$FEDCOND_DATA_DIR``, else None (dataset defaults apply)."""
        chosen = self.data_dir or os.environ.get("FEDCOND_DATA_DIR", "")
        return Path(chosen).expanduser().resolve() if chosen else None


@dataclass(frozen=True)
class Option:
    """A run-config setting that one method declares next to its own code (e.g. Ditto's lambda).

    Nothing central lists a method's options: the registry collects them from the methods' classes.
    """

    key: str
    default: bool | int | float | str
    help: str
    #: The smallest allowed value of a numeric option (None: any).
    minimum: float | None = None
    #: The largest allowed value of a numeric option (None: any).
    maximum: float | None = None

    def coerce(self, raw: Any) -> Any:
        value = _coerce(self.key, raw, type(self.default))
        if isinstance(value, float) and not math.isfinite(value):
            raise FedcondError(f"{self.key} must be a finite number (got {value})")
        if self.minimum is not None and value < self.minimum:
            raise FedcondError(f"{self.key} must be at least {self.minimum:g} (got {value})")
        if self.maximum is not None and value > self.maximum:
            raise FedcondError(f"{self.key} must be at most {self.maximum:g} (got {value})")
        return value

    def of(self, config: RunConfig) -> Any:
        """This option's value in ``config`` (its default when the config was built without it)."""
        return dict(config.options).get(self.key, self.default)

    def set(self, config: RunConfig, value: Any) -> RunConfig:
        """A copy of ``config`` with this option at ``value`` (checked as the run config is)."""
        return config.replace(options=tuple(sorted({**dict(config.options), self.key: self.coerce(value)}.items())))


def check_run_name(name: str) -> None:
    """A run's folder is ``results-dir/run-name``: a name that is a path could put it anywhere."""
    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    # With no separator, ".." (or ".") can only be the whole name: the folder above (or results-dir itself).
    if any(separator in name for separator in separators) or name in (".", ".."):
        raise FedcondError(
            f"run-name '{name}' must be a plain folder name (no path separators, no '..'); "
            "choose where runs go with results-dir"
        )


def _field_type(field: dataclasses.Field[Any]) -> type:
    # Annotations are strings under `from __future__ import annotations`.
    return {"str": str, "int": int, "float": float, "bool": bool}[str(field.type)]


def _coerce(key: str, raw: Any, wanted: type) -> Any:
    """Accept TOML's natural spellings (``5`` for a float, ``"true"`` for a bool), nothing looser."""
    if wanted is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
    elif wanted is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
    elif wanted is float:
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return float(raw)
    elif isinstance(raw, str):
        return raw
    raise FedcondError(f"run-config key '{key}' needs a {wanted.__name__}, got {raw!r}")

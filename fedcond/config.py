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

from fedcond.data.drift import check_drift
from fedcond.errors import FedcondError
from fedcond.fingerprint.fingerprints import check_fingerprint
from fedcond.model.conditioning import HYPER_INITS, check_condition_scale, check_conditioning

NORMALISATIONS = ("none", "log", "federated")
LAYOUTS = ("auto", "true", "false")
#: How the CIFAR network normalises its conv features (docs/instability.md, "Real images"): batch norm
#: averaged with the model (the paper's network under FedAvg), batch norm kept by each client (FedBN;
#: a newcomer recomputes the statistics on its own images, AdaBN), or group norm (no statistics).
FEATURE_NORMS = ("batch", "local-batch", "group")
# numpy's and torch's generators both take any seed in [0, 2**32); IFCA's per-cluster model seeds
# (seed * 1000 + k) stay far inside torch's 64-bit range, and a negative seed is a numpy traceback.
MAX_SEED = 2**32 - 1
# The fingerprint is the conditioned model's input and each client's secure-sum message (2 x dim + 1
# values), and spectral fingerprints have at most as many values as the features have dimensions
# (794 for MNIST's pixels + labels): beyond 1024 a run only pays memory and time for zero padding.
MAX_FINGERPRINT_DIM = 1024
MAX_ENSEMBLE_SIZE = 64
#: At most just under half of a client's training data is held out for validation: more would leave
#: it training on less than it is scored on.
MAX_VALIDATION_FRACTION = 0.5


def setting(
    default: Any,
    topic: str,
    help: str,
    before_it_existed: Any = None,
    bool_words: bool = False,
    number_words: bool = False,
    choices: str = "",
) -> Any:
    """A ``RunConfig`` field declared with its help text and topic: the settings table
    (docs/settings.md) and ``[tool.flwr.app.config]`` are generated from these and the ``Option``s
    (``fedcond settings`` lists them; a checkout's ``python -m tools.docs`` writes both).

    ``before_it_existed``: the value a run recorded without this key ran at, when that is not what
    the default now resolves to (a run made before ``channels-last`` existed ran in the default
    layout, though CIFAR's default is now channels-last). ``bool_words``: a word setting that also
    takes TOML's true / false (as it did when it was a yes/no setting), kept as ``"true"`` / ``"false"``.
    ``number_words``: a word setting that also takes a number (``condition-scale = 0.5``), kept as its text.
    ``choices``: ``module:TABLE``, the one table whose keys are the setting's values; the help shown
    (``fedcond settings``, docs/settings.md) lists them from it, so no help text offers a value the
    table lacks. A name, not the table: ``fedcond.data.scenarios`` imports this module.
    """
    metadata = {
        "help": help,
        "topic": topic,
        "before_it_existed": before_it_existed,
        "bool_words": bool_words,
        "number_words": number_words,
        "choices": choices,
    }
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class RunConfig:
    """All settings of one run; field ``foo_bar`` is run-config key ``foo-bar``."""

    method: str = setting(
        "conditional",
        "run",
        "the method: `fedcond list` shows them (the paper's eight, named variants such as "
        "`recommended`, the competitors of [baselines.md](baselines.md), the pooled references)",
    )
    dataset: str = setting(
        "digits",
        "run",
        "the clients' data: images, or the appendix's tabular tasks ([data.md](data.md))",
        choices="fedcond.data.datasets:DATASETS",
    )
    scenario: str = setting(
        "label-shift",
        "run",
        "how clients differ; the README's Scenarios table",
        choices="fedcond.data.scenarios:SCENARIOS",
    )
    num_clusters: int = setting(3, "run", "K; at most the number of classes")
    clients_per_cluster: int = setting(
        5, "run", "each cluster's train and test samples are split disjointly over its clients"
    )
    num_server_rounds: int = setting(10, "run", "federated rounds (epochs of the pooled references)")
    rotations: str = setting(
        "", "scenario", "`covariate-rotation` angles: `C1`..`C4`, degrees `0,90,180`, or empty for K evenly spaced"
    )
    data_fraction: float = setting(
        1.0, "scenario", "a uniform subsample of every cluster's train and test data, for quick runs; in (0, 1]"
    )
    validation_fraction: float = setting(
        0.0,
        "scenario",
        "a seeded, class-stratified share of every client's training data held out for choosing settings: never "
        "trained on nor fingerprinted, scored each round (history.csv validation_accuracy); 0 = the paper's "
        "protocol; in [0, 0.5)",
    )
    covariate_clusters: int = setting(
        2, "scenario", "C, the covariate clusters per concept group in `combined` (K = 2C), 1..4"
    )
    dirichlet_alpha: float = setting(
        0.5,
        "scenario",
        "`dirichlet`: each client's label proportions ~ Dir(alpha) (flwr-datasets); smaller, more skew; > 0",
    )
    classes_per_client: int = setting(
        2, "scenario", "`pathological`: the classes each client holds (flwr-datasets), 1..the dataset's classes"
    )
    drift_fraction: float = setting(
        0.0,
        "scenario",
        "the fraction of training clients that move to the next cluster's distribution at "
        "drift-round ([newcomers.md](newcomers.md#drifting-clients)); 0 = none",
    )
    drift_round: int = setting(0, "scenario", "the round from which drifting clients hold their new data; 1..rounds")
    drift_fingerprint: str = setting(
        "recompute",
        "scenario",
        "conditioned methods at the drift: `recompute` the fingerprint on the new data or keep the `stale` one",
    )
    local_epochs: int = setting(
        0, "training", "local epochs per round; 0 = the dataset's default (Per-dataset training defaults, below)"
    )
    batch_size: int = setting(0, "training", "0 = the dataset's default")
    learning_rate: float = setting(0.01, "training", "local SGD's step, as in the paper; positive and finite")
    momentum: float = setting(0.9, "training", "local SGD's momentum, as in the paper; in [0, 1)")
    channels_last: str = setting(
        "auto",
        "training",
        "train and evaluate the CNN in the channels-last memory format: `auto` (the dataset's default: on for "
        "CIFAR-10 and CIFAR-100, 904 against 665 images/s on CPU, three seeds agreeing to 3 decimals; off for "
        "28x28 and digits), `true` or `false`; every method alike; not bit-identical to the default layout",
        before_it_existed="false",
        bool_words=True,
    )
    fingerprint_dim: int = setting(
        32,
        "fingerprint",
        "l, the number of eigenvalues (per-class fingerprints keep l // classes values per class); 1..1024",
    )
    fingerprint_encoder: str = setting(
        "pixels",
        "fingerprint",
        "phi in Z = [phi(x) ‖ onehot(y)]: flattened pixels, or a frozen encoder trained on "
        "the named dataset, or `<dataset>-reserved`: on a fifth of the clients' own dataset that no client gets "
        "([fingerprints.md](fingerprints.md))",
    )
    normalisation: str = setting(
        "federated",
        "fingerprint",
        "`none`, `log` (local; eigenvalue fingerprints only) or `federated` (z-score from a SecAgg+ sum)",
    )
    fingerprint: str = setting(
        "eigen",
        "fingerprint",
        "what each client computes: `eigen` is the paper's, `eigen-x` reads no labels, `random-id` and "
        "`cluster-id` are controls ([fingerprints.md](fingerprints.md))",
        choices="fedcond.fingerprint.fingerprints:FINGERPRINTS",
    )
    conditioning: str = setting(
        "concat",
        "fingerprint",
        "how the model takes it: `concat` is the paper's; on a tabular task `concat`, `lin` and `ens` are the "
        "appendix's MLP, Lin and Ens; `lin` conditions tabular models only (one module each in "
        "`fedcond/conditioning`)",
        choices="fedcond.model.conditioning:MECHANISMS",
    )
    condition_scale: str = setting(
        "none",
        "fingerprint",
        "a factor on the (normalised) fingerprint where the model reads it: `none` (1, the paper's), `unit` "
        "(1/sqrt(d): a z-scored fingerprint of norm about 1, so that `hyper`'s generated head steps like a plain "
        "head) or a positive number ([instability.md](instability.md#real-images-cifar-10))",
        number_words=True,
    )
    hyper_init: str = setting(
        "random",
        "fingerprint",
        "`conditioning=hyper`: the generated head's initial weights, `random` (small seeded noise) or `zero` "
        "(every client starts from the shared head)",
    )
    feature_norm: str = setting(
        "batch",
        "training",
        "the CIFAR network's conv-feature normalisation: `batch` (batch norm averaged with the model, the paper's), "
        "`local-batch` (conditioned methods: each client keeps its batch-norm layers, FedBN; a newcomer recomputes "
        "their statistics on its own training images, AdaBN) or `group` (group norm, 8 groups)",
    )
    ensemble_size: int = setting(
        8, "fingerprint", "`conditioning=ens` (tabular): the linear experts the fingerprint's softmax blends; 1..64"
    )
    hidden_units: int = setting(
        0,
        "training",
        "units of the FC hidden layer; 0 = the paper's (128; CIFAR 256); for controls of equal "
        "parameter count ([instability.md](instability.md#a-parameter-matched-control))",
    )
    held_out_clients: int = setting(
        0, "run", "extra clients per cluster that never train, only evaluate (`heldout_accuracy`)"
    )
    seed: int = setting(0, "run", "same seed, same split, same initial model, same numbers; 0..2^32-1")
    data_dir: str = setting("", "files", "folder with the dataset files (else `$FEDCOND_DATA_DIR`)")
    results_dir: str = setting("", "files", "where run folders go; default `./results`")
    run_name: str = setting(
        "",
        "files",
        "the run folder's name, a plain name inside `results-dir` (no `/`, `\\`, `..`); default "
        "`<method>-<dataset>-<scenario>-k<K>-n<N>-s<seed>-<time>`",
    )
    verbose: bool = setting(True, "files", "print the scenario summary and one line per round")
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
            values[field.name] = _coerce(key, canonical_value(key, raw), _field_type(field))
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
        }
        for key, value in positive.items():
            if value < 1:
                raise FedcondError(f"{key} must be at least 1 (got {value})")
        defaults = {"local-epochs": self.local_epochs, "batch-size": self.batch_size, "hidden-units": self.hidden_units}
        for key, value in defaults.items():
            if value < 0:
                raise FedcondError(f"{key} must be 0 (the default) or positive (got {value})")
        if not 1 <= self.ensemble_size <= MAX_ENSEMBLE_SIZE:
            raise FedcondError(f"ensemble-size must be in 1..{MAX_ENSEMBLE_SIZE} (got {self.ensemble_size})")
        if self.held_out_clients < 0:
            raise FedcondError(f"held-out-clients must be 0 or more per cluster (got {self.held_out_clients})")
        if not (math.isfinite(self.dirichlet_alpha) and self.dirichlet_alpha > 0):
            raise FedcondError(f"dirichlet-alpha must be positive and finite (got {self.dirichlet_alpha})")
        if self.classes_per_client < 1:
            raise FedcondError(f"classes-per-client must be at least 1 (got {self.classes_per_client})")
        check_drift(self.drift_fraction, self.drift_round, self.num_server_rounds, self.drift_fingerprint)
        if not 0 < self.data_fraction <= 1:
            raise FedcondError(f"data-fraction must be in (0, 1] (got {self.data_fraction})")
        if not 0 <= self.validation_fraction < MAX_VALIDATION_FRACTION:
            raise FedcondError(
                f"validation-fraction must be in [0, {MAX_VALIDATION_FRACTION}) (got {self.validation_fraction}); "
                "0 trains on all of each client's training data, 0.1 holds a tenth out for choosing settings"
            )
        if self.fingerprint_dim > MAX_FINGERPRINT_DIM:
            raise FedcondError(f"fingerprint-dim must be at most {MAX_FINGERPRINT_DIM} (got {self.fingerprint_dim})")
        if not 0 <= self.seed <= MAX_SEED:
            raise FedcondError(f"seed must be an integer in 0..{MAX_SEED} (got {self.seed})")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0):
            raise FedcondError(f"learning-rate must be positive and finite (got {self.learning_rate})")
        if not 0 <= self.momentum < 1:
            raise FedcondError(f"momentum must be in [0, 1) (got {self.momentum})")
        if self.channels_last not in LAYOUTS:
            raise FedcondError(f"channels-last must be auto, true or false (got {self.channels_last!r})")
        if self.normalisation not in NORMALISATIONS:
            raise FedcondError(
                f"unknown normalisation '{self.normalisation}'; choose one of {', '.join(NORMALISATIONS)}"
            )
        check_conditioning(self.conditioning)
        check_condition_scale(self.condition_scale)
        if self.hyper_init not in HYPER_INITS:
            raise FedcondError(f"unknown hyper-init '{self.hyper_init}'; choose one of {', '.join(HYPER_INITS)}")
        if self.feature_norm not in FEATURE_NORMS:
            raise FedcondError(f"unknown feature-norm '{self.feature_norm}'; choose one of {', '.join(FEATURE_NORMS)}")
        check_fingerprint(self.fingerprint, self.normalisation)
        check_run_name(self.run_name)

    def resolved(self) -> RunConfig:
        """A copy with "dataset default" (0) settings replaced by the dataset's values."""
        from fedcond.data.datasets import dataset_spec

        spec = dataset_spec(self.dataset)
        return self.replace(
            local_epochs=self.local_epochs or spec.local_epochs,
            batch_size=self.batch_size or spec.batch_size,
            channels_last=str(self.uses_channels_last).lower(),
        )

    @property
    def uses_channels_last(self) -> bool:
        """Whether the CNN trains and evaluates in the channels-last layout (``auto``: the dataset's default)."""
        if self.channels_last == "auto":
            from fedcond.data.datasets import dataset_spec

            return dataset_spec(self.dataset).channels_last
        return self.channels_last == "true"

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


def _fields_by_key() -> dict[str, dataclasses.Field[Any]]:
    return {field.name.replace("_", "-"): field for field in fields(RunConfig) if field.name != "options"}


def canonical_value(key: str, raw: Any) -> Any:
    """``raw`` as the run config keeps it: a ``bool_words`` setting's true / false (TOML's, or a
    run.json recorded when it was a yes/no setting) as the words ``"true"`` / ``"false"``."""
    field = _fields_by_key().get(key)
    if field is not None and field.metadata.get("bool_words") and isinstance(raw, bool | str):
        return str(raw).lower()
    if field is not None and field.metadata.get("number_words") and type(raw) in (int, float):
        return f"{raw:g}"
    return raw


def canonical_record(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded run config (``run.json``) with each value as the run config now keeps it."""
    return {key: canonical_value(key, value) for key, value in recorded.items()}


def value_before_it_existed(key: str) -> Any:
    """What a run recorded without ``key`` ran at, where the key says (``setting``'s ``before_it_existed``)."""
    field = _fields_by_key().get(key)
    return field.metadata.get("before_it_existed") if field is not None else None


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

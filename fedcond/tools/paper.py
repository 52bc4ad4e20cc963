"""The paper's published numbers, and the counterpart of one of our results among them.

``experiments/paper/results.csv`` holds every numeric cell of the paper's Tables I-XXI (one row per
cell, accuracy as a fraction). ``lookup`` takes one of our tidy rows (``metrics.csv``: dataset,
scenario, num_clusters, clients_per_cluster, rotations, method, fingerprint, conditioning) and
finds the paper's cell of the same experiment, dataset, K, clients per cluster, configuration and
method, or says why there is none. ``experiments/paper/results.md`` documents the ambiguities the
choices below resolve.
"""

from __future__ import annotations

import csv
import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedcond.errors import FedcondError

# Where the CSV lives in a source checkout; searched upwards from this file so that the path
# holds whether the package sits at the repository root or under src/.
PAPER_CSV = Path("experiments", "paper", "results.csv")

# Our scenario names and the paper's experiment ids.
EXPERIMENTS = {
    "label-shift": "E1",
    "covariate-subclass": "E2a",
    "covariate-rotation": "E2b",
    "concept-semantic": "E3a",
    "concept-permutation": "E3b",
    "domain": "E4a",
    "combined": "E4b",
    "concept-weights": "MCDC-synthetic",  # the appendix (APPENDIX_EXPERIMENT)
}
# The appendix's synthetic tasks (Tables VI-VII, ``concept-weights``): their experiment id, our
# dataset -> the CSV's task label (its config column), and our methods -> its columns: the references
# Global, Cluster, Client, and the conditional models by mechanism, fed the first eigenvector.
APPENDIX_EXPERIMENT = EXPERIMENTS["concept-weights"]
#: The appendix's tables (its workshop version's protocol is not the main paper's 20 epochs of 1 pass).
APPENDIX_TABLES = ("VI", "VII", "VIII", "IX")
APPENDIX_DATASET = "synthetic (10 features)"
APPENDIX_TASKS = {"synthetic-linear": "Linreg", "synthetic-logistic": "Logreg"}
APPENDIX_REFERENCES = {
    "fedavg": "Global", "pooled-global": "Global", "oracle": "Cluster", "pooled-oracle": "Cluster", "local": "Client",
}  # fmt: skip
APPENDIX_MECHANISMS = {"ens": "Ens", "concat": "MLP", "lin": "Lin"}
APPENDIX_FINGERPRINT = "eigenvector"
#: The appendix's EMNIST (Table VIII: by the number n_c of eigenvectors; Table IX: per character).
EMNIST_EXPERIMENT = "MCDC-EMNIST"
EMNIST_DATASETS = {"emnist-balanced": "EMNIST-Balanced"}
# Our dataset names and the CSV's. The domain scenario (E4a) records one of its two sources as its
# dataset; the paper names the pair.
DATASETS = {"mnist": "MNIST", "fashion-mnist": "FMNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}
DOMAIN_DATASET = "MNIST+FMNIST"
# Our methods and the paper's. The pooled family is the paper's own protocol (everything trained on
# centrally pooled data), so it maps onto the paper's columns too. pooled-global is one model on
# all data, which is what the paper's "FedAvg" column approximates; the paper does not say how
# many rounds its FedAvg ran, so both fedavg and pooled-global meet that column only approximately.
METHODS = {
    "fedavg": "FedAvg",
    "conditional": "Conditional",
    "oracle": "Oracle",
    "local": "Local",
    "ifca": "IFCA",
    "ditto": "Ditto",
    "gossip": "Gossip",
    "dac": "DAC",
    "pooled-conditional": "Conditional",
    "pooled-oracle": "Oracle",
    "pooled-global": "FedAvg",
}
# The paper's Conditional: PCA eigenvalues concatenated before the FC layers. Any other fingerprint
# or conditioning is our variant and has no published number.
PAPER_FINGERPRINT = "eigen"
PAPER_CONDITIONING = "concat"
# Tables XV (E2b) and III/XX (E4b) do not state clients per cluster; every table that states it
# for a K sweep says 5, so a cell without it is matched by our runs with 5 and no others.
ASSUMED_CLIENTS_PER_CLUSTER = 5
# The Sparse column of Tables V, XI, XIV, XVI and XVIII: their captions say 20 clients per cluster,
# but Table V prints 800 samples per client, which with the 20,000 images per cluster its Rich column
# holds (4,000 x 5) is 25 clients, and the E4 tables' printed totals (XIX, XXI) are 25 per cluster.
# The CSV keeps the captions' 20; a run with 25 meets that column too, with a note saying so.
SPARSE_AS_CAPTIONED, SPARSE_BY_SAMPLES = 20, 25
# Table I prints its E2b row as "FMNIST rot. K=4"; every cell equals Table XV's C3 (0/90/180/270),
# not C4 (also K=4).
TABLE_I_ROTATION = "C3"


@dataclass(frozen=True)
class PaperCell:
    """One accuracy cell of the paper (``results.csv`` row); the appendix's regression rows are RMSE."""

    table: str
    experiment: str
    dataset: str
    k: int | None
    clients_per_cluster: int | None
    configuration: str  # E2b's rotation set C1..C4; empty elsewhere
    method: str
    value: float


@dataclass(frozen=True)
class PaperMatch:
    """The paper's counterpart of one of our results, or the reason there is none.

    ``value`` is the printed accuracy chosen, ``tables`` every table printing exactly that cell,
    ``others`` the other values printed for the same setting (value, tables), ``notes`` the
    assumptions the match rests on.
    """

    value: float | None
    tables: tuple[str, ...] = ()
    others: tuple[tuple[float, tuple[str, ...]], ...] = ()
    notes: tuple[str, ...] = ()
    reason: str = ""

    @property
    def found(self) -> bool:
        return self.value is not None


def paper_csv() -> Path:
    """``experiments/paper/results.csv`` of the source checkout this package runs from."""
    for folder in Path(__file__).resolve().parents:
        if (folder / PAPER_CSV).is_file():
            return folder / PAPER_CSV
    raise FedcondError(f"no {PAPER_CSV} beside this package; run fedcond from a source checkout (pip install -e .)")


def _optional_int(text: str) -> int | None:
    return int(text) if text.strip() else None


def _configuration(row: Mapping[str, str]) -> str:
    """E2b's rotation set from the CSV's config label ("MNIST C3"; Table I's "FMNIST rot. K=4"); the
    appendix's synthetic task ("Logreg")."""
    if row["experiment"] in (APPENDIX_EXPERIMENT, EMNIST_EXPERIMENT):
        return row["config"]
    if row["experiment"] != "E2b":
        return ""
    if row["table"] == "I":
        return TABLE_I_ROTATION
    return row["config"].split()[-1]


@functools.lru_cache(maxsize=4)
def load_cells(path: Path | None = None) -> tuple[PaperCell, ...]:
    """Every accuracy cell of Tables I-XXI that names a K (derived rows such as Δ and Mean are not results)."""
    path = path or paper_csv()
    try:
        with path.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except FileNotFoundError:
        raise FedcondError(f"no paper results at {path}; restore experiments/paper/results.csv") from None
    cells = []
    for row in rows:
        experiment = row["experiment"]
        # Accuracy cells, and the appendix's regression RMSE (its task label keeps it apart).
        if (
            row["metric"] not in ("accuracy", "rmse")
            or not row["k"].strip()
            or not experiment.startswith(("E", APPENDIX_EXPERIMENT, EMNIST_EXPERIMENT))
            or row["table"] == CHARACTER_TABLE  # per character: character_cells
        ):
            continue
        cells.append(
            PaperCell(
                table=row["table"],
                experiment=row["experiment"],
                dataset=row["dataset"],
                k=_optional_int(row["k"]),
                clients_per_cluster=_optional_int(row["clients_per_cluster"]),
                configuration=_configuration(row),
                method=row["method"],
                value=float(row["value"]),
            )
        )
    if not cells:
        raise FedcondError(f"{path} holds no accuracy cells; restore experiments/paper/results.csv")
    return tuple(cells)


def _rotation_set(rotations: str, num_clusters: int) -> str:
    """Our ``rotations`` as the paper's set name: C1..C4 directly, or angles equal to one of them."""
    from fedcond.data.scenarios import ROTATION_CONFIGURATIONS, parse_rotations

    if rotations.strip().upper() in ROTATION_CONFIGURATIONS:
        return rotations.strip().upper()
    try:
        angles = parse_rotations(rotations, num_clusters)
    except FedcondError:
        return ""
    return next((name for name, known in ROTATION_CONFIGURATIONS.items() if known == angles), "")


@dataclass(frozen=True)
class PaperSetting:
    """What a paper cell is matched on, in the paper's names."""

    experiment: str
    dataset: str
    k: int
    clients_per_cluster: int
    configuration: str
    method: str

    def describe(self) -> str:
        return f"{self.describe_point()} {self.method}"

    def describe_point(self) -> str:
        """The setting without its method: what several methods of one comparison share."""
        configuration = f" {self.configuration}" if self.configuration else ""
        return f"{self.experiment} {self.dataset}{configuration} K={self.k} x {self.clients_per_cluster} clients"


def appendix_setting(row: Mapping[str, object]) -> PaperSetting | str:
    """The appendix's name (Tables VI-VII) for a tidy row of ``concept-weights``, or why it has none."""
    method, dataset = str(row["method"]), str(row["dataset"])
    if dataset not in APPENDIX_TASKS:
        return f"the appendix has no {dataset} results"
    if method in APPENDIX_REFERENCES:
        column = APPENDIX_REFERENCES[method]
    elif method in ("conditional", "pooled-conditional"):
        fingerprint, conditioning = str(row.get("fingerprint", "")), str(row.get("conditioning", ""))
        if fingerprint != APPENDIX_FINGERPRINT or conditioning not in APPENDIX_MECHANISMS:
            return (
                f"{method} with fingerprint {fingerprint} and conditioning {conditioning} is our variant (the "
                f"appendix's are {APPENDIX_FINGERPRINT} + {', '.join(APPENDIX_MECHANISMS)})"
            )
        column = APPENDIX_MECHANISMS[conditioning]
        if fingerprint_dim(row) != 1:
            return f"the appendix conditions on the first eigenvector (fingerprint-dim=1), not {fingerprint_dim(row)}"
    else:
        return f"the appendix has no {method} column (Global, Cluster, Client, Ens, MLP, Lin)"
    return PaperSetting(
        APPENDIX_EXPERIMENT, APPENDIX_DATASET, int(str(row["num_clusters"])), int(str(row["clients_per_cluster"])),
        APPENDIX_TASKS[dataset], column,
    )  # fmt: skip


def fingerprint_dim(row: Mapping[str, object]) -> int:
    """A tidy row's fingerprint-dim (a metrics.csv without the column: every run read the default)."""
    from fedcond.config import RunConfig

    return int(str(row.get("fingerprint_dim") or RunConfig().fingerprint_dim))


def emnist_setting(row: Mapping[str, object]) -> PaperSetting | str:
    """Table VIII's name for a tidy row of EMNIST Balanced split by case (3 clusters): the references
    at n_c = 0, Cond (the eigenvector fingerprint, concatenated) at n_c = fingerprint-dim."""
    method, k = str(row["method"]), int(str(row["num_clusters"]))
    if str(row["scenario"]) != "label-shift" or k != 3:
        return "the appendix's EMNIST table is label-shift by case, 3 clusters"
    if method in APPENDIX_REFERENCES:
        column, n_c = APPENDIX_REFERENCES[method], 0
    elif method == "conditional":
        fingerprint, conditioning = str(row.get("fingerprint", "")), str(row.get("conditioning", ""))
        if (fingerprint, conditioning) != (APPENDIX_FINGERPRINT, "concat"):
            return (f"conditional with fingerprint {fingerprint} and conditioning {conditioning} is our variant "
                    f"(the appendix's EMNIST Cond is {APPENDIX_FINGERPRINT} + concat)")  # fmt: skip
        column, n_c = "Conditional", fingerprint_dim(row)
    else:
        return f"the appendix's EMNIST table has no {method} column (Global, Cluster, Client, Conditional)"
    return PaperSetting(EMNIST_EXPERIMENT, EMNIST_DATASETS[str(row["dataset"])], k,
                        int(str(row["clients_per_cluster"])), f"n_c={n_c}", column)  # fmt: skip


def paper_setting(row: Mapping[str, object]) -> PaperSetting | str:
    """The paper's name for the setting of one of our tidy rows, or why the paper has none."""
    method, scenario, dataset = str(row["method"]), str(row["scenario"]), str(row["dataset"])
    if EXPERIMENTS.get(scenario) == APPENDIX_EXPERIMENT:
        return appendix_setting(row)
    if dataset in EMNIST_DATASETS:
        return emnist_setting(row)
    if method not in METHODS:
        return f"{method} is none of the paper's methods (a named variant of ours has no published number)"
    if METHODS[method] == "Conditional":
        # Rows written before these settings existed ran the paper's method.
        fingerprint = str(row.get("fingerprint") or PAPER_FINGERPRINT)
        conditioning = str(row.get("conditioning") or PAPER_CONDITIONING)
        if (fingerprint, conditioning) != (PAPER_FINGERPRINT, PAPER_CONDITIONING):
            return (
                f"{method} with fingerprint {fingerprint} and conditioning {conditioning} is our variant "
                f"(the paper's is {PAPER_FINGERPRINT} + {PAPER_CONDITIONING})"
            )
    if scenario not in EXPERIMENTS:
        return f"the paper has no {scenario} experiment"
    experiment = EXPERIMENTS[scenario]
    if experiment == "E4a":
        paper_dataset = DOMAIN_DATASET
    elif dataset in DATASETS:
        paper_dataset = DATASETS[dataset]
    else:
        return f"the paper has no {dataset} results"
    k = int(str(row["num_clusters"]))
    configuration = ""
    if experiment == "E2b":
        configuration = _rotation_set(str(row.get("rotations", "")), k)
        if not configuration:
            return f"rotations '{row.get('rotations', '')}' are none of the paper's sets C1..C4"
    return PaperSetting(
        experiment, paper_dataset, k, int(str(row["clients_per_cluster"])), configuration, METHODS[method]
    )


def _candidates(setting: PaperSetting, cells: Iterable[PaperCell], any_method: bool = False) -> list[PaperCell]:
    def same_clients(cell: PaperCell) -> bool:
        if cell.experiment == EMNIST_EXPERIMENT:  # it gives about 2,500 samples a client, not the clients
            return True
        if cell.clients_per_cluster is None:
            return setting.clients_per_cluster == ASSUMED_CLIENTS_PER_CLUSTER
        if (cell.clients_per_cluster, setting.clients_per_cluster) == (SPARSE_AS_CAPTIONED, SPARSE_BY_SAMPLES):
            return True
        return cell.clients_per_cluster == setting.clients_per_cluster

    return [
        cell
        for cell in cells
        if (cell.experiment, cell.dataset, cell.k, cell.configuration)
        == (setting.experiment, setting.dataset, setting.k, setting.configuration)
        and (any_method or cell.method == setting.method)
        and same_clients(cell)
    ]


def _table_order(cells: Iterable[PaperCell]) -> dict[str, int]:
    """Tables in the paper's order (the CSV's), to break ties deterministically."""
    order: dict[str, int] = {}
    for cell in cells:
        order.setdefault(cell.table, len(order))
    return order


def tables_in_order(tables: Iterable[str]) -> list[str]:
    """Table numbers (I, XV, ...) in the paper's order; unknown ones last."""
    order = _table_order(load_cells())
    return sorted(set(tables), key=lambda table: (order.get(table, len(order)), table))


def lookup(row: Mapping[str, object], cells: tuple[PaperCell, ...] | None = None) -> PaperMatch:
    """The paper's number for one of our results (a tidy row), or the reason it has none.

    The paper prints some settings in several tables (a K sweep's first column and a sparsity
    sweep's Rich column; Table I repeats one cell per experiment), not always with the same value.
    The value printed by the most tables wins, then the one printed first; the rest are ``others``.
    """
    setting = paper_setting(row)
    if isinstance(setting, str):
        return PaperMatch(None, reason=setting)
    cells = load_cells() if cells is None else cells
    candidates = _candidates(setting, cells)
    if not candidates:
        # Said without the method where the paper has nothing at this point, so that a comparison's
        # methods share one legend line instead of one line each that differ by a word.
        if not _candidates(setting, cells, any_method=True):
            return PaperMatch(None, reason=f"the paper prints no {setting.describe_point()} results")
        return PaperMatch(None, reason=f"the paper prints no {setting.describe()} cell")
    order = _table_order(cells)
    tables_by_value: dict[float, list[str]] = defaultdict(list)
    for cell in sorted(candidates, key=lambda cell: order[cell.table]):
        tables_by_value[cell.value].append(cell.table)
    ranked = sorted(tables_by_value.items(), key=lambda item: (-len(item[1]), order[item[1][0]]))
    (value, tables), *others = ranked
    notes = []
    if setting.experiment == EMNIST_EXPERIMENT:
        notes.append("the appendix gives about 2,500 samples a client for EMNIST, not the number of clients")
    elif any(cell.clients_per_cluster is None for cell in candidates):
        notes.append(f"the paper does not state clients per cluster for {setting.experiment}; 5 assumed")
    if any(cell.clients_per_cluster == SPARSE_AS_CAPTIONED != setting.clients_per_cluster for cell in candidates):
        notes.append(
            f"the paper's Sparse column: its caption says {SPARSE_AS_CAPTIONED} clients per cluster, its "
            f"samples per client say {SPARSE_BY_SAMPLES}"
        )
    if setting.experiment == "E2b" and "I" in tables:
        notes.append("Table I's E2b row ('FMNIST rot. K=4') is rotation set C3")
    if setting.experiment == APPENDIX_EXPERIMENT and setting.method in APPENDIX_MECHANISMS.values():
        notes.append("the appendix conditions on the first eigenvector: fingerprint-dim=1")
    return PaperMatch(value, tuple(tables), tuple((other, tuple(where)) for other, where in others), tuple(notes))


#: Table IX (the appendix's EMNIST look-alike characters): its experiment id and its columns by our method.
CHARACTER_TABLE = "IX"
CHARACTER_COLUMNS = {"fedavg": "Global", "local": "Client", "oracle": "Cluster", "conditional": "Conditional"}


@functools.lru_cache(maxsize=2)
def character_cells(path: Path | None = None) -> dict[tuple[str, str], float]:
    """Table IX: (character, column) -> the printed accuracy; the CSV's config is "group char (case)"
    ("o/O/0 o (lower)"), the character the token before the parenthesis."""
    with (path or paper_csv()).open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["table"] == CHARACTER_TABLE]
    return {(row["config"].split(" (")[0].split()[-1], row["method"]): float(row["value"]) for row in rows}


def character_value(row: Mapping[str, object], character: str) -> float | None:
    """The paper's Table IX accuracy for ``character`` under the method of ``row`` (a tidy row of an
    EMNIST run), or None where it prints none: another dataset, a method or variant it has no column for."""
    method = str(row.get("method", ""))
    if not str(row.get("dataset", "")).startswith("emnist") or method not in CHARACTER_COLUMNS:
        return None
    if method == "conditional" and str(row.get("fingerprint", "")) != APPENDIX_FINGERPRINT:
        return None
    return character_cells().get((character, CHARACTER_COLUMNS[method]))

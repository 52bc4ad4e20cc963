"""Is the output layer what holds a federated network back, or the layers under it? A linear probe.

For every finished run given (a run folder holding its ``run.json`` and ``checkpoint.pt``), this
rebuilds each client's final model as the run served it (the global model fed the client's
normalised fingerprint, or its cluster's model for Oracle and the other per-cluster methods),
computes the client's hidden features (the input of the output layer) on its own training and test
images, and scores on each client's test set:

- ``own head``: the run's own output layer (generated from the fingerprint for ``hyper``). It must
  give the run's recorded final accuracy, which checks the rebuild;
- ``cluster probe``: one multinomial logistic regression per true cluster, fitted on the hidden
  features of that cluster's training clients: what an output layer fitted per cluster reaches on
  these features, about the most that a server fitting the output layer to each fingerprint could
  reach without moving the layers under it;
- ``client probe``: one fitted on each client's own training features.

Also the own head's accuracy on the clients' training images (how far the run fit its data).
Accuracies are over all test (training) images, as the run's history weights them. Writes a
Markdown table (``probe.md``) and ``metrics.csv`` into the folder ``--out``; the runs' data come
from ``--data-dir`` or ``$FEDCOND_DATA_DIR`` (else where the run found them):

    .venv/bin/python experiments/head_probe.py RUN_FOLDER [RUN_FOLDER ...] --out FOLDER
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: Images per forward pass.
BATCH = 500


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run folders (run.json and checkpoint.pt)")
    parser.add_argument("--out", type=Path, required=True, help="the folder to write probe.md and metrics.csv in")
    parser.add_argument("--data-dir", default=os.environ.get("FEDCOND_DATA_DIR", ""), help="folder holding the data")
    parsed = parser.parse_args(argv)
    for folder in parsed.runs:
        if not (folder / "checkpoint.pt").is_file() or not (folder / "run.json").is_file():
            parser.error(
                f"{folder} has no run.json and checkpoint.pt; give a finished run's folder (rerun it if its "
                "checkpoint is gone)"
            )
    if parsed.out.exists() and any(parsed.out.iterdir()):
        parser.error(f"{parsed.out} is not empty; give a new --out folder or move its files away")
    return parsed


def fitted_probe(features: np.ndarray, labels: np.ndarray):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000)).fit(features, labels)


def client_outputs(model, images: np.ndarray, condition: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(hidden features, the model's predicted labels) of ``images``: one pass through the conv
    layers feeds both, the labels computed from the features as the model's ``forward`` does."""
    import torch

    from fedcond.model.networks import conditioned_logits

    first, activation, _ = model.classifier
    cond = None if condition is None else torch.from_numpy(condition).float()[None]
    hidden, predicted = [], []
    with torch.no_grad():
        for start in range(0, len(images), BATCH):
            features = model.features(torch.from_numpy(images[start : start + BATCH]))
            hidden.append(activation(first(features)).numpy())
            logits = model.classifier(features) if cond is None else conditioned_logits(model, features, cond)
            predicted.append(logits.argmax(1).numpy())
    return np.concatenate(hidden), np.concatenate(predicted)


def probe_run(folder: Path, data_dir: str) -> tuple[Any, dict[str, float]]:
    from fedcond.config import RunConfig
    from fedcond.data.client_data import client_fingerprint, load_client_data
    from fedcond.federation.messages import FINGERPRINT_MEAN, FINGERPRINT_STD, array_from_bytes
    from fedcond.federation.methods import declared_options
    from fedcond.fingerprint import fingerprints as fp
    from fedcond.model.networks import build_run_model, set_weights
    from fedcond.records.checkpoint import GLOBAL_MODEL, load_checkpoint, recorded_settings, run_info

    info = run_info(folder)
    recorded = recorded_settings(folder, info)
    data = {"data-dir": data_dir or recorded.get("data-dir", "")}
    config = RunConfig.from_mapping({**recorded, **data}, declared_options())
    checkpoint = load_checkpoint(folder)
    assert checkpoint is not None
    if checkpoint.round != config.num_server_rounds:
        raise SystemExit(f"{folder} stopped at round {checkpoint.round} of {config.num_server_rounds}; finish it first")
    shared = checkpoint.values.get("shared_config", {})
    conditioned = GLOBAL_MODEL in checkpoint.models and FINGERPRINT_MEAN in shared
    clients = [load_client_data(config, partition) for partition in range(config.num_clients)]
    assignment = checkpoint.values.get("assignment", {})

    @functools.cache
    def model_named(name: str):
        model = build_run_model(config, clients[0].num_classes, conditioned)
        set_weights(model, checkpoint.models[name])
        return model.eval()

    if conditioned:
        mean = array_from_bytes(shared[FINGERPRINT_MEAN], FINGERPRINT_MEAN)
        std = array_from_bytes(shared[FINGERPRINT_STD], FINGERPRINT_STD)
    rows = []
    for client in clients:
        condition = None
        if conditioned:
            raw = client_fingerprint(config, client)
            condition = fp.normalise(raw, config.normalisation, mean, std).astype(np.float32)
        pid = client.partition_id
        model = model_named(GLOBAL_MODEL if GLOBAL_MODEL in checkpoint.models else f"cluster-{assignment[str(pid)]}")
        train_hidden, train_predicted = client_outputs(model, client.train_x, condition)
        test_hidden, test_predicted = client_outputs(model, client.test_x, condition)
        rows.append((client, train_hidden, train_predicted, test_hidden, test_predicted))
        print(f"  client {client.partition_id}: own head {np.mean(test_predicted == client.test_y):.4f}", flush=True)

    tests = sum(len(client.test_y) for client, *_ in rows)
    trains = sum(len(client.train_y) for client, *_ in rows)
    own = sum(int(np.sum(predicted == client.test_y)) for client, _, _, _, predicted in rows) / tests
    own_train = sum(int(np.sum(predicted == client.train_y)) for client, _, predicted, _, _ in rows) / trains
    cluster_correct = 0
    for cluster in sorted({client.cluster for client, *_ in rows}):
        members = [row for row in rows if row[0].cluster == cluster]
        features = np.concatenate([row[1] for row in members])
        probe = fitted_probe(features, np.concatenate([row[0].train_y for row in members]))
        cluster_correct += sum(int(np.sum(probe.predict(row[3]) == row[0].test_y)) for row in members)
    client_correct = 0
    for client, train_hidden, _, test_hidden, _ in rows:
        probe = fitted_probe(train_hidden, client.train_y)
        client_correct += int(np.sum(probe.predict(test_hidden) == client.test_y))
    recorded = checkpoint.history[-1].accuracy
    return config, {
        "recorded": recorded,
        "own head": own,
        "cluster probe": cluster_correct / tests,
        "client probe": client_correct / tests,
        "own head, training images": own_train,
    }


#: The probes' rows in metrics.csv: the run's label with this suffix (its own head: the label alone).
PROBES = {"cluster probe": "+cluster-probe", "client probe": "+client-probe"}


def run_label(folder: Path, method: str) -> str:
    """The method's label in a sweep's run folder name (``..._method-LABEL_seed-0``), else ``method``."""
    found = re.search(r"(?:^|_)method-([^_]+)", folder.name)
    return found.group(1) if found else method


def metrics_rows(folder: Path, config, scores: dict[str, float]) -> list[dict[str, object]]:
    """The run's rows of metrics.csv: its own head (with its training accuracy) and each probe, as
    methods of their own, so that the prose checker reads them as it reads a sweep's."""
    label = run_label(folder, config.method)
    common = {"dataset": config.dataset, "scenario": config.scenario, "num_clusters": config.num_clusters,
              "clients_per_cluster": config.clients_per_cluster, "seed": config.seed,
              "round": config.num_server_rounds}  # fmt: skip
    own = {
        **common,
        "method": label,
        "accuracy": scores["own head"],
        "train_accuracy": scores["own head, training images"],
    }
    return [own, *({**common, "method": label + suffix, "accuracy": scores[name]} for name, suffix in PROBES.items())]


def main(argv: list[str] | None = None) -> None:
    parsed = arguments(argv)
    columns = ("recorded", "own head", "cluster probe", "client probe", "own head, training images")
    lines = [
        "# The output layer against the layers under it: linear probes of finished runs' hidden features",
        "",
        "Generated by `experiments/head_probe.py` (its docstring says what each column is); test",
        "accuracy over all clients' test images unless the column says training. metrics.csv holds",
        f"the same numbers, each probe as a method of its own (the run's label + {', '.join(PROBES.values())}).",
        "",
        "| run | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    rows: list[dict[str, object]] = []
    for folder in parsed.runs:
        print(folder.name, flush=True)
        config, scores = probe_run(folder.resolve(), parsed.data_dir)
        if abs(scores["own head"] - scores["recorded"]) > 5e-4:
            sys.exit(
                f"{folder}: the rebuilt model scores {scores['own head']:.4f}, the run recorded "
                f"{scores['recorded']:.4f}"
            )
        lines.append(f"| {folder.name} | " + " | ".join(f"{scores[column]:.4f}" for column in columns) + " |")
        rows.extend(metrics_rows(folder, config, scores))
        print(lines[-1], flush=True)
    parsed.out.mkdir(parents=True, exist_ok=True)
    (parsed.out / "probe.md").write_text("\n".join([*lines, ""]))
    with (parsed.out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {parsed.out / 'probe.md'} and metrics.csv")


if __name__ == "__main__":
    main()

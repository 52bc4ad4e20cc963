"""The paper's own protocol: centrally pooled training, as a reference beside the federated methods.

The paper never ran federated rounds. It trained Conditional on the pooled union of every client's
(x, fingerprint, y) triples, Oracle on each true cluster's pooled data, and a global model on all
of it, each as one continuous SGD run (20 epochs, SGD 0.01, momentum 0.9, batch 64). These three
methods do exactly that, in-process and without Flower, on the *same* split, fingerprints,
normalisation, models, seeds and history format as the federated methods:

- ``pooled-conditional``: one conditioned model; every sample carries its own client's fingerprint;
- ``pooled-oracle``: one plain model per true cluster, on that cluster's pooled clients;
- ``pooled-global``: one plain model on every training client's data.

A "round" here is ``local-epochs`` epochs over the pooled data (one epoch with the paper's
protocol), so ``history.csv`` has one row per epoch and the convergence plots line up with the
federated methods' rounds. The optimiser (its momentum) and the batch order continue across rounds,
as in one centralised run. After every round every client evaluates the model it would use on its
own test split, exactly as in the federation. Held-out clients (``held-out-clients``) never
contribute training samples nor to the normalisation statistics; they are evaluated with their
own fingerprint (``pooled-conditional``) or their cluster's model (``pooled-oracle``), which asks
whether the pooled model learnt to *describe* a distribution or to *identify* the training clients.

After every round the run's checkpoint (``fedcond.records.checkpoint``) is replaced: the models, their
optimisers' state (momentum) and batch-order generators, and the history, so that ``resume=``
continues one centralised run exactly where it stopped.

Comparing ``pooled-conditional`` with ``conditional`` separates "is our implementation of the
method right" from "does the method survive federated averaging".
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcond.config import RunConfig
from fedcond.data.client_data import ClientData, client_fingerprint, load_client_data
from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.fingerprint import fingerprints as fp
from fedcond.model.device import pick_device
from fedcond.model.networks import Network, build_run_model, get_weights, set_weights
from fedcond.model.training import MomentumSGD, TrainSettings, check_not_diverged, evaluate, new_optimiser, run_epochs
from fedcond.records.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    check_resume,
    checkpoint_due,
    resume_folder,
    resumption_note,
    run_info,
    save_checkpoint,
)
from fedcond.records.history import RoundRecord, RunRecorder, failures_recorded, open_run, reopen_run
from fedcond.records.metrics import ClientEvaluation, Spread, summarise_evaluations, weighted_mean


@dataclass(frozen=True)
class PooledSpec:
    """What a pooled method trains: one model for everyone (``all``) or one per true cluster."""

    scope: str
    conditioned: bool
    summary: str


#: The pooled reference family, the one table the method registry reads its pooled entries from.
POOLED_METHODS = {
    "pooled-conditional": PooledSpec(
        "all", True, "the paper's protocol: one conditioned CNN on all clients' pooled data"
    ),
    "pooled-oracle": PooledSpec("cluster", False, "the paper's protocol: one CNN per true cluster on its pooled data"),
    "pooled-global": PooledSpec("all", False, "the paper's protocol: one CNN on all clients' pooled data"),
}


def not_a_federation(method: str) -> FedcondError:
    """The one-line refusal of a pooled method where only a federation can run (``flwr run``, a ClientApp)."""
    return FedcondError(
        f"{method} is the paper's centrally pooled protocol, not a federation; run it with "
        "fedcond run, compare or sweep (they train it in-process), not with flwr run"
    )


#: What the pooled references serve a newcomer (docs/newcomers.md's table reads it).
NEWCOMER_RULE = (
    "the pooled references' own rule: conditioned models take the newcomer's fingerprint, `pooled-oracle` its "
    "cluster's model; `newcomer-steps` is refused (they train centrally)"
)


@dataclass
class PooledModel:
    """One model of a pooled run, its pooled training data, and its optimiser and batch-order state."""

    model: Network
    optimiser: MomentumSGD
    generator: torch.Generator
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def normalised_fingerprints(config: RunConfig, clients: list[ClientData]) -> dict[int, np.ndarray]:
    """Every client's fingerprint as the model is fed it, by partition id.

    ``federated`` z-scores with the training clients' mean and population standard deviation: the
    same numbers the federation's secure sum publishes, so held-out clients are normalised with
    statistics their data never entered.
    """
    raw = {client.partition_id: client_fingerprint(config, client) for client in clients}
    training = np.stack([raw[pid] for pid in range(config.num_training_clients)])
    mean, std = fp.mean_and_std(training.sum(axis=0), (training**2).sum(axis=0), len(training))
    return {pid: fp.normalise(vector, config.normalisation, mean, std) for pid, vector in raw.items()}


def _pooled_model(
    config: RunConfig, members: list[ClientData], num_classes: int, conditions: dict[int, np.ndarray] | None, index: int
) -> PooledModel:
    device = pick_device()
    model = build_run_model(config, num_classes, conditions is not None).to(device)
    images = np.concatenate([client.train_x for client in members])
    labels = np.concatenate([client.train_y for client in members])
    rows = None
    if conditions is not None:
        rows = np.concatenate([np.repeat(conditions[c.partition_id][None, :], len(c.train_y), axis=0) for c in members])
        rows = torch.from_numpy(rows.astype(np.float32)).to(device)
    data = (torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device), rows)
    settings = TrainSettings.of(config)
    # One batch-order stream per model, continued across rounds like one centralised run.
    seed = int(np.random.SeedSequence([config.seed, index, len(POOLED_METHODS)]).generate_state(1)[0])
    return PooledModel(model, new_optimiser(model, settings), torch.Generator().manual_seed(seed), data)


def run_pooled(config: RunConfig) -> RunRecorder:
    """Train ``config.method`` (a pooled method) to the end; the results folder says how it went.

    With ``resume`` set, the run continues in that folder from its checkpoint.
    """
    if config.method not in POOLED_METHODS:
        raise FedcondError(f"'{config.method}' is not a pooled method; choose one of {', '.join(POOLED_METHODS)}")
    folder = resume_folder(config)
    checkpoint = check_resume(config) if folder is not None else None  # before anything is written
    config = config.resolved()
    spec = POOLED_METHODS[config.method]
    scenario = scenario_for(config)
    if folder is None or checkpoint is None:
        recorder = open_run(config, scenario, config.method, spec.summary, spec.conditioned, {"protocol": "pooled"})
    else:
        note = resumption_note(checkpoint, run_info(folder))
        recorder = reopen_run(config, folder, scenario.num_clusters, checkpoint.history, note)
    with failures_recorded(recorder):
        _train_and_record(config, scenario.num_classes, spec.scope, spec.conditioned, recorder, checkpoint)
    return recorder


def _pooled_state(models: list[PooledModel]) -> tuple[dict[str, list[np.ndarray]], dict[str, Any]]:
    """Each model's weights, and its optimiser's and batch-order generator's state."""
    weights = {f"pooled-{index}": get_weights(m.model) for index, m in enumerate(models)}
    values = {
        "optimisers": [m.optimiser.state_dict() for m in models],
        "generators": [m.generator.get_state() for m in models],
    }
    return weights, values


def _load_pooled_state(models: list[PooledModel], checkpoint: Checkpoint) -> None:
    for index, pooled in enumerate(models):
        set_weights(pooled.model, checkpoint.models[f"pooled-{index}"])
        pooled.optimiser.load_state_dict(checkpoint.values["optimisers"][index])
        pooled.generator.set_state(checkpoint.values["generators"][index])


def _train_and_record(
    config: RunConfig,
    num_classes: int,
    scope: str,
    conditioned: bool,
    recorder: RunRecorder,
    checkpoint: Checkpoint | None = None,
) -> None:
    clients = [load_client_data(config, pid) for pid in range(config.num_clients)]
    training = clients[: config.num_training_clients]
    conditions = normalised_fingerprints(config, clients) if conditioned else None
    if scope == "all":
        groups = [training]
    else:
        groups = [[c for c in training if c.cluster == cluster] for cluster in range(recorder.num_clusters)]
    models = [_pooled_model(config, members, num_classes, conditions, index) for index, members in enumerate(groups)]
    # Which model each client (held-out ones too) is evaluated with: its cluster's, or the only one.
    model_of = {c.partition_id: models[c.cluster if scope == "cluster" else 0].model for c in clients}
    settings = TrainSettings.of(config)
    rounds_before, elapsed_before = 0, 0.0
    if checkpoint is not None:
        _load_pooled_state(models, checkpoint)
        rounds_before = checkpoint.round
        elapsed_before = checkpoint.history[-1].elapsed_seconds if checkpoint.history else 0.0
    started = time.perf_counter()
    saving: list[float] = []
    checkpoint_bytes = 0
    for round_number in range(rounds_before + 1, config.num_server_rounds + 1):
        round_start = time.perf_counter()
        losses = [(run_epochs(m.model, m.optimiser, m.data, settings, m.generator), len(m.data[1])) for m in models]
        evaluations = {True: [], False: []}
        validations: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
        for client in clients:
            condition = conditions[client.partition_id] if conditions is not None else None
            model = model_of[client.partition_id]
            result = evaluate(
                model, client.test_x, client.test_y, condition, settings.channels_last, settings.regression
            )
            held_out = client.partition_id >= config.num_training_clients
            evaluations[held_out].append(
                ClientEvaluation(client.cluster, result.num_samples, result.loss, result.accuracy)
            )
            if client.has_validation:
                scored = evaluate(model, client.validation_x, client.validation_y, condition,
                                  settings.channels_last, settings.regression)  # fmt: skip
                validations[held_out].append((scored.accuracy, scored.num_samples))
        accuracy, loss, per_cluster = summarise_evaluations(evaluations[False])
        heldout = summarise_evaluations(evaluations[True])[0] if evaluations[True] else float("nan")
        now = time.perf_counter()
        record = RoundRecord(
            round=round_number,
            accuracy=accuracy,
            loss=loss,
            train_loss=weighted_mean(losses),
            seconds=now - round_start,
            elapsed_seconds=elapsed_before + now - started,
            bytes_down=0,
            bytes_up=0,
            cluster_accuracy=per_cluster,
            heldout_accuracy=heldout,
            # In-process: every client's data is trained on and every client evaluates, none can fail.
            clients_asked=len(clients),
            clients_answered=len(clients),
            clients_evaluated=len(evaluations[False]),
            **Spread.of(evaluations[False], recorder.metric).as_fields(),
            **Spread.of(evaluations[True], recorder.metric).as_fields("heldout_"),
            validation_accuracy=weighted_mean(validations[False]),
            heldout_validation_accuracy=weighted_mean(validations[True]),
        )
        recorder.add(record)
        check_not_diverged(round_number, record.train_loss, num_classes, recorder.first_train_loss,
                           f"lower learning-rate (now {config.learning_rate:g})")  # fmt: skip
        if checkpoint_due(config, round_number):
            save_start = time.perf_counter()
            weights, values = _pooled_state(models)
            checkpoint_bytes = save_checkpoint(
                recorder.folder, Checkpoint(round_number, list(recorder.records), weights, values)
            )
            saving.append(time.perf_counter() - save_start)
        if config.verbose:
            print(record.progress_line(config.num_server_rounds, recorder.metric), flush=True)
    cost = {"file": CHECKPOINT_FILE, "bytes": checkpoint_bytes, "seconds_per_save": statistics.fmean(saving)}
    recorder.finish({"checkpoint": cost if saving else None})

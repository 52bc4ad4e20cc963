"""The paper's pooled protocol: same split, fingerprints and history as the federation, no Flower."""

import csv
import json

import numpy as np
import pytest
import torch

from fedcond.config import RunConfig
from fedcond.data.client_data import client_fingerprint, load_client_data
from fedcond.errors import FedcondError
from fedcond.federation.methods import federated, get_method, method_names
from fedcond.fingerprint.fingerprints import mean_and_std, standardise
from fedcond.model.networks import build_model
from fedcond.model.training import TrainSettings, train
from fedcond.pooled import normalised_fingerprints, run_pooled
from fedcond.tools.experiment import expand_methods


def small(method: str, **extra: object) -> RunConfig:
    values = {
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 2,
        "verbose": False, **extra,
    }  # fmt: skip
    return RunConfig.from_mapping(values)


def history(folder) -> list[dict[str, str]]:
    with (folder / "history.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("method", method_names("pooled"))
def test_pooled_run_writes_one_row_per_epoch_with_held_out_accuracy(method):
    recorder = run_pooled(small(method, **{"held-out-clients": 1}))
    info = json.loads((recorder.folder / "run.json").read_text())
    rows = history(recorder.folder)
    assert info["status"] == "finished" and info["protocol"] == "pooled"
    assert [row["round"] for row in rows] == ["1", "2"]
    assert all(0.0 <= float(row["heldout_accuracy"]) <= 1.0 for row in rows)
    assert all(float(row["bytes_down"]) == 0 for row in rows)  # nothing travels
    assert float(rows[-1]["accuracy"]) > 0.5  # digits, two easy label-shift clusters


def test_per_sample_conditions_equal_to_one_fingerprint_train_identically():
    """Pooled rows that all hold the same fingerprint are exactly a client's single fingerprint."""
    rng = np.random.default_rng(0)
    images = rng.random((40, 1, 8, 8), dtype=np.float32)
    labels = rng.integers(0, 10, 40)
    fingerprint = rng.standard_normal(4)
    settings = TrainSettings(epochs=2, batch_size=16, learning_rate=0.05, momentum=0.9)
    one, rows = build_model((1, 8, 8), 10, 4, seed=3), build_model((1, 8, 8), 10, 4, seed=3)
    loss_one = train(one, images, labels, fingerprint, settings, seed=7)
    loss_rows = train(rows, images, labels, np.tile(fingerprint, (40, 1)), settings, seed=7)
    assert loss_one == pytest.approx(loss_rows, rel=1e-6)
    for a, b in zip(one.parameters(), rows.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_per_sample_conditions_reach_the_model_per_sample():
    """Different rows give a different update than their mean: each sample gets its own vector."""
    rng = np.random.default_rng(1)
    images = rng.random((32, 1, 8, 8), dtype=np.float32)
    labels = rng.integers(0, 10, 32)
    rows = rng.standard_normal((32, 4))
    settings = TrainSettings(epochs=1, batch_size=8, learning_rate=0.05, momentum=0.0)
    per_sample, averaged = build_model((1, 8, 8), 10, 4, seed=3), build_model((1, 8, 8), 10, 4, seed=3)
    train(per_sample, images, labels, rows, settings, seed=7)
    train(averaged, images, labels, rows.mean(axis=0), settings, seed=7)
    first = per_sample.classifier[0].weight
    assert not torch.allclose(first, averaged.classifier[0].weight)


def test_normalisation_uses_training_clients_only_like_the_secure_sum():
    config = small("pooled-conditional", **{"held-out-clients": 1}).resolved()
    clients = [load_client_data(config, pid) for pid in range(config.num_clients)]
    raw = np.stack([client_fingerprint(config, c) for c in clients[: config.num_training_clients]])
    mean, std = mean_and_std(raw.sum(axis=0), (raw**2).sum(axis=0), len(raw))
    fed = normalised_fingerprints(config, clients)
    held_out = clients[-1]
    np.testing.assert_allclose(fed[held_out.partition_id], standardise(client_fingerprint(config, held_out), mean, std))
    np.testing.assert_allclose(fed[0], standardise(raw[0], mean, std))


def test_pooled_methods_are_named_apart_from_the_federated_ones():
    assert method_names("pooled") == ["pooled-conditional", "pooled-oracle", "pooled-global"]
    assert not set(method_names("all")) & set(method_names("pooled"))
    assert expand_methods(["conditional", "pooled"]) == ["conditional", *method_names("pooled")]
    bundle = {"label": "variant", "method": "conditional", "conditioning": "hyper"}
    assert expand_methods(["fedavg", bundle]) == ["fedavg", bundle]
    with pytest.raises(FedcondError, match="label"):
        expand_methods([{"method": "conditional"}])


def test_flower_refuses_pooled_methods_with_the_fix():
    with pytest.raises(FedcondError, match="fedcond run, compare or sweep"):
        federated(get_method("pooled-conditional"))
    federated(get_method("conditional"))


def test_a_pooled_run_that_fails_is_recorded_failed(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise FedcondError("training loss became nan; lower learning-rate")

    monkeypatch.setattr("fedcond.pooled.run_epochs", broken)
    with pytest.raises(FedcondError):
        run_pooled(small("pooled-global", **{"run-name": "broken", "results-dir": str(tmp_path)}))
    info = json.loads((tmp_path / "broken" / "run.json").read_text())
    assert info["status"] == "failed" and "learning-rate" in info["error"]


def test_fedcond_run_of_a_pooled_method_reports_an_unexpected_error_in_one_line(monkeypatch, tmp_path, capsys):
    from fedcond.tools.cli import main

    def broken(*args, **kwargs):
        raise ValueError("a bug\nover two lines")

    monkeypatch.setattr("fedcond.pooled.run_epochs", broken)
    code = main(["run", "method=pooled-global", "num-clusters=2", "clients-per-cluster=1", "num-server-rounds=1",
                 f"results-dir={tmp_path}", "run-name=bug"])  # fmt: skip
    assert code == 1
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "the run failed" in error[0] and "Traceback" not in error[0]
    info = json.loads((tmp_path / "bug" / "run.json").read_text())
    assert info["status"] == "failed" and "ValueError" in info["error"] and "\n" not in info["error"]


@pytest.mark.parametrize(
    ("method", "groups"),
    [("pooled-oracle", [[0, 1], [2, 3]]), ("pooled-global", [[0, 1, 2, 3]]), ("pooled-conditional", [[0, 1, 2, 3]])],
)
def test_each_pooled_model_trains_on_exactly_the_paper_protocols_clients(method, groups, monkeypatch):
    """Oracle: one model per true cluster on that cluster's training clients only; Global and
    Conditional: one model on every training client; held-out clients' data in none; every sample
    of Conditional fed its own client's fingerprint; every client (held-out too) evaluated with the
    model of its cluster (Oracle) or the only one."""
    import fedcond.pooled as pooled

    built, evaluated = [], []
    real_model, real_evaluate = pooled._pooled_model, pooled.evaluate

    def spy_model(config, members, num_classes, conditions, index):
        made = real_model(config, members, num_classes, conditions, index)
        built.append(([client.partition_id for client in members], made, members, conditions))
        return made

    def spy_evaluate(model, images, labels, condition, channels_last=False, regression=False):
        evaluated.append((model, len(labels), condition))
        return real_evaluate(model, images, labels, condition, channels_last, regression)

    monkeypatch.setattr(pooled, "_pooled_model", spy_model)
    monkeypatch.setattr(pooled, "evaluate", spy_evaluate)
    run_pooled(small(method, **{"held-out-clients": 1, "num-server-rounds": 1}))
    assert [members for members, *_ in built] == groups
    for _, made, members, conditions in built:
        _, labels, rows = made.data
        assert len(labels) == sum(len(client.train_y) for client in members)
        assert (rows is None) == (method != "pooled-conditional")
        if rows is not None:  # sample by sample, its own client's normalised fingerprint
            expected = np.concatenate([np.tile(conditions[c.partition_id], (len(c.train_y), 1)) for c in members])
            np.testing.assert_allclose(rows.cpu().numpy(), expected, rtol=1e-6)
    clusters = [0, 0, 1, 1, 0, 1]  # partitions 4 and 5 are the held-out clients of clusters 0 and 1
    models = [made.model for _, made, *_ in built]
    assert len(evaluated) == 6
    for partition, (model, _, _) in enumerate(evaluated):
        assert model is models[clusters[partition] if method == "pooled-oracle" else 0]

"""``validation-fraction``: a seeded, class-stratified share of each client's training data held out
for choosing settings (``fedcond.data.scenarios.with_validation``), never trained on nor fingerprinted,
scored every round (history.csv's ``validation_accuracy``, ``heldout_validation_accuracy``)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from fedcond.data.client_data import client_fingerprint, load_client_data, load_partition_file, save_partition
from fedcond.data.scenarios import scenario_for, validation_split
from fedcond.errors import FedcondError
from fedcond.federation.methods import run_config
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import run_in_process

SMALL = {"num-clusters": 2, "clients-per-cluster": 2, "verbose": False}


def test_the_share_is_stratified_seeded_and_disjoint():
    labels = np.repeat(np.arange(4), [50, 30, 20, 1])
    indices = np.arange(1000, 1000 + len(labels))
    train, validation = validation_split(indices, labels, 0.1, np.random.default_rng(3))
    assert sorted([*train, *validation]) == list(indices)
    held = labels[validation - 1000]
    # A tenth of each class, rounded; a class of one sample stays in training.
    assert np.bincount(held, minlength=4).tolist() == [5, 3, 2, 0]
    again, _ = validation_split(indices, labels, 0.1, np.random.default_rng(3))
    assert np.array_equal(train, again)
    other, _ = validation_split(indices, labels, 0.1, np.random.default_rng(4))
    assert not np.array_equal(train, other)


def test_a_client_trains_on_its_training_data_less_its_validation_share_and_keeps_its_test_data():
    plain = scenario_for(run_config(SMALL))
    held = scenario_for(run_config({**SMALL, "validation-fraction": 0.2}))
    for before, after in zip(plain.clients, held.clients, strict=True):
        assert np.array_equal(np.sort([*after.train_indices, *after.validation_indices]), before.train_indices)
        assert not set(after.train_indices) & set(after.validation_indices)
        assert np.array_equal(after.test_indices, before.test_indices)
        assert len(after.validation_indices) == pytest.approx(0.2 * len(before.train_indices), abs=10)
    assert "validation_samples_per_client" in held.summary()
    assert "validation_samples_per_client" not in plain.summary()


def test_the_fingerprint_never_sees_the_validation_share():
    config = run_config({**SMALL, "validation-fraction": 0.2, "method": "recommended"})
    data = load_client_data(config, 0)
    assert data.has_validation
    noised = dataclasses.replace(data, validation_x=np.random.default_rng(0).random(data.validation_x.shape,
                                                                                    dtype=np.float32))  # fmt: skip
    assert np.array_equal(client_fingerprint(config, data), client_fingerprint(config, noised))
    merged = dataclasses.replace(data, train_x=np.concatenate([data.train_x, data.validation_x]),
                                 train_y=np.concatenate([data.train_y, data.validation_y]))  # fmt: skip
    assert not np.array_equal(client_fingerprint(config, data), client_fingerprint(config, merged))


@pytest.mark.parametrize("value", [0.5, -0.1, 0.9])
def test_a_fraction_outside_zero_to_a_half_is_refused_in_one_line(value):
    with pytest.raises(FedcondError, match=r"validation-fraction must be in \[0, 0.5\)") as error:
        run_config({"validation-fraction": value})
    assert "\n" not in str(error.value)


def test_a_partition_file_carries_the_validation_share(tmp_path):
    config = run_config({**SMALL, "validation-fraction": 0.2})
    data = load_client_data(config, 1)
    save_partition(data, config, tmp_path / "partition-1.npz")
    loaded = load_partition_file(tmp_path / "partition-1.npz", config, 1)
    assert np.array_equal(loaded.validation_x, data.validation_x)
    assert np.array_equal(loaded.validation_y, data.validation_y)
    with pytest.raises(FedcondError, match="exported for another split"):
        load_partition_file(tmp_path / "partition-1.npz", run_config(SMALL), 1)


@pytest.mark.parametrize("method", ["recommended", "oracle"])
def test_every_round_records_the_participants_and_newcomers_validation_accuracy(tmp_path, method):
    rows, info = {}, {}
    for fraction in (0.0, 0.2):
        config = run_config({
            **SMALL, "method": method, "held-out-clients": 1, "num-server-rounds": 2, "validation-fraction": fraction,
            "results-dir": str(tmp_path), "run-name": f"v{fraction}",
        })  # fmt: skip
        recorder, _ = run_in_process(config)
        rows[fraction] = read_history(recorder.folder / "history.csv")
        info[fraction] = json.loads((recorder.folder / "run.json").read_text())
    for row in rows[0.2]:
        assert 0 <= float(row["validation_accuracy"]) <= 1
        assert 0 <= float(row["heldout_validation_accuracy"]) <= 1
    # The newcomers' share is their own, not the participants' under another name.
    assert any(row["heldout_validation_accuracy"] != row["validation_accuracy"] for row in rows[0.2])
    assert info[0.2]["final_validation_accuracy"] == float(rows[0.2][-1]["validation_accuracy"])
    assert info[0.2]["final_heldout_validation_accuracy"] == float(rows[0.2][-1]["heldout_validation_accuracy"])
    # Without a validation share nothing is scored on one, and run.json says nothing of it.
    assert all(math.isnan(float(row["validation_accuracy"])) for row in rows[0.0])
    assert "final_validation_accuracy" not in info[0.0]

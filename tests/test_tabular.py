"""The appendix's tabular task: its generator, its scenario, the first-eigenvector fingerprint and the
refusals that keep image-only settings off it (the models: tests/test_models.py)."""

import numpy as np
import pytest

from fedcond.config import RunConfig
from fedcond.data import tabular
from fedcond.data.client_data import check_partition_arrays, client_fingerprint, load_client_data
from fedcond.data.datasets import load_dataset
from fedcond.data.scenarios import build_scenario, validate_without_data
from fedcond.errors import FedcondError
from fedcond.fingerprint import fingerprints as fp

TASK = {"dataset": "synthetic-logistic", "scenario": "concept-weights"}


def task_config(**changes: object) -> RunConfig:
    return RunConfig.from_mapping({**TASK, "num-clusters": 3, "clients-per-cluster": 100, **changes})


def test_the_generator_is_fixed_and_its_concepts_are_its_equations():
    first, second = tabular.generate("logistic"), tabular.generate("logistic")
    for key, array in first.items():
        np.testing.assert_array_equal(array, second[key])
    per_concept = tabular.CLIENTS_PER_CONCEPT * tabular.SAMPLES_PER_CLIENT
    assert first["train_x"].shape == (tabular.CONCEPTS * per_concept, tabular.FEATURES)
    weights = tabular.concept_weights()
    assert np.abs(weights).max() <= tabular.WEIGHT_RANGE
    for concept in range(tabular.CONCEPTS):
        rows = first["train_concepts"] == concept
        latent = first["train_x"][rows] @ weights[concept]
        # y = 1[x^T w_k + eps > 0] with eps ~ N(0, 0.1^2): only samples within the noise of the boundary disagree.
        disagree = (latent > 0) != first["train_y"][rows].astype(bool)
        assert disagree.mean() < 0.01 and np.abs(latent[disagree]).max() < 6 * tabular.NOISE_STD


def test_the_generator_lands_table_vi_references_on_their_scale():
    """Calibration (fedcond/data/tabular.py): one logistic model for three concepts scores near Table VI's
    Global (0.700), one per concept near its Cluster (0.997)."""
    from sklearn.linear_model import LogisticRegression

    data = tabular.generate("logistic")
    pooled = np.isin(data["train_concepts"], [0, 1, 2])
    x, y = data["train_x"][pooled][::5], data["train_y"][pooled][::5]
    assert 0.66 < LogisticRegression(max_iter=1000).fit(x, y).score(x, y) < 0.78
    own = data["train_concepts"] == 0
    x0, y0 = data["train_x"][own], data["train_y"][own]
    assert LogisticRegression(C=100, max_iter=1000).fit(x0, y0).score(x0, y0) > 0.99


def test_each_cluster_holds_its_own_concept_one_hundred_samples_a_client():
    config = task_config()
    dataset = load_dataset("synthetic-logistic")
    scenario = build_scenario(config)
    assert len(scenario.clients) == 300 and scenario.num_classes == 2
    for client in scenario.clients:
        assert len(client.train_indices) == len(client.test_indices) == tabular.SAMPLES_PER_CLIENT
        assert set(dataset.train_concepts[client.train_indices]) == {client.cluster}
        assert set(dataset.test_concepts[client.test_indices]) == {client.cluster}
    with pytest.raises(FedcondError, match=r"concept-weights has 8 concepts; set num-clusters to 1\.\.8"):
        build_scenario(task_config(**{"num-clusters": 9}))


def test_the_first_eigenvector_is_signed_and_finds_its_concepts_direction():
    rng = np.random.default_rng(0)
    direction = np.array([3.0, 0.0, -4.0]) / 5
    samples = rng.standard_normal((5000, 1)) * 3 * direction + 0.1 * rng.standard_normal((5000, 3))
    for data in (samples, -samples, samples[::-1]):
        vector = fp.covariance_eigenvectors(data, 1)
        np.testing.assert_allclose(vector, -direction, atol=0.01)  # last entry turned positive
    assert fp.covariance_eigenvectors(samples, 5).shape == (15,)  # rank 3: two zero rows
    np.testing.assert_array_equal(fp.covariance_eigenvectors(samples, 5)[9:], 0.0)
    # On the task, with many samples, a client's vector points along its concept's weights.
    data = tabular.generate("logistic")
    weights = tabular.concept_weights()
    for concept in (0, 5):
        rows = data["train_concepts"] == concept
        vector = fp.eigenvector_fingerprint(data["train_x"][rows], data["train_y"][rows], 2, 1)
        unit = weights[concept] / np.linalg.norm(weights[concept])
        assert abs(vector[:10] @ unit) / np.linalg.norm(vector[:10]) > 0.95


def test_a_client_computes_the_eigenvector_fingerprint_of_its_own_data():
    config = task_config(fingerprint="eigenvector", **{"fingerprint-dim": 2})
    data = load_client_data(config, 0)
    vector = client_fingerprint(config, data)
    assert vector.shape == (2 * 12,)
    np.testing.assert_allclose(vector, fp.eigenvector_fingerprint(data.train_x, data.train_y, 2, 2))
    assert fp.fingerprint_size("eigenvector", 2, 2, 3, 10) == 24


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scenario": "label-shift"}, "scenario label-shift splits images, and synthetic-logistic is a tabular task"),
        ({"dataset": "digits"}, "scenario concept-weights splits tabular tasks, and digits holds images"),
        ({"conditioning": "lin", "dataset": "digits", "scenario": "label-shift"},
         "conditioning=lin is not offered for the cnn model of digits; choose one of concat, film, hyper"),
        ({"fingerprint-encoder": "mnist"}, "is an image encoder and synthetic-logistic is a tabular task"),
        ({"fingerprint": "eigenvector", "fingerprint-dim": 13}, "set fingerprint-dim to 1..12"),
        ({"fingerprint": "eigenvector", "fingerprint-dim": 4, "dataset": "digits", "scenario": "label-shift",
          "normalisation": "none"}, None),
        ({"fingerprint": "eigenvector", "fingerprint-dim": 4, "dataset": "digits", "scenario": "label-shift",
          "normalisation": "federated"}, "fingerprint eigenvector z-scored .* on digits makes each of its 296 values "
         r"unit-spread, .* set normalisation=none \(each eigenvector is unit-norm already"),
        ({"fingerprint": "eigenvector", "fingerprint-dim": 1, "normalisation": "federated"}, None),
        ({"fingerprint-encoder": "synthetic-logistic", "dataset": "digits", "scenario": "label-shift"},
         "unknown fingerprint-encoder 'synthetic-logistic'"),
        ({"ensemble-size": 0}, "ensemble-size must be in 1..64"),
    ],
)  # fmt: skip
def test_settings_for_the_other_kind_of_data_are_refused_in_one_line(changes, message):
    if message is None:
        validate_without_data(task_config(**changes))
        return
    with pytest.raises(FedcondError, match=message):
        validate_without_data(task_config(**changes))


def test_a_tabular_partition_file_takes_signed_features_and_refuses_non_finite_ones():
    config = task_config()
    data = load_client_data(config, 0)
    arrays = {"train_x": data.train_x, "train_y": data.train_y, "test_x": data.test_x, "test_y": data.test_y,
              "num_classes": np.array(2)}  # fmt: skip
    assert data.train_x.min() < 0
    check_partition_arrays(arrays, config, "file", "fix")
    broken = {**arrays, "test_x": np.where(data.test_x > 1, np.nan, data.test_x)}
    with pytest.raises(FedcondError, match="NaN or infinite"):
        check_partition_arrays(broken, config, "file", "fix")
    with pytest.raises(FedcondError, match=r"expected \(n, 10\)"):
        check_partition_arrays({**arrays, "train_x": data.train_x[:, :9]}, config, "file", "fix")


# -- regression: synthetic-linear, its RMSE through training, history and reports ---------------------
LINEAR = {"dataset": "synthetic-linear", "scenario": "concept-weights"}


def test_linear_is_the_latent_logistic_thresholds():
    linear, logistic = tabular.generate("linear"), tabular.generate("logistic")
    np.testing.assert_array_equal(linear["train_x"], logistic["train_x"])
    np.testing.assert_array_equal(linear["train_y"] > 0, logistic["train_y"].astype(bool))
    weights = tabular.concept_weights()
    rows = linear["test_concepts"] == 2
    residual = linear["test_y"][rows] - linear["test_x"][rows].astype(np.float64) @ weights[2]
    assert linear["test_y"].dtype == np.float32 and abs(residual.std() - tabular.NOISE_STD) < 0.005


def test_a_regression_client_trains_to_the_noise_and_scores_its_rmse():
    from fedcond.model.networks import build_run_model
    from fedcond.model.training import TrainSettings, evaluate, train

    config = RunConfig.from_mapping({**LINEAR, "num-clusters": 2, "clients-per-cluster": 20}).resolved()
    data = load_client_data(config, 0)
    assert data.train_y.dtype == np.float32 and data.num_classes == 1 and len(data.train_y) == 500
    model = build_run_model(config, 1, conditioned=False)
    settings = TrainSettings.of(config)
    assert settings.regression
    before = evaluate(model, data.test_x, data.test_y, None, regression=True)
    train(model, data.train_x, data.train_y, None, settings, seed=0)
    after = evaluate(model, data.test_x, data.test_y, None, regression=True)
    assert before.accuracy > 5 and after.accuracy < 0.13  # one linear model per concept: the noise, 0.1
    assert after.accuracy == pytest.approx(after.loss**0.5)


def test_regression_refuses_per_class_fingerprints_and_scores_and_non_finite_targets():
    with pytest.raises(FedcondError, match="fingerprint class-mean summarises each class, and synthetic-linear"):
        validate_without_data(RunConfig.from_mapping({**LINEAR, "fingerprint": "class-mean"}))
    validate_without_data(RunConfig.from_mapping({**LINEAR, "fingerprint": "eigenvector", "fingerprint-dim": 11}))
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match="per-class-accuracy scores classes, and synthetic-linear is a regression"):
        validate_without_data(run_config({**LINEAR, "per-class-accuracy": True}))
    config = RunConfig.from_mapping({**LINEAR, "clients-per-cluster": 100})
    data = load_client_data(config, 0)
    arrays = {"train_x": data.train_x, "train_y": data.train_y, "test_x": data.test_x, "test_y": data.test_y,
              "num_classes": np.array(1)}  # fmt: skip
    check_partition_arrays(arrays, config, "file", "fix")
    with pytest.raises(FedcondError, match="targets must be finite real numbers"):
        check_partition_arrays({**arrays, "test_y": data.test_y * np.inf}, config, "file", "fix")


def test_the_worst_client_of_a_lower_is_better_score_is_the_highest():
    from fedcond.records.metrics import ClientEvaluation, Spread

    evaluations = [ClientEvaluation(0, 10, 0.0, score) for score in (0.1, 0.2, 5.0)]
    assert Spread.of(evaluations).worst == 0.1
    assert Spread.of(evaluations, "rmse").worst == 5.0 and Spread.of(evaluations, "rmse").p10 > 1.0


@pytest.mark.slow
def test_a_regression_run_writes_rmse_through_history_run_json_and_the_report(tmp_path):
    import csv
    import json

    from fedcond.tools.report import read_metrics, summarise, summary_table
    from fedcond.tools.simulation import simulate

    config = RunConfig.from_mapping({
        **LINEAR, "num-clusters": 2, "clients-per-cluster": 3, "num-server-rounds": 2, "data-fraction": 0.03,
        "method": "oracle", "results-dir": str(tmp_path / "oracle"), "verbose": False,
    })  # fmt: skip
    simulate(config)
    (folder,) = (tmp_path / "oracle").iterdir()
    with (folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    info = json.loads((folder / "run.json").read_text())
    assert {"rmse", "worst_rmse", "rmse_cluster_1"} <= set(rows[0]) and "accuracy" not in rows[0]
    assert info["metric"] == "rmse" and info["final_rmse"] == pytest.approx(float(rows[-1]["rmse"]))
    assert float(rows[-1]["rmse"]) < 0.2  # one model per concept: near the noise
    assert float(rows[-1]["worst_rmse"]) >= float(rows[-1]["rmse"])
    # A tidy file of the run and a worse one: the report ranks the lower RMSE first and says rmse.
    tidy = tmp_path / "metrics.csv"
    base = {"dataset": "synthetic-linear", "scenario": "concept-weights", "num_clusters": "2",
            "clients_per_cluster": "3", "data_fraction": "0.03", "rotations": "", "seed": "0", "round": "1",
            "loss": "0", "seconds": "1", "bytes_down": "0", "bytes_up": "0", "ari": "nan", "train_loss": "0",
            "elapsed_seconds": "1"}  # fmt: skip
    with tidy.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, [*base, "method", "rmse"])
        writer.writeheader()
        writer.writerows([{**base, "method": "fedavg", "rmse": "12.5"}, {**base, "method": "oracle", "rmse": "0.1"}])
    summaries = summarise(read_metrics(tidy))
    assert [s.method for s in summaries] == ["oracle", "fedavg"]
    assert "final rmse" in summary_table(summaries, metric="rmse")

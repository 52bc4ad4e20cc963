"""Privacy: the fingerprint reconstruction attack, DP-SGD (Opacus), the DP fingerprint's sensitivity
bounds, the accounting, client-level DP through Flower's wrappers, and what the registry refuses."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fedcond.strategies.fedavg import FedcondFedAvg
from flwr.common import (
    Code,
    Context,
    FitIns,
    FitRes,
    Message,
    MessageType,
    RecordDict,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from torch import nn

from fedcond.config import RunConfig
from fedcond.data.client_data import client_fingerprint, load_client_data
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client_dp import ServerSideClientDp
from fedcond.federation.clipping_mod import client_dp_clipping_mod
from fedcond.federation.messages import ERROR
from fedcond.federation.methods import run_config
from fedcond.federation.server_method import EMPTY, StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.fingerprint import fingerprints as fp
from fedcond.fingerprint import statistics_encoding
from fedcond.model.conditioning import MECHANISMS, conditions
from fedcond.model.networks import build_model, build_run_model, get_weights
from fedcond.model.training import DpSgd, ProximalTerm, TrainSettings, train, train_private
from fedcond.privacy import dp as privacy
from fedcond.privacy.attack import cosine_similarity, reconstruct_condition, relative_error, undo_zscore
from fedcond.tools.experiment import Experiment, record_experiment
from tests.scripts import load_script

# Two clusters of one client each on digits, one local epoch: ~70 training samples per client.
SMALL = {"num-clusters": 2, "clients-per-cluster": 1, "local-epochs": 1}


def small_config(**changes: object) -> RunConfig:
    return run_config({**SMALL, **changes}).resolved()


def federation(config: RunConfig):
    """Every client's data and the z-score the secure sum would publish (mean, std of raw fingerprints)."""
    clients = [load_client_data(config, partition) for partition in range(config.num_clients)]
    raws = np.array([client_fingerprint(config, data) for data in clients])
    return clients, raws, raws.mean(axis=0), raws.std(axis=0)


#: Each mechanism on a run of a model it conditions: digits' CNN, or the tabular task's MLP / own network.
TABULAR = {"dataset": "synthetic-logistic", "scenario": "concept-weights", "data-fraction": 0.01}
MECHANISM_RUNS = [pytest.param(name, {} if conditions(name, "cnn") else TABULAR, id=name) for name in MECHANISMS] + [
    pytest.param(name, TABULAR, id=f"{name}-tabular") for name in ("concat", "hyper")
]


# -- the attack ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("conditioning", "task"), MECHANISM_RUNS)
def test_one_plain_update_gives_the_server_the_clients_fingerprint(conditioning, task):
    config = small_config(conditioning=conditioning, **task)
    clients, raws, mean, std = federation(config)
    data = clients[0]
    fed = fp.standardise(raws[0], mean, std)
    model = build_run_model(config, data.num_classes, conditioned=True)
    sent = get_weights(model)
    train(model, data.train_x, data.train_y, fed, TrainSettings.of(config), seed=0)

    recovered = reconstruct_condition(model, sent, get_weights(model))

    assert cosine_similarity(recovered, fed) > 0.99
    assert relative_error(recovered, fed) < 1e-4  # float32 training, float64 algebra
    # The published z-score undone: the raw eigenvalues themselves.
    assert relative_error(undo_zscore(recovered, mean, std), raws[0]) < 1e-4


def test_on_an_aggregate_the_attack_returns_a_mixture_of_the_clients_fingerprints():
    config = small_config(**{"num-clusters": 3})  # (two clients' z-scores would be s and -s)
    clients, raws, mean, std = federation(config)
    template = build_run_model(config, clients[0].num_classes, conditioned=True)
    sent = get_weights(template)
    returned, fingerprints = [], []
    for data, raw in zip(clients, raws, strict=True):
        model = build_run_model(config, data.num_classes, conditioned=True)
        fingerprints.append(fp.standardise(raw, mean, std))
        train(model, data.train_x, data.train_y, fingerprints[-1], TrainSettings.of(config), seed=data.partition_id)
        returned.append(get_weights(model))
    average = [np.mean(arrays, axis=0) for arrays in zip(*returned, strict=True)]

    mixed = reconstruct_condition(template, sent, average)

    # In the span of the two fingerprints (what the formula implies), and not either of them.
    basis = np.stack(fingerprints, axis=1)
    coefficients = np.linalg.lstsq(basis, mixed, rcond=None)[0]
    assert relative_error(basis @ coefficients, mixed) < 1e-4
    # (Aggregation alone is no guarantee: with three clients one of them was measured at cosine 0.95.)
    assert all(abs(cosine_similarity(mixed, one)) < 0.999 for one in fingerprints)


def test_the_attack_refuses_an_unconditioned_model_and_a_foreign_update():
    model = build_model((1, 8, 8), 10, condition_dim=0, seed=0)
    with pytest.raises(FedcondError, match="not conditioned"):
        reconstruct_condition(model, get_weights(model), get_weights(model))
    conditioned = build_model((1, 8, 8), 10, condition_dim=4, seed=0)
    with pytest.raises(FedcondError, match="arrays of this model"):
        reconstruct_condition(conditioned, get_weights(model), get_weights(conditioned))


# -- DP-SGD through Opacus -------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize(("conditioning", "task"), MECHANISM_RUNS)
def test_opacus_per_sample_gradients_add_up_to_the_batch_gradient(conditioning, task):
    from opacus import GradSampleModule

    privacy.per_sample_gradient_layers()
    shape = (10,) if task else (1, 8, 8)
    model = build_model(shape, 10, condition_dim=4, seed=0, conditioning=conditioning)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.rand((6, *shape), generator=generator), torch.randint(0, 10, (6,), generator=generator)
    condition = torch.randn((1, 4), generator=generator)
    wrapped = GradSampleModule(model, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(images, condition), labels, reduction="sum").backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad_sample.shape == (6, *parameter.shape), name
        torch.testing.assert_close(parameter.grad_sample.sum(dim=0), parameter.grad, rtol=1e-4, atol=1e-5)
    wrapped.cleanup()


def test_dp_sgd_trains_accounts_and_leaves_the_model_reusable():
    config = small_config()
    data = load_client_data(config, 0)
    model = build_run_model(config, data.num_classes, conditioned=False)
    before = get_weights(model)
    ledger = privacy.PrivacyLedger()
    settings = TrainSettings.of(config)
    loss = train_private(model, data.train_x, data.train_y, None, settings, DpSgd(1.0, 1.0), ledger)

    steps_per_epoch = math.ceil(len(data.train_y) / settings.batch_size)
    assert ledger.entries == [(1.0, 1 / steps_per_epoch, steps_per_epoch * settings.epochs)]
    assert math.isfinite(loss)
    after = get_weights(model)
    assert all(np.isfinite(array).all() for array in after)
    assert any(not np.array_equal(old, new) for old, new in zip(before, after, strict=True))
    # Opacus's hooks and per-sample attributes are gone: plain training works on the same model.
    assert not any(
        hasattr(parameter, "grad_sample") or hasattr(parameter, "summed_grad") for parameter in model.parameters()
    )
    assert not any(
        module._forward_hooks or module._backward_hooks or hasattr(module, "activations") for module in model.modules()
    )
    train(model, data.train_x, data.train_y, None, settings, seed=0)
    # Twice the training, more epsilon; the same mechanism's steps join one entry.
    first = ledger.epsilon(1e-5)
    train_private(model, data.train_x, data.train_y, None, settings, DpSgd(1.0, 1.0), ledger)
    assert 0 < first < ledger.epsilon(1e-5) < math.inf
    assert ledger.entries == [(1.0, 1 / steps_per_epoch, 2 * steps_per_epoch * settings.epochs)]


def test_dp_sgd_with_a_proximal_term_pulls_towards_the_anchor():
    config = small_config()
    data = load_client_data(config, 0)
    anchor = build_run_model(config, data.num_classes, conditioned=False)
    model = build_run_model(config, data.num_classes, conditioned=False, seed=1)

    def distance() -> float:
        with torch.no_grad():
            pairs = zip(model.parameters(), anchor.parameters(), strict=True)
            return sum(float((own - fixed).pow(2).sum()) for own, fixed in pairs)

    start = distance()
    settings = TrainSettings(epochs=1, batch_size=16, learning_rate=0.05, momentum=0.0)
    # Almost no noise and a strong pull: the model moves towards the anchor.
    train_private(
        model, data.train_x, data.train_y, None, settings, DpSgd(1e-3, 1e-3), privacy.PrivacyLedger(),
        ProximalTerm(anchor, strength=5.0),
    )  # fmt: skip
    assert distance() < 0.5 * start


def test_clipping_alone_leaves_the_attack_exact_and_noise_degrades_it():
    config = small_config()
    clients, raws, mean, std = federation(config)
    data, fed = clients[0], fp.standardise(raws[0], mean, std)

    def attacked(noise_multiplier: float) -> float:
        model = build_run_model(config, data.num_classes, conditioned=True)
        sent = get_weights(model)
        settings = TrainSettings.of(config)
        train_private(
            model, data.train_x, data.train_y, fed, settings, DpSgd(noise_multiplier, 1.0), privacy.PrivacyLedger()
        )
        return cosine_similarity(reconstruct_condition(model, sent, get_weights(model)), fed)

    # Clipped per-sample gradients still share the outer-product structure: exact.
    assert attacked(0.0) > 0.999
    # With noise 2 (one epoch) the reconstruction is far off (measured ~0.1-0.4); a loose bound.
    assert np.mean([attacked(2.0) for _ in range(3)]) < 0.8


# -- the DP fingerprint: sensitivity, calibration, accounting ---------------------------------------
def eigen_of(rows: np.ndarray, dim: int) -> np.ndarray:
    return fp.covariance_eigenvalues(rows, dim)


def random_rows(rng: np.random.Generator, count: int, pixels: int, classes: int) -> np.ndarray:
    images = rng.random((count, pixels)) ** rng.uniform(0.2, 5)  # from near-binary to near-zero pixels
    return fp.feature_matrix(images, rng.integers(0, classes, count), classes)


@pytest.mark.parametrize("dim", [1, 4, 32])
def test_eigen_sensitivity_bound_holds_for_the_worst_cases_and_random_neighbours(dim):
    pixels, classes = 16, 4
    corner = np.concatenate([np.zeros(pixels), np.eye(classes)[0]])
    opposite = np.concatenate([np.ones(pixels), np.eye(classes)[1]])
    rng = np.random.default_rng(0)
    worst_ratio = 0.0
    for count in (3, 4, 6, 10, 25, 60):
        bound = privacy.fingerprint_sensitivity("eigen", count, pixels, classes, dim)
        neighbours = [
            # All rows on one corner, then one on the opposite corner: the added row's full weight.
            (np.tile(corner, (count, 1)), opposite),
            (np.tile(corner, (count - 1, 1)), opposite),
            # The data split between the two corners (the largest variance), a row added at either one.
            (np.array([corner, opposite] * (count // 2) + [corner] * (count % 2)), opposite),
            (np.array([corner, opposite] * (count // 2) + [corner] * (count % 2)), corner),
            (np.array([corner, opposite] * ((count - 1) // 2) + [corner] * ((count - 1) % 2)), opposite),
        ]
        for _ in range(40):
            rows = random_rows(rng, count, pixels, classes)
            neighbours.append((rows, random_rows(rng, 1, pixels, classes)[0]))
            neighbours.append((rows[:-1], rows[-1]))  # removing a sample of a client holding `count`
        for smaller, extra in neighbours:
            if len(smaller) < 2:
                continue
            larger = np.vstack([smaller, extra])
            # The client holds `count`; its neighbour one more or one fewer: both pairs are covered.
            if not count - 1 <= len(smaller) <= count:
                continue
            change = np.linalg.norm(eigen_of(larger, dim) - eigen_of(smaller, dim))
            assert change <= bound * (1 + 1e-9), (count, len(smaller), change, bound)
            worst_ratio = max(worst_ratio, change / bound)
    # Not vacuous: the constructed cases come within a factor ~2 of the bound.
    assert worst_ratio > 0.4


@pytest.mark.parametrize("name", ["class-eigen", "class-mean", "label-cov"])
def test_other_fingerprints_stay_within_their_bounds(name):
    pixels, classes, dim = 16, 4, 8
    rng = np.random.default_rng(1)
    for count in (3, 5, 12, 40):
        bound = privacy.fingerprint_sensitivity(name, count, pixels, classes, dim)
        for trial in range(40):
            images = rng.random((count + 1, pixels)) ** rng.uniform(0.2, 5)
            labels = rng.integers(0, classes, count + 1)
            if trial % 4 == 0:  # a class held by the extra sample alone (0 -> 1 member)
                labels[:-1] = rng.integers(0, classes - 1, count)
                labels[-1] = classes - 1
            if trial % 4 == 1:  # binary pixels at opposite corners
                images = np.round(images)
                images[-1] = 1 - images[0]
            sample_bigger = fp.ClientSample(images, labels, classes, dim)
            sample_smaller = fp.ClientSample(images[:-1], labels[:-1], classes, dim)
            change = np.linalg.norm(
                fp.compute_fingerprint(name, sample_bigger) - fp.compute_fingerprint(name, sample_smaller)
            )
            assert change <= bound * (1 + 1e-9), (name, count, trial, change, bound)


def test_sensitivity_needs_three_samples_and_a_bounded_fingerprint():
    with pytest.raises(FedcondError, match="at least 3 training samples"):
        privacy.fingerprint_sensitivity("eigen", 2, 16, 4, 8)
    with pytest.raises(FedcondError, match="no sensitivity bound"):
        privacy.fingerprint_sensitivity("random-id", 50, 16, 4, 8)
    # More samples, less sensitivity (about 1.35 (p + 2) / n for large n).
    bounds = [privacy.fingerprint_sensitivity("eigen", count, 64, 10, 32) for count in (10, 100, 1000)]
    assert bounds[0] > bounds[1] > bounds[2] and bounds[2] == pytest.approx(1.354 * 66 / 999, rel=0.01)


def test_the_fingerprint_noise_is_calibrated_to_epsilon_and_composes_with_dp_sgd():
    multiplier = privacy.gaussian_noise_multiplier(1.0, 1e-5)
    ledger = privacy.PrivacyLedger()
    ledger.add(multiplier, 1.0, 1)
    assert ledger.epsilon(1e-5) == pytest.approx(1.0, abs=0.01)
    assert privacy.gaussian_noise_multiplier(4.0, 1e-5) < multiplier
    # The noise has the stated scale: 1024 draws around a zero fingerprint.
    settings = privacy.SampleLevelPrivacy(0.0, 1.0, 1e-5, 1.0)
    images = np.random.default_rng(0).random((200, 1, 8, 8))
    labels = np.arange(200) % 10
    release = privacy.private_fingerprint(np.zeros(1024), "eigen", images, labels, 10, 1024, settings)
    assert release.noise_std == pytest.approx(multiplier * release.sensitivity)
    assert np.std(release.vector) == pytest.approx(release.noise_std, rel=0.1)
    # Composition under Renyi DP: more than either part, less than their sum.
    sgd = privacy.PrivacyLedger([(1.0, 0.2, 50)])
    both = privacy.PrivacyLedger([*ledger.entries, *sgd.entries])
    parts = (ledger.epsilon(1e-5), sgd.epsilon(1e-5))
    assert max(parts) < both.epsilon(1e-5) < sum(parts)
    assert privacy.PrivacyLedger.from_record(both.to_record()) == both
    with pytest.raises(FedcondError, match=r"pixels in \[0, 1\]"):
        privacy.private_fingerprint(np.zeros(4), "eigen", images * 2, labels, 10, 4, settings)


# -- what is refused before anything starts --------------------------------------------------------
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "ifca", "dp-noise-multiplier": 1.0}, "also send the choice of the model with the lowest loss"),
        ({"method": "descriptor-clustering", "dp-noise-multiplier": 1.0}, "also send a descriptor of their training"),
        ({"method": "fedavg", "dataset": "cifar10", "dp-noise-multiplier": 1.0}, "BatchNorm"),
        ({"dp-noise-multiplier": 1.0}, "needs fingerprint-epsilon > 0"),
        ({"method": "fedavg", "fingerprint-epsilon": 1.0}, "feeds no fingerprint"),
        ({"fingerprint": "random-id", "fingerprint-epsilon": 1.0}, "reads no training sample"),
        ({"fingerprint-encoder": "mnist", "fingerprint-epsilon": 1.0}, "fingerprint-encoder=pixels"),
        ({"dp-delta": 0.0}, r"dp-delta must be in \(0, 1\)"),
        ({"dp-max-grad-norm": 0.0}, "dp-max-grad-norm must be positive"),
        ({"client-dp": "central"}, "unknown client-dp 'central'"),
        ({"method": "gossip", "client-dp": "server-side"}, "averages one global model"),
        ({"method": "ifca", "client-dp": "client-side"}, "or one per true cluster .* ifca does not"),
        ({"method": "oracle", "client-dp": "server-side"}, "its cluster.s; use client-dp=client"),
        ({"method": "oracle", "client-dp": "client-side", "clients-per-round": 5}, "every training client must train"),
        ({"client-dp": "client-side", "client-dp-clipping-norm": 0.0}, "client-dp-clipping-norm must be positive"),
        ({"client-dp": "client-side"}, "set client-dp-statistics-clipping-norm to a bound"),
        ({"method": "pooled-global", "dp-noise-multiplier": 1.0}, "federated methods only"),
        ({"method": "fedavg", "dp-noise-multiplier": 1.0, "resume": "/a/run"}, "its epsilon would restart from 0"),
        # Secure aggregation (fedcond.privacy.secure_aggregation, each strategy's secure_aggregation_refusal).
        ({"secure-aggregation": "sum"}, "unknown secure-aggregation 'sum'"),
        ({"method": "oracle", "secure-aggregation": "secaggplus"}, "Oracle averages within each true cluster"),
        ({"method": "ifca", "secure-aggregation": "secaggplus"}, "IFCA's server groups the returned models"),
        ({"method": "local", "secure-aggregation": "secaggplus"}, "nothing to aggregate"),
        ({"method": "gossip", "secure-aggregation": "secaggplus"}, "average with chosen peers"),
        ({"method": "dac", "secure-aggregation": "secaggplus"}, "average with chosen peers"),
        ({"method": "fedavg", "secure-aggregation": "secaggplus", "client-dp": "server-side"}, "use client-dp=client"),
        ({"method": "pooled-global", "secure-aggregation": "secaggplus"}, "federated methods only"),
        ({"secagg-min-clients": 16}, r"secagg-min-clients=16 clients, but the federation trains 15"),
        ({"method": "fedavg", "secure-aggregation": "secaggplus", "secagg-min-clients": 16}, "each round's updates"),
        ({"method": "fedavg", "secure-aggregation": "secaggplus", "secagg-num-shares": 0.0}, r"fractions in \(0, 1\]"),
        ({"method": "fedavg", "secure-aggregation": "secaggplus", "secagg-clipping-range": 0.0}, "must be positive"),
        (
            {"method": "fedavg", "secure-aggregation": "secaggplus", "secagg-quantization-range": 2**29},
            r"15 clients x secagg-quantization-range=536870912 reach SecAgg\+'s modulus",
        ),
    ],
)
def test_dp_settings_a_run_cannot_honour_are_refused_in_one_line(settings, message):
    with pytest.raises(FedcondError, match=message) as error:
        check_run(run_config(settings))
    assert "\n" not in str(error.value)


def test_dp_settings_that_hold_are_accepted():
    for settings in (
        {"method": "fedavg", "dp-noise-multiplier": 1.0},
        {"dp-noise-multiplier": 1.0, "fingerprint-epsilon": 2.0, "conditioning": "hyper"},
        {"method": "ditto", "client-dp": "client-side", "dp-noise-multiplier": 0.5},
        {"method": "oracle", "client-dp": "client-side", "server-momentum": 0.5},
        {"fingerprint": "label-cov", "fingerprint-epsilon": 1.0},
        {"fingerprint": "random-id", "dp-noise-multiplier": 1.0},  # a data-free fingerprint needs no noise
        {"method": "fedavg", "secure-aggregation": "secaggplus"},
        {"method": "ditto", "secure-aggregation": "secaggplus", "dp-noise-multiplier": 0.5},
        {
            "secure-aggregation": "secaggplus",
            "client-dp": "client-side",
            "fingerprint-epsilon": 8.0,
            "client-dp-statistics-clipping-norm": 2.0,
        },
        {"client-dp": "client-side", "normalisation": "none"},  # nothing published: no statistics to noise
        {"method": "gossip", "secagg-min-clients": 16},  # no secure sum in this run: nothing to refuse
    ):
        check_run(run_config(settings))


# -- through Flower ----------------------------------------------------------------------------------
def read_run(results: Path) -> tuple[list[dict[str, str]], dict]:
    (folder,) = results.iterdir()
    with (folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    return rows, json.loads((folder / "run.json").read_text())


@pytest.mark.slow
def test_dp_sgd_run_reports_a_growing_epsilon_and_withholds_the_training_loss(tmp_path):
    from fedcond.tools.simulation import simulate

    config = run_config({
        **SMALL, "num-server-rounds": 2, "dp-noise-multiplier": 1.0, "fingerprint-epsilon": 4.0,
        "results-dir": str(tmp_path / "results"), "verbose": False,
    })  # fmt: skip
    simulate(config)
    rows, info = read_run(tmp_path / "results")
    assert info["status"] == "finished" and len(rows) == 2
    epsilons = [float(row["epsilon"]) for row in rows]
    assert 4.0 < epsilons[0] < epsilons[1] < math.inf  # the fingerprint's 4, then the DP-SGD steps on top
    assert all(math.isnan(float(row["train_loss"])) for row in rows)
    assert all(0 <= float(row["accuracy"]) <= 1 for row in rows)
    sample_level = info["privacy"]["sample_level"]
    assert sample_level["dp_sgd"]["noise_multiplier"] == 1.0 and sample_level["fingerprint"]["epsilon"] == 4.0
    assert info["privacy"]["client_level"] is None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["server-side", "client-side"])
def test_client_level_dp_clips_every_update_and_keeps_the_history(tmp_path, mode):
    from fedcond.tools.simulation import simulate

    # No noise and a clipping norm of 1e-9: the global model cannot move, so both rounds evaluate
    # the same model (without clipping round 2's accuracy differs).
    config = run_config({
        **SMALL, "method": "fedavg", "num-server-rounds": 2, "client-dp": mode, "client-dp-noise-multiplier": 0.0,
        "client-dp-clipping-norm": 1e-9, "results-dir": str(tmp_path / "results"), "verbose": False,
    })  # fmt: skip
    simulate(config)
    rows, info = read_run(tmp_path / "results")
    assert info["status"] == "finished" and [int(row["round"]) for row in rows] == [1, 2]
    assert rows[0]["accuracy"] == rows[1]["accuracy"] and rows[0]["loss"] == rows[1]["loss"]
    assert all(int(row["bytes_up"]) > 0 and math.isfinite(float(row["train_loss"])) for row in rows)
    assert math.isnan(float(rows[0]["epsilon"]))  # no sample-level DP
    client_level = info["privacy"]["client_level"]
    assert client_level["mode"] == mode and client_level["clipping_norm"] == 1e-9
    assert client_level["clients_per_round"] == 2 and client_level["epsilon_by_round"] == [None, None]


@pytest.mark.parametrize("method", ["fedavg", "oracle"])
def test_the_in_process_runner_clips_client_side_as_the_clientapps_mod_does(tmp_path, method):
    from fedcond.tools.in_process import run_in_process

    # No noise and a clipping norm of 1e-9: no model can move, so both rounds evaluate the same models.
    config = run_config({
        **SMALL, "method": method, "num-server-rounds": 2, "client-dp": "client-side",
        "client-dp-noise-multiplier": 0.0, "client-dp-clipping-norm": 1e-9, "results-dir": str(tmp_path / "results"),
        "verbose": False,
    })  # fmt: skip
    run_in_process(config)
    rows, info = read_run(tmp_path / "results")
    assert info["status"] == "finished" and [int(row["round"]) for row in rows] == [1, 2]
    assert rows[0]["accuracy"] == rows[1]["accuracy"] and rows[0]["loss"] == rows[1]["loss"]


def test_client_level_dp_stops_a_round_that_lost_a_client_with_its_reason():
    from flwr.server.server import fit_clients

    from fedcond.data.scenarios import scenario_for
    from tests.test_failures import federation, two_by_two

    # min-answered-fraction would let 3 of 4 go on; client-dp's noise is calibrated to all 4.
    config = run_config({"method": "fedavg", "num-clusters": 2, "clients-per-cluster": 2, "min-answered-fraction": 0.5})
    inputs = StrategyInputs(config, 10, False, None, scenario=scenario_for(config))
    strategy = ServerSideClientDp(FedcondStrategy(FedcondFedAvg(inputs)), 1.0, 1.0, 4)
    manager = federation(two_by_two(p1="disk full"))
    strategy.initialize_parameters(manager)
    results, failures = fit_clients(strategy.configure_fit(1, EMPTY, manager), None, None, 1)
    with pytest.raises(FedcondError, match=r"round 1: 3 of 4 clients answered fit, and client-dp's noise") as error:
        strategy.aggregate_fit(1, results, failures)
    assert "partition 1 failed in fit: disk full" in str(error.value)


def test_client_level_dp_takes_the_server_step_on_the_noised_mean_and_keeps_variances_valid():
    from flwr.server.server import fit_clients

    from fedcond.data.scenarios import scenario_for
    from fedcond.federation.client_dp import with_client_dp
    from fedcond.model.server_optimiser import ServerMomentum
    from tests.test_failures import federation, layer_model, two_by_two

    # FedAvgM and client-level DP together, on the CIFAR network (batch norm): accepted before anything starts.
    settings = {"method": "fedavg", "num-clusters": 2, "clients-per-cluster": 2, "client-dp": "server-side",
                "client-dp-noise-multiplier": 1.0, "client-dp-clipping-norm": 100.0, "server-momentum": 0.5,
                "server-learning-rate": 0.7}  # fmt: skip
    check_run(run_config({**settings, "dataset": "cifar10"}))
    config = run_config(settings)
    method = FedcondFedAvg(StrategyInputs(config, 10, False, None, scenario=scenario_for(config)))
    # FakeNode's two-array model, read as a trained weight and a batch-norm running variance.
    method.array_names, method.current = ["weight", "norm.running_var"], layer_model(0.0)
    method.server_momentum = ServerMomentum(0.5, 0.7, [True, False])
    wrapper = with_client_dp(FedcondStrategy(method), config)
    manager = federation(two_by_two())
    wrapper.initialize_parameters(manager)
    instructions = wrapper.configure_fit(1, ndarrays_to_parameters(layer_model(0.0)), manager)
    results, failures = fit_clients(instructions, None, None, 1)
    np.random.seed(7)  # Flower draws its noise from numpy's global generator
    new = parameters_to_ndarrays(wrapper.aggregate_fit(1, results, failures)[0])
    # The clients return 1, 2, 3 and 4 everywhere (updates far inside the clip): their uniform mean 2.5,
    # then Flower's noise, std 1 x 100 / 4, drawn as it draws it.
    np.random.seed(7)
    noised = [2.5 + np.random.normal(0, 25.0, array.shape).astype(np.float32) for array in layer_model(0.0)]
    # FedAvgM from the model the clients received (0): 0 - 0.7 x (0 - noised mean); the variance is valid.
    np.testing.assert_allclose(new[0], 0.7 * noised[0], rtol=1e-5)
    np.testing.assert_allclose(method.server_momentum.velocity[0], -noised[0], rtol=1e-5)
    np.testing.assert_array_equal(new[1], np.maximum(noised[1], 0))
    assert (noised[1] < 0).any() and (new[1] >= 0).all()
    np.testing.assert_array_equal(method.current[0], new[0])  # the next round steps from the noised model


def test_oracle_under_client_level_dp_noises_each_clusters_mean_apart_then_steps_each_model():
    from flwr.server.server import fit_clients

    from fedcond.federation.client_dp import PerModelClientDp, with_client_dp
    from fedcond.model.server_optimiser import PerModelMomentum
    from tests.test_failures import federation, layer_model, strategy_for, two_by_two

    settings = {"client-dp": "client-side", "client-dp-noise-multiplier": 1.0, "client-dp-clipping-norm": 10.0,
                "server-momentum": 0.5, "server-learning-rate": 0.7}  # fmt: skip
    strategy = strategy_for("oracle", **settings)
    method = strategy.method
    # FakeNode's two-array model, read as a trained weight and a batch-norm running variance.
    method.array_names = lambda: ["weight", "norm.running_var"]  # type: ignore[method-assign]
    method.models = [layer_model(0.0), layer_model(0.0)]
    method.server_momentum = PerModelMomentum(0.5, 0.7, [True, False], 2)
    wrapper = with_client_dp(strategy, strategy.inputs.config)
    assert isinstance(wrapper, PerModelClientDp)
    manager = federation(two_by_two())
    wrapper.initialize_parameters(manager)
    instructions = wrapper.configure_fit(1, EMPTY, manager)
    assert all(ins.config[KEY_CLIPPING_NORM] == 10.0 for _, ins in instructions)  # each client clips
    results, failures = fit_clients(instructions, None, None, 1)
    np.random.seed(7)  # the noise comes from numpy's global generator, as Flower's does
    wrapper.aggregate_fit(1, results, failures)
    # Partitions 0, 1 (cluster 0) return 1 and 2, partitions 2, 3 (cluster 1) 3 and 4: each cluster's
    # unweighted mean (1.5, 3.5), noised with std 1 x 10 / its 2 clients, cluster 0's drawn first.
    np.random.seed(7)
    noised = [[mean + np.random.normal(0, 5.0, array.shape).astype(np.float32) for array in layer_model(0.0)]
              for mean in (1.5, 3.5)]  # fmt: skip
    for model, new in zip(noised, method.models, strict=True):
        # FedAvgM from the model the clients received (0) along the noised mean; the variance is valid.
        np.testing.assert_allclose(new[0], 0.7 * model[0], rtol=1e-5)
        np.testing.assert_array_equal(new[1], np.maximum(model[1], 0))
    assert (noised[0][1] < 0).any() or (noised[1][1] < 0).any()


def test_the_clipping_mod_clips_where_the_server_asks_and_passes_client_errors_on(task_identity):
    sent = [np.zeros(3), np.zeros(2)]
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def instruction(config: dict) -> Message:
        content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(sent), config), keep_input=True)
        return Message(content, dst_node_id=1, message_type=MessageType.TRAIN)

    def client(arrays: list[np.ndarray], metrics: dict):
        def answer(message: Message, _context: Context) -> Message:
            res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 10, metrics)
            return message.create_reply(compat.fitres_to_recorddict(res, keep_input=True))

        return answer

    def returned(reply: Message) -> list[np.ndarray]:
        return parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)

    update = [np.full(3, 3.0), np.full(2, 4.0)]  # norm sqrt(27 + 32)
    clipped = returned(client_dp_clipping_mod(instruction({KEY_CLIPPING_NORM: 1.0}), context, client(update, {})))
    assert np.sqrt(sum(float((array**2).sum()) for array in clipped)) == pytest.approx(1.0)
    untouched = returned(client_dp_clipping_mod(instruction({}), context, client(update, {})))
    assert all(np.array_equal(a, b) for a, b in zip(untouched, update, strict=True))
    failed = client_dp_clipping_mod(instruction({KEY_CLIPPING_NORM: 1.0}), context, client([], {ERROR: "no data"}))
    assert compat.recorddict_to_fitres(failed.content, keep_input=True).metrics[ERROR] == "no data"


def test_the_privacy_plot_reads_each_mechanisms_epsilon_and_lists_the_runs_that_stopped(tmp_path):
    plot = load_script("experiments/privacy_plot.py")
    plain = {"method": "fedavg"}
    dp_sgd = {**plain, "dp-noise-multiplier": 1.2}
    client = {**plain, "client-dp": "client-side", "secure-aggregation": "secaggplus"}
    # The sweep's grid: five points, of which "not-yet" never started (it has no folder).
    bundles = [{"label": "plain", **plain}, {"label": "dp-sgd", **dp_sgd}, {"label": "client", **client},
               {"label": "stopped", **client}, {"label": "not-yet", **plain}]  # fmt: skip
    record_experiment(Experiment({}, {"method": bundles}), tmp_path)

    def write_run(name: str, config: dict[str, object], rows: list[dict[str, object]], **info: object) -> None:
        folder = tmp_path / "runs" / f"method-{name}"
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps({"config": config, **info}))
        with (folder / "history.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["round", "accuracy", "epsilon"])
            writer.writeheader()
            writer.writerows(rows)

    write_run(
        "plain",
        plain,
        [{"round": 1, "accuracy": 0.5, "epsilon": ""}, {"round": 2, "accuracy": 0.6, "epsilon": ""}],
        status="finished",
    )
    write_run("dp-sgd", dp_sgd, [{"round": 2, "accuracy": 0.45, "epsilon": 7.9}], status="finished")
    privacy_info = {"client_level": {"epsilon_by_round": [12.0, 8.0]}}
    write_run("client", client, [{"round": 2, "accuracy": 0.2, "epsilon": ""}], status="finished", privacy=privacy_info)
    write_run(
        "stopped",
        client,
        [{"round": 1, "accuracy": 0.1, "epsilon": ""}],
        status="failed",
        error="loss became nan",
        rounds_completed=1,
    )

    results = {r.run.removeprefix("method-"): r for r in plot.read_results(tmp_path)}
    assert set(results) == {"plain", "dp-sgd", "client"}
    assert math.isinf(results["plain"].epsilon) and results["plain"].accuracy == 0.6
    assert results["dp-sgd"].epsilon == 7.9 and results["dp-sgd"].mechanism == "DP-SGD"
    assert results["client"].epsilon == 8.0 and results["client"].secure
    table = plot.table(list(results.values()))
    assert "| fedavg | DP-SGD | off | 7.9 | 0.4500 | -0.150 | `method-dp-sgd` |" in table
    # SecAgg+ without DP was not run: the change is from the plain run.
    assert "| fedavg | client-level DP (client-side) | on | 8 | 0.2000 | -0.400 | `method-client` |" in table
    assert plot.unfinished_runs(tmp_path) == [
        "- `method-not-yet`: not run", "- `method-stopped` after 1 round: failed: loss became nan",
    ]  # fmt: skip
    plot.figure(list(results.values()), tmp_path / "privacy.png")
    assert (tmp_path / "privacy.png").stat().st_size > 0


# -- client-level DP of the fingerprint statistics' sum ------------------------------------------------
def published_statistics(settings: dict[str, object], results: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The fingerprint mean and std a run's set-up publishes (in process, the secure sum in the clear:
    SecAgg+ gives the same sum), and run.json's client-level record."""
    from collections import Counter

    from fedcond.federation.messages import FINGERPRINT_MEAN, FINGERPRINT_STD, array_from_bytes
    from fedcond.federation.server_app import served_run
    from fedcond.tools.in_process import InProcessNode, plain_sum

    config = run_config({**settings, "results-dir": str(results), "verbose": False, "num-server-rounds": 2})
    with served_run(config, None) as (server, strategy, _):
        inner = getattr(strategy, "strategy", strategy)  # inside Flower's DP wrapper
        inner.secure_rounds.sum = plain_sum
        for partition in range(config.resolved().num_clients):
            server.client_manager().register(InProcessNode(config.resolved(), partition, Counter()))
        strategy.initialize_parameters(server.client_manager())
        shared = dict(inner.shared_config)
    (run_file,) = results.glob("*/run.json")
    info = json.loads(run_file.read_text())
    mean = array_from_bytes(shared[FINGERPRINT_MEAN], FINGERPRINT_MEAN)
    return mean, array_from_bytes(shared[FINGERPRINT_STD], FINGERPRINT_STD), info["privacy"]["client_level"]


def test_client_level_dp_clips_noises_and_accounts_the_fingerprint_statistics_it_publishes(tmp_path):
    settings = {"method": "recommended", "num-clusters": 2, "clients-per-cluster": 2, "data-fraction": 0.2}
    config = run_config(settings).resolved()
    raws = np.array([client_fingerprint(config, load_client_data(config, p)) for p in range(4)], dtype=np.float64)
    exact_mean, _, off = published_statistics(settings, tmp_path / "off")
    np.testing.assert_allclose(exact_mean, raws.mean(axis=0), atol=1e-9)
    assert off is None
    # Refused without the bound: the statistics would be released un-noised.
    with pytest.raises(FedcondError, match="set client-dp-statistics-clipping-norm") as error:
        check_run(run_config({**settings, "client-dp": "client-side"}))
    assert "\n" not in str(error.value)
    dp = {**settings, "client-dp": "client-side", "client-dp-noise-multiplier": 1.0,
          "client-dp-statistics-clipping-norm": 0.5}  # fmt: skip
    np.random.seed(7)  # Flower's generator, which the statistics' noise is drawn from too
    mean, std, record = published_statistics(dp, tmp_path / "dp")
    # Each client's (f, f^2) clipped to 0.5, then the sums noised with std 1 x 0.5, in that order.
    clipped = [statistics_encoding.statistics_vector(raw, 0.5) for raw in raws]
    assert all(np.linalg.norm(vector[:-1]) <= 0.5 + 1e-12 for vector in clipped)
    dim = raws.shape[1]
    np.random.seed(7)
    noise = [np.random.normal(0, 0.5, dim), np.random.normal(0, 0.5, dim)]
    total = np.sum(clipped, axis=0)
    sums = total[:dim] + noise[0], total[dim : 2 * dim] + noise[1]
    # The variance no lower than the noise's std on it (0.5 / 4 clients): below that an estimate is noise,
    # and a z-score by it blows the fingerprint up (here most values' would be 0, then floored at 1e-8).
    expected_mean, expected_std = fp.mean_and_std(*sums, 4, 0.5 / 4)
    np.testing.assert_allclose(mean, expected_mean, atol=1e-9)
    np.testing.assert_allclose(std, expected_std, atol=1e-9)
    assert std.min() == pytest.approx(np.sqrt(0.125)) and (fp.mean_and_std(*sums, 4)[1] < 0.1).mean() > 0.5
    assert not np.allclose(mean, exact_mean, atol=1e-3)
    # Accounted as one more release at rate 1: round r's epsilon is that of r + 1 releases.
    assert record["released_sums"] == 1 and record["noise_std_on_each_released_sum"] == 0.5
    assert record["epsilon_by_round"] == [
        pytest.approx(privacy.gaussian_rounds_epsilon(1.0, rounds + 1, 1e-5), abs=1e-5) for rounds in (1, 2)
    ]

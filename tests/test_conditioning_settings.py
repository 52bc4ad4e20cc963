"""How the conditioned model reads the fingerprint and normalises its features (issue 48's settings):
``condition-scale``, ``hyper-init`` and ``feature-norm`` (FedBN with AdaBN for newcomers, group norm),
and the in-process runner that runs them on a machine without Ray (``--runner in-process``)."""

from collections import Counter

import numpy as np
import pytest
import torch
from fedcond.clients.conditional import ConditionalClient
from flwr.common import Code, EvaluateIns, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.config import RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client import LOCAL_NORM_KEY
from fedcond.federation.client_app import node_data
from fedcond.federation.messages import SERVER_ROUND
from fedcond.federation.methods import run_config
from fedcond.model.feature_norm import local_state, local_state_names, recompute_statistics
from fedcond.model.networks import (
    ConditioningSettings,
    build_model,
    build_run_model,
    count_parameters,
    get_weights,
    set_weights,
)
from fedcond.model.training import evaluate
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import InProcessNode, plain_sum, run_in_process
from tests.test_cifar import write_cifar10_folder

CIFAR = (3, 32, 32)


def test_condition_scale_unit_feeds_the_fingerprint_at_one_over_sqrt_d():
    dim = 16
    plain = build_model((1, 8, 8), 10, dim, seed=0, conditioning="hyper")
    unit = build_model(
        (1, 8, 8), 10, dim, seed=0, conditioning="hyper", conditioning_settings=ConditioningSettings("unit")
    )
    halved = build_model(
        (1, 8, 8), 10, dim, seed=0, conditioning="concat", conditioning_settings=ConditioningSettings("0.5")
    )
    concat = build_model((1, 8, 8), 10, dim, seed=0, conditioning="concat")
    images, condition = torch.rand(4, 1, 8, 8), torch.randn(1, dim)
    torch.testing.assert_close(unit(images, condition), plain(images, condition / 4))
    torch.testing.assert_close(halved(images, condition), concat(images, condition / 2))
    assert not torch.allclose(unit(images, condition), plain(images, condition))


def test_hyper_init_zero_starts_every_client_at_the_shared_head_and_keeps_every_other_weight():
    settings = ConditioningSettings(hyper_init="zero")
    zero = build_model((1, 8, 8), 10, 8, seed=3, conditioning="hyper", conditioning_settings=settings)
    noisy = build_model((1, 8, 8), 10, 8, seed=3, conditioning="hyper")
    images = torch.rand(4, 1, 8, 8)
    torch.testing.assert_close(zero(images, torch.randn(1, 8)), zero(images, torch.randn(1, 8)))
    assert not torch.allclose(noisy(images, torch.ones(1, 8)), noisy(images, -torch.ones(1, 8)))
    for name, tensor in zero.state_dict().items():
        if name != "hyper.weight":
            torch.testing.assert_close(tensor, noisy.state_dict()[name])


def test_group_norm_replaces_batch_norm_with_the_same_parameters():
    batch = build_model(CIFAR, 10, 0, seed=0)
    group = build_model(CIFAR, 10, 0, seed=0, conditioning_settings=ConditioningSettings(feature_norm="group"))
    assert count_parameters(group) == count_parameters(batch)
    assert not any(isinstance(module, torch.nn.BatchNorm2d) for module in group.modules())
    assert sum(isinstance(module, torch.nn.GroupNorm) for module in group.modules()) == 4
    assert len(local_state_names(batch)) == 4 * 5 and not local_state_names(group)  # weight, bias, 3 statistics


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"condition-scale": "big"}, "condition-scale must be none, unit or a positive number"),
        ({"condition-scale": -2}, "condition-scale must be none, unit or a positive number"),
        ({"hyper-init": "ones"}, "unknown hyper-init"),
        ({"feature-norm": "layer"}, "unknown feature-norm"),
        ({"method": "fedavg", "condition-scale": "unit"}, "fedavg's model takes none"),
        ({"hyper-init": "zero"}, "this run conditions by concat"),
        ({"feature-norm": "group"}, "digits's network has none"),
        ({"dataset": "cifar10", "method": "fedavg", "feature-norm": "local-batch"}, "fedavg does not"),
        ({"dataset": "cifar10", "method": "pooled-conditional", "feature-norm": "local-batch"}, "does not"),
    ],
)
def test_the_conditioning_settings_are_checked_in_one_line_before_anything_starts(settings, refusal):
    with pytest.raises(FedcondError, match=refusal):
        check_run(run_config({"method": "conditional", **settings}))


def test_a_numeric_condition_scale_is_kept_as_its_text():
    assert RunConfig.from_mapping({"condition-scale": 12}).condition_scale == "12"
    assert RunConfig.from_mapping({"condition-scale": 0.25}).condition_scale == "0.25"
    check_run(
        run_config({"method": "conditional", "dataset": "cifar10", "feature-norm": "group", "condition-scale": 3})
    )


def test_adabn_recomputes_the_statistics_from_the_images_alone():
    model = build_model(CIFAR, 10, 0, seed=0)
    images = np.random.default_rng(0).random((40, *CIFAR)).astype(np.float32)
    before = {name: array.copy() for name, array in zip(local_state_names(model), local_state(model), strict=True)}
    recompute_statistics(model, images)
    first_conv, first_norm = model.features[0], model.features[1]
    with torch.no_grad():
        activations = first_conv(torch.from_numpy(images))
    torch.testing.assert_close(first_norm.running_mean, activations.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first_norm.running_var, activations.var(dim=(0, 2, 3)), rtol=1e-3, atol=1e-5)
    np.testing.assert_array_equal(first_norm.weight.detach().numpy(), before["features.1.weight"])
    assert first_norm.momentum == 0.1 and not model.training  # restored for training and scored in eval mode


@pytest.fixture
def tiny_cifar(tmp_path):
    write_cifar10_folder(tmp_path / "cifar10-jpeg", per_class=(8, 4))
    return tmp_path


def cifar_config(data_dir, feature_norm: str, **more) -> RunConfig:
    settings = {
        "method": "conditional", "dataset": "cifar10", "data-dir": str(data_dir), "num-clusters": 2,
        "clients-per-cluster": 2, "held-out-clients": 1, "num-server-rounds": 2, "feature-norm": feature_norm,
        "fingerprint": "class-mean", "conditioning": "hyper", "normalisation": "none", "verbose": False,
        "channels-last": "false", **more,
    }  # fmt: skip
    return run_config(settings).resolved()


def garbled(weights: list[np.ndarray], model: torch.nn.Module) -> list[np.ndarray]:
    """``weights`` with every batch-norm entry replaced by nonsense (what a client must not use)."""
    names = list(model.state_dict())
    local = set(local_state_names(model))
    return [
        array * 0 + 50 if name in local and array.dtype.kind == "f" else array
        for name, array in zip(names, weights, strict=True)
    ]


def client_of(node: InProcessNode, config: RunConfig) -> ConditionalClient:
    partition = int(node.context.node_config["partition-id"])
    return ConditionalClient(config, node_data(node.context, config, partition), node.context)


def scored_with(model_weights: list[np.ndarray], config: RunConfig, node: InProcessNode) -> float:
    """The test loss of ``model_weights`` on the node's client, computed here (its fingerprint as fed)."""
    client = client_of(node, config)
    model = build_run_model(config, 10, conditioned=True)
    set_weights(model, model_weights)
    return evaluate(model, client.data.test_x, client.data.test_y, client.condition({SERVER_ROUND: 1})).loss


@pytest.mark.parametrize("feature_norm", ["local-batch", "batch"])
def test_local_batch_norm_keeps_each_clients_own_layers_and_a_newcomer_recomputes_them(tiny_cifar, feature_norm):
    config = cifar_config(tiny_cifar, feature_norm)
    model = build_run_model(config, 10, conditioned=True)
    initial = get_weights(model)
    trainer, newcomer = (
        InProcessNode(config, 0, Counter()),
        InProcessNode(config, config.num_training_clients, Counter()),
    )
    reply = trainer.fit(FitIns(ndarrays_to_parameters(initial), {SERVER_ROUND: 1}), None, None)
    trained = parameters_to_ndarrays(reply.parameters)
    nonsense = garbled(initial, model)
    names = list(model.state_dict())
    own = [array for name, array in zip(names, trained, strict=True) if name in set(local_state_names(model))]
    with_own = [
        own.pop(0) if name in set(local_state_names(model)) else array
        for name, array in zip(names, nonsense, strict=True)
    ]
    loss = trainer.evaluate(EvaluateIns(ndarrays_to_parameters(nonsense), {SERVER_ROUND: 1}), None, None).loss
    if feature_norm == "local-batch":
        assert LOCAL_NORM_KEY in trainer.context.state.array_records
        assert loss == pytest.approx(scored_with(with_own, config, trainer), rel=1e-5)
    else:
        assert LOCAL_NORM_KEY not in trainer.context.state.array_records
        assert loss == pytest.approx(scored_with(nonsense, config, trainer), rel=1e-5)
    # A newcomer has no layers of its own: the served model's statistics come from its own images.
    served = newcomer.evaluate(EvaluateIns(ndarrays_to_parameters(nonsense), {SERVER_ROUND: 1}), None, None).loss
    if feature_norm == "local-batch":
        adapted = build_run_model(config, 10, conditioned=True)
        set_weights(adapted, nonsense)
        recompute_statistics(adapted, client_of(newcomer, config).data.train_x)
        assert served == pytest.approx(scored_with(get_weights(adapted), config, newcomer), rel=1e-5)
    else:
        assert served == pytest.approx(scored_with(nonsense, config, newcomer), rel=1e-5)


class _Proxy:
    def __init__(self, partition_id: int, vector: list[float], weight: int) -> None:
        self.partition_id, self.reply = partition_id, (vector, weight)

    def fit(self, ins, timeout, group_id):
        vector, weight = self.reply
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.array(vector)]), weight, {})


def test_the_in_process_runner_sums_what_secagg_would_in_the_clear():
    outcome = plain_sum([(_Proxy(3, [1.0, 2.0], 1), None), (_Proxy(1, [3.0, 6.0], 3), None)])
    np.testing.assert_allclose(outcome.mean[0], [2.5, 5.0])
    assert outcome.contributors == [1, 3] and not outcome.dropped


def test_the_in_process_runner_runs_a_conditioned_method_with_the_federated_z_score(tmp_path):
    config = run_config({"method": "recommended", "num-clusters": 2, "clients-per-cluster": 2, "num-server-rounds": 2,
                         "condition-scale": "unit", "hyper-init": "zero", "results-dir": str(tmp_path),
                         "verbose": False})  # fmt: skip
    assert config.normalisation == "federated"
    recorder, _ = run_in_process(config)
    rows = read_history(recorder.folder / "history.csv")
    assert [row["round"] for row in rows] == ["1", "2"] and float(rows[-1]["accuracy"]) > 0.3

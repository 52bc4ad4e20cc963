"""FedBN: FedAvg whose clients keep their batch-norm layers; a newcomer recomputes their statistics
on its own unlabelled images (AdaBN). ``clients/fedbn.py``, ``strategies/fedbn.py``."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from flwr.common import EvaluateIns, FitIns, ndarrays_to_parameters, parameters_to_ndarrays

from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client_app import node_data
from fedcond.federation.messages import SERVER_ROUND
from fedcond.federation.methods import run_config
from fedcond.model.feature_norm import local_state_names, recompute_statistics
from fedcond.model.networks import build_run_model, get_weights, set_weights
from fedcond.model.training import evaluate
from fedcond.tools.in_process import InProcessNode
from tests.method_settings import method_test_settings


def config_of(method: str, folder, **settings):
    return run_config({
        "method": method, "num-clusters": 2, "clients-per-cluster": 2, "held-out-clients": 1, "verbose": False,
        **method_test_settings("fedbn", folder), **settings,
    }).resolved()  # fmt: skip


def loss_of(weights, config, node: InProcessNode) -> float:
    """The test loss of ``weights`` on the node's data, computed here."""
    model = build_run_model(config, 10, conditioned=False)
    set_weights(model, weights)
    data = node_data(node.context, config, int(node.context.node_config["partition-id"]))
    return evaluate(model, data.test_x, data.test_y, None).loss


@pytest.mark.parametrize("method", ["fedbn", "fedavg"])
def test_a_fedbn_client_keeps_its_own_batch_norm_layers_where_fedavgs_takes_the_average(tmp_path, method):
    config = config_of(method, tmp_path)
    model = build_run_model(config, 10, conditioned=False)
    local = set(local_state_names(model))
    initial = get_weights(model)
    client = InProcessNode(config, 0, Counter())
    trained = parameters_to_ndarrays(client.fit(FitIns(ndarrays_to_parameters(initial), {SERVER_ROUND: 1}), None,
                                                None).parameters)  # fmt: skip
    # The server's next model: every batch-norm entry nonsense (what a FedBN client must not use).
    names = list(model.state_dict())
    nonsense = [array * 0 + 50 if name in local and array.dtype.kind == "f" else array
                for name, array in zip(names, initial, strict=True)]  # fmt: skip
    own = [mine if name in local else sent for name, mine, sent in zip(names, trained, nonsense, strict=True)]
    loss = client.evaluate(EvaluateIns(ndarrays_to_parameters(nonsense), {SERVER_ROUND: 2}), None, None).loss
    expected = own if method == "fedbn" else nonsense
    assert loss == pytest.approx(loss_of(expected, config, client), rel=1e-5)
    assert loss_of(own, config, client) != pytest.approx(loss_of(nonsense, config, client), rel=1e-3)


def test_a_fedbn_newcomer_recomputes_the_statistics_on_its_own_images(tmp_path):
    config = config_of("fedbn", tmp_path)
    newcomer = InProcessNode(config, config.num_training_clients, Counter())
    served = get_weights(build_run_model(config, 10, conditioned=False, seed=1))
    loss = newcomer.evaluate(EvaluateIns(ndarrays_to_parameters(served), {SERVER_ROUND: 1}), None, None).loss
    adapted = build_run_model(config, 10, conditioned=False)
    set_weights(adapted, served)
    data = node_data(newcomer.context, config, config.num_training_clients)
    recompute_statistics(adapted, data.train_x)
    assert loss == pytest.approx(loss_of(get_weights(adapted), config, newcomer), rel=1e-5)
    assert not np.isclose(loss, loss_of(served, config, newcomer), rtol=1e-3)  # the statistics did change


@pytest.mark.parametrize(
    "settings", [{"dataset": "digits"}, {"feature-norm": "group"}], ids=["no batch norm", "group norm"]
)
def test_fedbn_without_batch_norm_is_refused_in_one_line(tmp_path, settings):
    with pytest.raises(FedcondError, match=r"fedbn keeps each client's batch-norm layers.*or fedavg"):
        check_run(config_of("fedbn", tmp_path, **settings))

"""CFL (fedcond.strategies.cfl): a cluster splits when its mean update is small and some client's is not, into
the halves whose update directions differ most; never before its warm-up, never into halves too small;
a newcomer walks the parameter tree; bad thresholds are refused in one line."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from fedcond.strategies.cfl import bipartition

from fedcond.errors import FedcondError
from fedcond.federation.messages import PARAMETER_TREE
from fedcond.federation.participation import EVALUATE, FIT
from fedcond.model.aggregation import vector_cosine_similarities
from fedcond.model.parameter_tree import MOVED, STAYED, Split, header, pack, unpack, walk
from tests.test_method_rules import constant_model, decoded, reply, strategy_for

# Splits may happen from round 2, whenever the mean update is under 1 and the largest over 2.
EAGER = {"options": (("cfl-warmup-rounds", 1), ("cfl-eps1", 1.0), ("cfl-eps2", 2.0), ("cfl-min-cluster-size", 1))}


def opposite_updates(strategy, sizes: dict[int, float]) -> list[tuple[int, object]]:
    """Replies whose update from the current model is +-size along one direction (partitions 0, 1
    one way, 2, 3 the other: the true clusters of strategy_for's E1 K=2 x 2), of mean near 0."""
    direction = [np.zeros_like(array) for array in constant_model(strategy, 0.0)]
    direction[0].flat[0] = 1.0
    current = {pid: strategy.models[strategy.assignment[pid]] for pid in sizes}
    return [
        (pid, reply([a + d * (size if pid < 2 else -size) for a, d in zip(current[pid], direction, strict=True)], 10))
        for pid, size in sizes.items()
    ]


def test_the_bipartition_keeps_apart_the_clients_whose_updates_disagree():
    rng = np.random.default_rng(0)
    one, other = rng.normal(size=50), rng.normal(size=50)
    updates = np.stack([one + 0.1 * rng.normal(size=50) for _ in range(3)] + [other + 0.1 * rng.normal(size=50)
                                                                             for _ in range(4)])  # fmt: skip
    sides = bipartition(vector_cosine_similarities(updates))
    assert len(set(sides[:3])) == 1 and len(set(sides[3:])) == 1 and sides[0] != sides[3]


def test_a_cluster_at_a_stationary_point_that_suits_none_of_its_clients_splits_along_their_updates():
    strategy = strategy_for("cfl", **EAGER)
    strategy.combine(1, opposite_updates(strategy, dict.fromkeys(range(4), 3.0)))  # round 1: warm-up
    assert len(strategy.models) == 1 and not strategy.splits
    strategy.combine(2, opposite_updates(strategy, dict.fromkeys(range(4), 3.0)))  # mean 0 < 1, largest 3 > 2
    assert len(strategy.models) == 2
    assert strategy.assignment[0] == strategy.assignment[1] != strategy.assignment[2] == strategy.assignment[3]
    (split,) = strategy.splits
    assert split["round"] == 2 and split["max_cross_similarity"] == pytest.approx(-1.0)
    assert strategy.protocol.tracker.ari == 1.0
    # Each half averaged its own clients' models: 3 above the model on one side, 3 below on the other.
    start = float(strategy.models[0][0].flat[0] + strategy.models[1][0].flat[0]) / 2
    firsts = sorted(float(strategy.models[k][0].flat[0]) - start for k in range(2))
    assert firsts == pytest.approx([-3.0, 3.0])


def test_buffers_such_as_batch_norms_step_counter_are_left_out_of_the_updates_it_compares():
    """Every client's reply also moves one buffer array by the same 100 (batch norm's step counter
    grows by a round's steps on every client alike): with it in the update, the mean update is 100
    long and the cluster would never split; CFL compares the trained weights' change alone."""
    strategy = strategy_for("cfl", **EAGER)
    strategy.trained = [False, *strategy.trained[1:]]  # array 0 stands for a buffer here
    counter = [np.zeros_like(array) for array in constant_model(strategy, 0.0)]
    counter[0].flat[0] = 100.0
    direction = [np.zeros_like(array) for array in counter]
    direction[1].flat[0] = 1.0
    model = strategy.models[0]
    replies = [(pid, reply([a + c + d * (3.0 if pid < 2 else -3.0) for a, c, d in zip(model, counter, direction,
                                                                                       strict=True)], 10))
               for pid in range(4)]  # fmt: skip
    strategy.combine(2, replies)
    assert len(strategy.models) == 2, "the buffer's change was counted in the update"
    assert strategy.assignment[0] == strategy.assignment[1] != strategy.assignment[2] == strategy.assignment[3]


@pytest.mark.parametrize(
    ("sizes", "settings", "why"),
    [
        ({0: 1.5, 1: 1.5, 2: 1.5, 3: 1.5}, {}, "no client's update above eps2: the model suits them all"),
        ({0: 3.0, 1: 3.0, 2: 1.0, 3: 1.0}, {}, "the mean update (0.5 x 2 = 1.0) is not below eps1: not stationary"),
        ({0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0}, {"cfl-min-cluster-size": 3}, "halves of 2 are below the minimum size"),
    ],
)
def test_a_cluster_does_not_split_when_a_test_fails(sizes, settings, why):
    options = {**dict(EAGER["options"]), **settings}
    strategy = strategy_for("cfl", options=tuple(options.items()))
    strategy.combine(2, opposite_updates(strategy, sizes))
    assert len(strategy.models) == 1, why


def test_a_newcomer_receives_the_parameter_tree_and_a_participant_its_own_model():
    strategy = strategy_for("cfl", held_out_clients=1, **EAGER)
    before = [array.copy() for array in strategy.models[0]]
    strategy.combine(2, opposite_updates(strategy, dict.fromkeys(range(4), 3.0)))
    per_model = len(constant_model(strategy, 0.0))
    parameters, config = strategy.instruction(EVALUATE, 4, None, {})  # held-out partitions 4, 5
    leaves, (split,) = unpack(decoded(parameters), config[PARAMETER_TREE], per_model)
    assert len(leaves) == 2 and (split.cluster, split.new_cluster) == (0, 1)
    for kept, trained_from in zip(split.model, before, strict=True):  # the model the split clients trained
        np.testing.assert_array_equal(kept, trained_from)
    moved = strategy.assignment[2]  # partitions 2, 3 stepped by -3 along entry 0, partitions 0, 1 by +3
    assert split.directions[moved][0] == pytest.approx(-1.0) and split.directions[1 - moved][0] == pytest.approx(1.0)
    parameters, config = strategy.instruction(EVALUATE, 0, None, {})
    assert PARAMETER_TREE not in config and len(parameters.tensors) == per_model
    assert len(strategy.instruction(FIT, 2, None, {})[0].tensors) == per_model


def test_a_newcomer_walks_down_the_tree_along_the_sides_its_updates_agree_with():
    """Cluster 0 split into 0 and 1, then cluster 1 into 1 and 2: an update along cluster 2's clients'
    at each split's model reaches cluster 2 after two trainings; a split of a cluster it left is skipped."""
    e = np.eye(3, dtype=np.float32)
    model = [np.zeros(3, np.float32)]
    splits = [Split(0, 1, model, (e[0], e[1])), Split(0, 3, model, (e[0], e[2])), Split(1, 2, model, (e[1], e[2]))]
    trained = []

    def update_at(at):
        trained.append(at)
        return np.array([0.1, 0.5, 0.6]) if len(trained) == 2 else np.array([0.2, 0.9, 0.0])

    assert walk(splits, update_at) == (2, [MOVED, MOVED])
    assert len(trained) == 2  # split 1 (of cluster 0, after the newcomer left it) was not visited
    assert walk(splits, lambda at: np.array([1.0, 0.0, 0.0])) == (0, [STAYED, STAYED])
    arrays = pack([model, model, model, model], splits)
    leaves, back = unpack(arrays, header(4, splits), per_model=1)
    assert len(leaves) == 4 and [(s.cluster, s.new_cluster) for s in back] == [(0, 1), (0, 3), (1, 2)]
    with pytest.raises(FedcondError, match="holds 13 arrays where its tree needs 10"):
        unpack(arrays, header(1, splits), per_model=1)


def test_a_resumed_run_gets_its_tree_back_and_a_checkpoint_without_one_is_refused():
    strategy = strategy_for("cfl", held_out_clients=1, **EAGER)
    strategy.combine(2, opposite_updates(strategy, dict.fromkeys(range(4), 3.0)))
    models, values = strategy.state()
    resumed = strategy_for("cfl", held_out_clients=1, **EAGER)
    resumed.load_state(models, values)
    np.testing.assert_array_equal(resumed.tree[0].directions[1], strategy.tree[0].directions[1])
    assert resumed.tree[0].new_cluster == 1 and len(resumed.models) == 2
    del models["cfl-tree-0"]
    with pytest.raises(FedcondError, match=r"delete the run's checkpoint\.pt"):
        strategy_for("cfl", held_out_clients=1, **EAGER).load_state(models, values)


def test_a_threshold_that_could_never_split_is_refused_in_one_line():
    from fedcond.federation.checks import check_run
    from fedcond.federation.methods import run_config

    with pytest.raises(FedcondError, match="cfl-eps1=0: no mean update is shorter than 0") as error:
        check_run(run_config({"method": "cfl", "cfl-eps1": 0}), load_data=False)
    assert "\n" not in str(error.value)
    with pytest.raises(FedcondError, match="cfl-eps1 must be at least 0"):
        run_config({"method": "cfl", "cfl-eps1": -1})
    with pytest.raises(FedcondError, match="which a sum hides"):
        check_run(run_config({"method": "cfl", "secure-aggregation": "secaggplus"}), load_data=False)


def test_on_digits_it_finds_the_true_clusters_and_serves_its_newcomers_from_them(tmp_path):
    """Digits E1 K=2 x 3 clients and a newcomer each: thresholds that let the cluster split once the
    warm-up is over (eps1 above any mean update, eps2 below the largest: its norms are in run.json),
    so the test is of the split itself. It recovers the two clusters (ARI 1), a cluster of 3 cannot
    split into halves of 2, and the newcomers score about as the participants do."""
    from fedcond.federation.methods import run_config
    from fedcond.tools.flwr_commands import default_config
    from fedcond.tools.in_process import run_in_process

    config = run_config({
        **default_config(), "method": "cfl", "num-clusters": 2, "clients-per-cluster": 3, "held-out-clients": 1,
        "num-server-rounds": 4, "cfl-warmup-rounds": 2, "cfl-eps1": 10.0, "cfl-eps2": 0.5,
        "results-dir": str(tmp_path), "verbose": False,
    })  # fmt: skip
    recorder, _ = run_in_process(config)
    info = json.loads((recorder.folder / "run.json").read_text())
    with (recorder.folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [split["round"] for split in info.get("cfl-splits", [])] == [3], info["cfl-norms"]
    assert float(rows[-1]["ari"]) == 1.0 and float(rows[0]["ari"]) == 0.0  # one cluster before the split
    assert float(rows[-1]["heldout_accuracy"]) > 0.7 and float(rows[-1]["accuracy"]) > 0.7

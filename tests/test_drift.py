"""Drifting clients (fedcond.data.drift): who moves, to whose data, from which round, and what each method
does about it; bad drift settings are refused in one line before anything starts."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from fedcond.data.drift import drift_partners
from fedcond.data.scenarios import drift_partners_of
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.client import data_in_round
from fedcond.federation.messages import SERVER_ROUND
from fedcond.federation.methods import run_config
from fedcond.model.networks import get_weights
from tests.test_method_rules import client_of, strategy_for

DRIFT = {"num_clusters": 2, "clients_per_cluster": 2, "num_server_rounds": 6, "drift_fraction": 0.5,
         "drift_round": 4}  # fmt: skip


def test_a_seeded_fraction_of_clients_moves_to_the_same_index_of_the_next_cluster():
    clusters = (0, 0, 0, 1, 1, 1, 2, 2, 2)
    partners = drift_partners(0, 1 / 3, clusters, 3)
    assert len(partners) == 3 and partners == drift_partners(0, 1 / 3, clusters, 3)  # seeded
    for pid, partner in partners.items():
        assert clusters[partner] == (clusters[pid] + 1) % 3 and partner % 3 == pid % 3
    assert drift_partners(0, 0.0, clusters, 3) == {} and len(drift_partners(0, 1.0, clusters, 3)) == 9


def test_a_drifting_client_holds_its_partners_data_from_the_drift_round_under_its_own_id():
    from fedcond.config import RunConfig

    (mover, partner), *_ = drift_partners_of(RunConfig(method="fedavg", **DRIFT)).items()
    client, partner_client = client_of("fedavg", mover, **DRIFT), client_of("fedavg", partner, **DRIFT)
    weights = get_weights(client.fresh_model())
    for server_round, holds in ((3, client.own_data), (4, partner_client.own_data), (6, partner_client.own_data)):
        client.evaluate(weights, {SERVER_ROUND: server_round})
        assert np.array_equal(client.data.train_y, holds.train_y) and client.data.partition_id == mover


@pytest.mark.parametrize(("rule", "changes"), [("recompute", True), ("stale", False)])
def test_a_drifted_conditional_client_recomputes_or_keeps_its_fingerprint(rule, changes):
    from fedcond.config import RunConfig

    settings = {**DRIFT, "normalisation": "log", "drift_fingerprint": rule}
    (mover, _), *_ = drift_partners_of(RunConfig(method="conditional", **settings)).items()
    client = client_of("conditional", mover, **settings)
    conditions = []
    for server_round in (3, 4):
        client.data = data_in_round(client.run_config, client.own_data, {SERVER_ROUND: server_round})
        conditions.append(client.condition({SERVER_ROUND: server_round}))
    assert (not np.allclose(conditions[0], conditions[1])) is changes


def test_oracle_is_told_and_serves_a_drifted_client_its_new_clusters_model():
    strategy = strategy_for("oracle", **DRIFT)
    partners = drift_partners_of(strategy.inputs.config)
    clusters = strategy.inputs.true_clusters
    before, after = strategy.true_clusters_at(3), strategy.true_clusters_at(4)
    for pid in range(4):
        expected = clusters[partners[pid]] if pid in partners else clusters[pid]
        assert before[pid] == clusters[pid] and after[pid] == expected


def test_ifcas_ari_after_the_drift_is_against_the_clusters_the_clients_now_hold():
    """A drifted client choosing its new cluster's model recovers the clusters: ARI 1, not a mistake."""
    from fedcond.federation.messages import CHOICE
    from tests.test_method_rules import constant_model, reply

    strategy = strategy_for("ifca", **DRIFT)
    model = constant_model(strategy, 0.0)
    for server_round in (3, 4):  # before the drift and at it: each client picks the cluster it holds
        truth = strategy.true_clusters_at(server_round)
        strategy.groups(server_round, [(pid, reply(model, 10, **{CHOICE: truth[pid]})) for pid in range(4)])
        assert strategy.protocol.tracker.ari == 1.0, server_round
    assert truth != strategy.true_clusters_at(3)  # someone moved


def test_a_drift_run_records_the_drifted_clients_accuracy_with_two_messages_a_round(tmp_path):
    from fedcond.tools.in_process import run_in_process
    from tests.test_one_message import config_for

    settings = {"drift-fraction": 0.5, "drift-round": 2, "num-server-rounds": 3}
    recorder, messages = run_in_process(config_for("ifca", tmp_path, True, **settings))
    assert messages["fit"] == messages["evaluate"] == 4 * 3  # evaluate-in-fit off: each round's own data
    with (recorder.folder / "history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert all(math.isfinite(float(row["drifted_accuracy"])) for row in rows)
    plain, _ = run_in_process(config_for("ifca", tmp_path / "plain", True))
    with (plain.folder / "history.csv").open() as handle:
        assert all(math.isnan(float(row["drifted_accuracy"])) for row in csv.DictReader(handle))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"drift-fraction": 0.2, "drift-round": 11}, r"drift-round=11 is past the last round \(10\)"),
        ({"drift-fraction": 1.5, "drift-round": 3}, r"drift-fraction must be in \[0, 1\]"),
        ({"drift-fraction": 0.2}, "drift-fraction and drift-round go together"),
        ({"drift-round": 3}, "drift-fraction and drift-round go together"),
        ({"drift-fraction": 0.2, "drift-round": 3, "drift-fingerprint": "never"}, "unknown drift-fingerprint"),
        ({"drift-fraction": 0.2, "drift-round": 3, "num-clusters": 1}, "it needs 2 clusters or more"),
        ({"drift-fraction": 0.2, "drift-round": 3, "method": "pooled-conditional"},
         "pooled-conditional trains centrally on pooled data that never changes"),
    ],
)  # fmt: skip
def test_bad_drift_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(FedcondError, match=message):
        check_run(run_config(settings))


def test_an_oracle_told_of_the_drift_serves_the_drifted_clients_as_well_as_the_others(tmp_path):
    """Label shift: a drifted client holds the other cluster's classes; served its old cluster's model
    it would score about nothing on them."""
    from fedcond.tools.in_process import run_in_process
    from tests.test_one_message import config_for

    settings = {"drift-fraction": 0.5, "drift-round": 2, "num-server-rounds": 4, "local-epochs": 5}
    recorder, _ = run_in_process(config_for("oracle", tmp_path, True, **settings))
    with (recorder.folder / "history.csv").open() as handle:
        after = [float(row["drifted_accuracy"]) for row in csv.DictReader(handle)][1:]  # rounds 2-4
    assert min(after) > 0.8  # told: 0.90, 0.93, 0.99 here; untold, it fell to 0.0 in round 3


def drift_rows(curves: dict[str, list[float]]) -> list[dict[str, str]]:
    """Tidy rows of one seed per method whose drifting clients score ``curves`` round by round."""
    return [
        {"method": method, "seed": "0", "round": str(r), "accuracy": str(value), "elapsed_seconds": "1",
         "bytes_down": "0", "bytes_up": "0", "drifted_accuracy": str(value)}
        for method, curve in curves.items()
        for r, value in enumerate(curve, start=1)
    ]  # fmt: skip


def test_the_report_counts_the_rounds_each_method_needs_to_serve_its_drifting_clients_again(tmp_path):
    from fedcond.tools.report import drift_plot, drift_recoveries, drift_table

    curves = {
        "told": [0.5, 0.9, 0.88, 0.9, 0.93],  # round 3: 0.88, within 5 points of 0.9 at once
        "stale": [0.5, 0.9, 0.4, 0.7, 0.86],  # back within 5 points in round 5: 2 rounds
        "lost": [0.5, 0.9, 0.1, 0.2, 0.3],
    }
    recoveries = {r.method: r for r in drift_recoveries(drift_rows(curves), drift_round=3)}
    assert {name: r.rounds_to_recover for name, r in recoveries.items()} == {"told": 0, "stale": 2, "lost": None}
    assert (recoveries["stale"].before, recoveries["stale"].at_drift, recoveries["stale"].final) == (0.9, 0.4, 0.86)
    table = "\n".join(drift_table(list(recoveries.values()), 3))
    assert (
        "| stale | 0.900 | 0.400 | 0.860 | 2 |" in table
        and "| lost | 0.900 | 0.100 | 0.300 | not by the last round |" in table
    )
    assert drift_recoveries(drift_rows(curves), drift_round=1) == []  # no round before the drift
    assert drift_plot(drift_rows(curves), tmp_path / "drift.png", "t", 3).stat().st_size > 0

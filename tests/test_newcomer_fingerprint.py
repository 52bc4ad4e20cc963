"""``newcomer-fingerprint = other-concept``: the ablation that can fail. Each newcomer is fed a training
client's fingerprint from another concept; a model that reads the fingerprint loses its newcomers, one that
ignores it scores them as before, and the training clients never see the difference."""

from __future__ import annotations

import pytest

from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.methods import run_config
from fedcond.newcomers import mismatched_participant, other_concept_cluster
from fedcond.tools.experiment import read_history
from fedcond.tools.in_process import run_in_process


def test_the_other_concept_is_the_other_groups_cluster_of_the_same_subclasses():
    # combined at C = 2: clusters 0, 1 are concept group A's, 2, 3 group B's, group-major.
    assert [other_concept_cluster(c, 4, "combined", 2) for c in range(4)] == [2, 3, 0, 1]
    assert [other_concept_cluster(c, 3, "label-shift", 2) for c in range(3)] == [1, 2, 0]
    assert mismatched_participant((0, 0, 1, 1, 0, 1), 4, 4, 1) == 2


def test_it_is_refused_without_newcomers_in_one_line():
    with pytest.raises(FedcondError, match="set held-out-clients=1") as error:
        check_run(run_config({"method": "recommended", "newcomer-fingerprint": "other-concept"}))
    assert "\n" not in str(error.value)
    with pytest.raises(FedcondError, match="must be one of own, other-concept"):
        check_run(run_config({"method": "recommended", "newcomer-fingerprint": "nearest", "held-out-clients": 1}))


def test_a_model_that_reads_the_fingerprint_loses_its_newcomers_and_its_training_clients_see_nothing(tmp_path):
    rows = {}
    for choice in ("own", "other-concept"):
        config = run_config({
            "method": "recommended", "num-clusters": 2, "clients-per-cluster": 3, "held-out-clients": 1,
            "num-server-rounds": 4, "newcomer-fingerprint": choice, "verbose": False,
            "results-dir": str(tmp_path), "run-name": choice,
        })  # fmt: skip
        recorder, _ = run_in_process(config)
        rows[choice] = read_history(recorder.folder / "history.csv")
    own, other = rows["own"][-1], rows["other-concept"][-1]
    assert [row["accuracy"] for row in rows["own"]] == [row["accuracy"] for row in rows["other-concept"]]
    # Label shift: the other cluster's fingerprint asks for the other half of the classes.
    assert float(other["heldout_accuracy"]) < float(own["heldout_accuracy"]) - 0.3

"""The fingerprint statistics' secure sum: its exact encoding, its range checks, and the sum itself
through Flower's SecAgg+ (workflow and ClientApp in one process, tests/secagg_harness.py)."""

import numpy as np
import pytest
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy

from fedcond.data.client_data import client_fingerprint, load_client_data
from fedcond.errors import FedcondError
from fedcond.federation.checks import check_run
from fedcond.federation.membership import PartitionProxy
from fedcond.federation.messages import SERVER_ROUND, STEP, STEP_STATISTICS
from fedcond.federation.methods import run_config
from fedcond.federation.participation import STATISTICS, RoundParticipation
from fedcond.federation.secagg_workflow import run_secure_sum, workflow_for
from fedcond.fingerprint import fingerprints as fp
from fedcond.fingerprint import statistics_encoding
from tests.secagg_harness import FIRST_NODE_ID, InProcessGrid


def test_digits_carry_any_value_in_range_exactly_through_secaggplus_quantisation():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(size=50) * 10.0 ** rng.integers(-6, 9, size=50), [0.0, 1.0, -(2.0**32)]])
    digits = statistics_encoding.encode(values)
    assert digits.shape == (statistics_encoding.LIMBS, len(values))
    assert np.all(digits == np.round(digits)) and np.all(np.abs(digits) <= 2**21)
    # What SecAgg+ does to one client's digits, and back: every integer level is kept exactly.
    (levels,) = quantize([digits], statistics_encoding.CLIPPING_RANGE, statistics_encoding.QUANTIZATION_RANGE)
    (restored,) = dequantize([levels], statistics_encoding.CLIPPING_RANGE, statistics_encoding.QUANTIZATION_RANGE)
    np.testing.assert_array_equal(restored, digits)
    # Three clients' sum, decoded from the mean SecAgg+ returns: within 2^-30 of each value's sum.
    total = statistics_encoding.decode((digits + digits + digits) / 3, 3)
    assert np.all(np.abs(total - 3 * values) <= 1.5 * 2.0**-30 + 1e-15 * np.abs(values))


def test_values_outside_the_range_and_corrupt_sums_are_refused():
    with pytest.raises(FedcondError, match="outside the secure sum's range"):
        statistics_encoding.encode(np.array([1.0, 2.0**33]))
    with pytest.raises(FedcondError, match="outside the secure sum's range"):
        statistics_encoding.encode(np.array([np.nan]))
    digits = statistics_encoding.encode(statistics_encoding.statistics_vector(np.array([0.5, 2.0])))
    total, squares = statistics_encoding.open_statistics(digits, 1)
    np.testing.assert_array_equal(total, [0.5, 2.0])
    np.testing.assert_array_equal(squares, [0.25, 4.0])
    with pytest.raises(FedcondError, match="decoded a count of 1 from 2 clients"):
        statistics_encoding.open_statistics(digits / 2, 2)  # one client's digits presented as two clients' mean
    with pytest.raises(FedcondError, match="holds up to 511 clients"):
        statistics_encoding.check_clients(512)


def test_a_federation_too_large_for_the_statistics_sum_is_refused_before_anything_starts():
    with pytest.raises(FedcondError, match="holds up to 511 clients"):
        check_run(run_config({"num-clusters": 8, "clients-per-cluster": 64}))
    check_run(run_config({"num-clusters": 8, "clients-per-cluster": 64, "normalisation": "log"}))


def statistics_round(grid: InProcessGrid, partitions: list[int]):
    participation = RoundParticipation(0, partitions)
    instructions = [
        (
            PartitionProxy(GridClientProxy(FIRST_NODE_ID + p, grid, 1), p, participation, STATISTICS),
            FitIns(ndarrays_to_parameters([]), {STEP: STEP_STATISTICS, SERVER_ROUND: 0}),
        )
        for p in partitions
    ]
    workflow = workflow_for(
        1.0, 0.67, statistics_encoding.CLIPPING_RANGE, statistics_encoding.QUANTIZATION_RANGE, 1.0, None
    )
    return run_secure_sum(grid, instructions, workflow, 0, SimpleClientManager())


def test_the_statistics_through_secaggplus_are_the_exact_sums_and_survive_a_dropout():
    config = run_config({"num-clusters": 3, "clients-per-cluster": 2}).resolved()
    raws = [client_fingerprint(config, load_client_data(config, p)) for p in range(6)]

    outcome = statistics_round(InProcessGrid(config), list(range(6)))
    assert outcome.contributors == list(range(6)) and not outcome.dropped and outcome.bytes_up > 0
    total, squares = statistics_encoding.open_statistics(outcome.mean[0], 6)
    np.testing.assert_allclose(total, np.sum(raws, axis=0), rtol=0, atol=1e-8)
    np.testing.assert_allclose(squares, np.sum(np.square(raws), axis=0), rtol=0, atol=1e-8)
    mean, std = fp.mean_and_std(total, squares, 6)
    np.testing.assert_allclose(mean, np.mean(raws, axis=0), atol=1e-9)
    np.testing.assert_allclose(std, np.std(raws, axis=0), atol=1e-6)

    # Dropouts before their keys are shared (Flower's workflow alone could not finish then: see
    # fedcond.federation.secagg_workflow.SecAggPlus): left out, and the sum goes on without them.
    def early_dropouts(message, partition):
        stage = message.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE)
        if (partition, stage) in ((2, Stage.SETUP), (3, Stage.SHARE_KEYS)):
            raise RuntimeError("gone")

    outcome = statistics_round(InProcessGrid(config, fault=early_dropouts), list(range(6)))
    assert outcome.contributors == [0, 1, 4, 5]
    assert outcome.dropped == {
        2: ("failed", "RuntimeError: gone (SecAgg+ setup stage)"),
        3: ("failed", "RuntimeError: gone (SecAgg+ share_keys stage)"),
    }
    total, _ = statistics_encoding.open_statistics(outcome.mean[0], 4)
    np.testing.assert_allclose(total, np.sum([raws[p] for p in (0, 1, 4, 5)], axis=0), rtol=0, atol=1e-8)

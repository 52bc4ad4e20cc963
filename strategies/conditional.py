"""The paper's method on the server: FedAvg of the conditioned model, after the fingerprint statistics.

Its one step of its own comes before round 1: with ``normalisation = "federated"`` the server sums
every training client's (f, f^2, 1) through Flower's SecAgg+ and sends every client the mean and
standard deviation that result (``clients/conditional.py`` computes and normalises its own
fingerprint with them). Rounds are FedAvg's (``strategies/fedavg.py``).
"""

from __future__ import annotations

from flwr.common import FitIns
from flwr.server.client_manager import ClientManager

from fedcond import fingerprint as fp
from fedcond import statistics_encoding as statistics
from fedcond.errors import FedcondError
from fedcond.messages import FINGERPRINT_MEAN, FINGERPRINT_STD, SERVER_ROUND, STEP, STEP_STATISTICS, array_to_bytes
from fedcond.models import run_fingerprint_size
from fedcond.participation import STATISTICS, RoundParticipation
from strategies.base import EMPTY
from strategies.declaration import Declaration, Facts
from strategies.fedavg import FedcondFedAvg
from strategies.membership import PartitionProxy


class ConditionalFedAvg(FedcondFedAvg):
    """FedAvg of the model every client feeds its own fingerprint, after the statistics' secure sum.

    A held-out client evaluates the global model fed its own fingerprint; it is not in the sum (it
    stands for a client that joins later) and receives the published statistics.
    """

    def set_up(self, client_manager: ClientManager) -> None:
        if self.inputs.config.normalisation == "federated":
            self.publish_fingerprint_statistics(client_manager)

    def publish_fingerprint_statistics(self, client_manager: ClientManager) -> None:
        """The federation's fingerprint mean and std from SecAgg+'s sum of every training client's
        (f, f^2, 1) (exact digits: fedcond.statistics_encoding), into every later instruction. A client that
        drops out is left out of the statistics; fewer than ``secagg-min-clients`` stop the run."""
        config = self.inputs.config
        num_classes = self.inputs.num_classes
        dim = run_fingerprint_size(config, num_classes)
        participation = RoundParticipation(0, self.training_partitions)
        question = {STEP: STEP_STATISTICS, SERVER_ROUND: 0}
        instructions = [
            (PartitionProxy(self.membership.node_of[partition], partition, participation, STATISTICS),
             FitIns(EMPTY, dict(question)))
            for partition in self.training_partitions
        ]  # fmt: skip
        outcome = self.secure_sum(
            instructions, 0, client_manager, "the fingerprint statistics' secure sum",
            (statistics.CLIPPING_RANGE, statistics.QUANTIZATION_RANGE), max_weight=1.0,
        )  # fmt: skip
        self.secure_sum_bytes = outcome.bytes_down + outcome.bytes_up
        outcome.record_failures(participation, STATISTICS)
        failures = list(participation.failures)
        self.report_failures(failures)
        self.check_secure_outcome(outcome, "the fingerprint statistics", failures)
        count = len(outcome.contributors)
        total, total_of_squares = statistics.open_statistics(outcome.mean[0], count)  # type: ignore[index]
        if len(total) != dim:
            raise FedcondError(f"the secure sum gave {len(total)} statistics, expected {dim}; fingerprint-dim differs")
        mean, std = fp.mean_and_std(total, total_of_squares, count)
        self.shared_config = {FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}


#: This method's one declaration: the method table finds it by this module's name.
METHOD = Declaration(
    "one global CNN fed each client's fingerprint",
    ConditionalFedAvg,
    Facts(
        "same, model fed its fingerprint", "FedAvg", "global model + own fingerprint",
        "as FedAvg, plus a one-off SecAgg+ sum of fingerprint statistics",
        "the global model, fed the newcomer's own fingerprint (normalised by the published statistics, which it "
        "never entered); with `feature-norm=local-batch`, its batch-norm statistics recomputed first on its own "
        "unlabelled training images (AdaBN)",
        "`FedcondClient.newcomer_model`, with `ConditionalClient.condition`", "global with its fingerprint",
        "recompute the fingerprint on the new data (`drift-fingerprint = \"recompute\"`, the default), or keep the "
        "`stale` one; normalised by the statistics published before round 1",
        server_state=True,
    ),
)  # fmt: skip

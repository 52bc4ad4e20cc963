"""The adversary's tests: what an honest-but-curious server can read from what it receives.

(a) The fingerprint reconstruction attack (fedcond.privacy.attack) on the messages a server gets: one plain
fit reply gives it the client's fingerprint; under SecAgg+ every masked reply, and the unmasked mean
of a federation, give it nothing close to any client's. SecAgg+ runs for real here: Flower's
workflow and fedcond's ClientApp, mods included, in one process (tests/secagg_harness.py).

(b) An allow-list over every key of every message every method sends, in simulation: a new key, or
one where it does not belong (a cluster, a partition id beyond the identity answer, a metric next to
a masked vector), fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message
from flwr.common import FitIns, MessageType, bytes_to_ndarray, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from fedcond.config import RunConfig
from fedcond.data.client_data import client_fingerprint, load_client_data
from fedcond.federation.messages import FINGERPRINT_MEAN, FINGERPRINT_STD, SERVER_ROUND, array_to_bytes
from fedcond.federation.methods import run_config
from fedcond.fingerprint import fingerprints as fp
from fedcond.model.conditioning import MECHANISMS, conditions
from fedcond.model.networks import build_run_model, get_weights
from fedcond.privacy.attack import cosine_similarity, reconstruct_condition
from tests.secagg_harness import FIRST_NODE_ID, InProcessGrid, secure_round

# 3 clusters x 2 clients on digits, one local epoch. Fingerprints of 64 values: a random direction has
# |cosine| >= 0.5 with a given vector with probability 2.2e-5 there (3.0e-3 at the default 32), so the
# 18 checks on masked vectors below fail by chance about once in 2,500 runs (not once in 18).
FEDERATION = {"num-clusters": 3, "clients-per-cluster": 2, "local-epochs": 1, "fingerprint-dim": 64}


def server_view(config: RunConfig) -> tuple[list[np.ndarray], dict[str, object], list[np.ndarray]]:
    """(the global model sent, the round's instruction config, every client's z-scored fingerprint)."""
    raws = np.array([client_fingerprint(config, load_client_data(config, p)) for p in range(config.num_clients)])
    mean, std = raws.mean(axis=0), raws.std(axis=0)  # what the statistics' secure sum publishes
    sent = get_weights(build_run_model(config, 10, conditioned=True))
    round_config = {SERVER_ROUND: 1, FINGERPRINT_MEAN: array_to_bytes(mean), FINGERPRINT_STD: array_to_bytes(std)}
    return sent, round_config, [fp.standardise(raw, mean, std) for raw in raws]


def masked_vectors(grid: InProcessGrid) -> list[list[np.ndarray]]:
    """The masked vectors the server received at SecAgg+'s collect stage (the weight factor dropped),
    decoded as signed integers: the masks make every entry uniform modulo 2^32, so any decoding is
    noise; this one at least centres it on 0 (an uncentred one correlates with every vector whose
    entries share a sign, which is no recovery)."""
    decoded = []
    for reply in grid.replies:
        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, {}) if reply.has_content() else {}
        if Key.MASKED_PARAMETERS not in configs:
            continue
        _, *arrays = [bytes_to_ndarray(b) for b in configs[Key.MASKED_PARAMETERS]]  # type: ignore[union-attr]
        decoded.append([np.where(array >= 2**31, array - 2**32, array).astype(np.float64) for array in arrays])
    return decoded


@pytest.mark.slow
@pytest.mark.parametrize("conditioning", [name for name in MECHANISMS if conditions(name, "cnn")])  # digits: a CNN
def test_the_attack_reads_one_plain_update_and_nothing_secaggplus_shows_the_server(conditioning):
    plain = run_config({**FEDERATION, "conditioning": conditioning}).resolved()
    sent, round_config, fingerprints = server_view(plain)
    template = build_run_model(plain, 10, conditioned=True)

    # Without secure aggregation: client 0's fit reply, as the server receives it.
    grid = InProcessGrid(plain)
    instruction = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(sent), round_config), keep_input=True)
    (reply,) = grid.send_and_receive([Message(instruction, FIRST_NODE_ID, MessageType.TRAIN)])
    returned = parameters_to_ndarrays(compat.recorddict_to_fitres(reply.content, keep_input=True).parameters)
    assert cosine_similarity(reconstruct_condition(template, sent, returned), fingerprints[0]) > 0.99

    # With SecAgg+: every client's masked vector, and the mean the protocol opens.
    secure = run_config({**FEDERATION, "conditioning": conditioning, "secure-aggregation": "secaggplus"}).resolved()
    grid = InProcessGrid(secure)
    outcome = secure_round(grid, secure, range(secure.num_clients), sent, round_config)
    assert outcome.mean is not None and outcome.contributors == list(range(6)) and not outcome.dropped
    masked = masked_vectors(grid)
    assert len(masked) == 6
    for client, vector in enumerate(masked):
        guess = reconstruct_condition(template, sent, vector[:-1])  # the last array is the training loss
        assert abs(cosine_similarity(guess, fingerprints[client])) < 0.5
    # The mean, which SecAgg+ reveals by design and every client receives as the next global model:
    # a mixture of the six fingerprints, not any one of them. It leans towards one cluster's (cosine
    # 0.85 to 0.88 with a member here, 0.69 to 0.73 at fingerprint-dim 32): clients of a cluster share
    # nearly one fingerprint. Only client-level DP's noise protects what the mean says (docs/privacy.md).
    guess = reconstruct_condition(template, sent, outcome.mean[:-1])
    assert max(abs(cosine_similarity(guess, one)) for one in fingerprints) < 0.95


@pytest.mark.slow
def test_the_secure_mean_is_fedavgs_within_quantisation_and_survives_a_dropout():
    config = run_config({**FEDERATION, "conditioning": "concat", "secure-aggregation": "secaggplus"}).resolved()
    sent, round_config, _ = server_view(config)

    def returned(partition: int) -> tuple[list[np.ndarray], int]:
        grid = InProcessGrid(run_config({**FEDERATION}).resolved())
        content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(sent), round_config), keep_input=True)
        (reply,) = grid.send_and_receive([Message(content, FIRST_NODE_ID + partition, MessageType.TRAIN)])
        fitres = compat.recorddict_to_fitres(reply.content, keep_input=True)
        return parameters_to_ndarrays(fitres.parameters), fitres.num_examples

    def unmask_fails(message: Message, partition: int) -> None:
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if partition == 4 and configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS:
            raise RuntimeError("node 4 went away")

    grid = InProcessGrid(config, fault=unmask_fails)
    outcome = secure_round(grid, config, range(6), sent, round_config)
    assert outcome.contributors == [0, 1, 2, 3, 5]
    assert outcome.dropped == {4: ("failed", "RuntimeError: node 4 went away (SecAgg+ collect_masked_vectors stage)")}
    plain = [returned(partition) for partition in outcome.contributors]
    weights = np.array([count for _, count in plain], dtype=np.float64)
    for index, array in enumerate(outcome.mean[:-1]):  # type: ignore[index]
        expected = sum(w * model[index] for w, (model, _) in zip(weights, plain, strict=True)) / weights.sum()
        # Stochastic rounding to 16 / 2^22 per client, and the weights to 1 / 2^22 of the largest.
        np.testing.assert_allclose(array, expected, atol=2e-5)


# -- (b) every key of every message --------------------------------------------------------------------
def status(record: str) -> set[str]:
    return {f"config:{record}.status:code", f"config:{record}.status:message"}


INSTRUCTION_CONFIG = {"server-round", "fingerprint-mean", "fingerprint-std", "clipping_norm"}
SECAGG = "config:secaggplus_configs"
ALLOWED: dict[tuple[str, str], set[str]] = {
    # Before round 1, the one identity answer: the node's operator-configured name.
    ("get_properties", "instruction"): {"config:getpropertiesins.config:fedcond-step"},
    ("get_properties", "reply"): {"config:getpropertiesres.properties:partition-id", *status("getpropertiesres")},
    # A plain round: the model and the round's settings down; the model, the loss, IFCA's choice and
    # the DP accounting up (the sample count is FedAvg's weight).
    # With evaluate-in-fit the instruction also asks to evaluate the model it brings (IFCA: which of
    # its K), and the reply carries that evaluation on the client's test set, as an evaluate reply would.
    ("train", "instruction"): {
        "array:fitins.parameters",
        *(f"config:fitins.config:{k}" for k in (*INSTRUCTION_CONFIG, "evaluate-first", "evaluate-choice")),
    },
    ("train", "reply"): {
        "array:fitres.parameters", "metric:fitres.num_examples:num_examples", *status("fitres"),
        *(f"config:fitres.metrics:{key}" for key in ("train-loss", "choice", "epsilon", "evaluated-loss",
                                                     "evaluated-accuracy", "evaluated-examples")),
    },
    ("evaluate", "instruction"): {
        "array:evaluateins.parameters", *(f"config:evaluateins.config:{k}" for k in INSTRUCTION_CONFIG),
    },
    # A newcomer's (held-out client's) reply also carries its accuracy after newcomer-steps local steps.
    ("evaluate", "reply"): {
        "metric:evaluateres.loss:loss", "metric:evaluateres.num_examples:num_examples",
        "config:evaluateres.metrics:accuracy", "config:evaluateres.metrics:adapted-accuracy", *status("evaluateres"),
    },
    # SecAgg+ (the fingerprint statistics always; model updates with secure-aggregation=secaggplus).
    ("train/setup", "instruction"): {
        f"{SECAGG}:{key}"
        for key in ("stage", "sample_num", "share_num", "threshold", "clipping_range", "target_range", "mod_range",
                    "max_weight")
    },
    ("train/setup", "reply"): {f"{SECAGG}:pk1", f"{SECAGG}:pk2"},
    ("train/share_keys", "instruction"): {f"{SECAGG}:stage", f"{SECAGG}:<node-id>"},
    ("train/share_keys", "reply"): {f"{SECAGG}:dsts", f"{SECAGG}:ctxts"},
    ("train/collect_masked_vectors", "instruction"): {
        "array:fitins.parameters", "config:fitins.config:fedcond-step",
        # Under client-level DP, the bound each client clips its fingerprint statistics to.
        "config:fitins.config:statistics-clipping-norm",
        *(f"config:fitins.config:{k}" for k in INSTRUCTION_CONFIG),
        f"{SECAGG}:stage", f"{SECAGG}:ctxts", f"{SECAGG}:srcs",
    },
    # The masked vector, no metric but the DP accounting, the sample count zeroed (it is in the vector).
    ("train/collect_masked_vectors", "reply"): {
        f"{SECAGG}:masked_params", "array:fitres.parameters", "metric:fitres.num_examples:num_examples",
        "config:fitres.metrics:epsilon", *status("fitres"),
    },
    ("train/unmask", "instruction"): {f"{SECAGG}:stage", f"{SECAGG}:active_nids", f"{SECAGG}:dead_nids"},
    ("train/unmask", "reply"): {f"{SECAGG}:nids", f"{SECAGG}:shares"},
}  # fmt: skip

# Every method, once; DP and SecAgg+ settings where a method takes them, so their keys are seen too.
RUNS = {
    "fedavg": {"method": "fedavg"},
    "conditional-secagg-dp": {
        "method": "conditional", "secure-aggregation": "secaggplus", "client-dp": "client-side",
        "client-dp-noise-multiplier": 0.01, "dp-noise-multiplier": 0.5, "fingerprint-epsilon": 8.0,
        "client-dp-statistics-clipping-norm": 100.0,
    },
    "local": {"method": "local"},
    "oracle": {"method": "oracle"},
    "ifca": {"method": "ifca"},
    "ditto-secagg": {"method": "ditto", "secure-aggregation": "secaggplus", "ditto-personal-epochs": 1},
    # Newcomers with adaptation: the newcomer's rules send every peer model (DAC) or one (Gossip).
    "gossip": {"method": "gossip", "held-out-clients": 1, "newcomer-steps": 2},
    "dac": {"method": "dac", "dac-neighbours": 1, "held-out-clients": 1, "newcomer-steps": 2},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_every_key_of_every_message_is_on_the_allow_list(tmp_path, name):
    from fedcond.tools.simulation import simulate
    from tests.message_log import MessageLog, read_log

    log = tmp_path / "messages.jsonl"
    config = run_config({
        "num-clusters": 2, "clients-per-cluster": 1, "num-server-rounds": 2, "local-epochs": 1,
        "results-dir": str(tmp_path / "r"), "verbose": False, **RUNS[name],
    })  # fmt: skip
    simulate(config, client_mods=[MessageLog(str(log))], quiet=True)
    (folder,) = (tmp_path / "r").iterdir()
    assert '"status": "finished"' in (folder / "run.json").read_text()
    seen = read_log(log)
    unexpected = {kind: sorted(keys - ALLOWED.get(kind, set())) for kind, keys in seen.items()}
    assert not any(unexpected.values()), {kind: keys for kind, keys in unexpected.items() if keys}
    secure = config.to_mapping()["secure-aggregation"] == "secaggplus"
    conditioned = name.startswith("conditional")
    expected = {("get_properties", "reply"), ("evaluate", "reply")}
    expected |= {("train/collect_masked_vectors", "reply")} if secure or conditioned else set()
    expected |= {("train", "reply")} if not secure else set()
    assert expected <= set(seen)
    # Under SecAgg+ no plain training reply at all: every model update was masked.
    assert not (secure and ("train", "reply") in seen)
    if not secure:  # round 2's training reply carried round 1's evaluation (evaluate-in-fit)
        assert "config:fitres.metrics:evaluated-accuracy" in seen[("train", "reply")]
    if "newcomer-steps" in RUNS[name]:  # the newcomers' adapted accuracy did travel
        assert "config:evaluateres.metrics:adapted-accuracy" in seen[("evaluate", "reply")]
    if name == "conditional-secagg-dp":  # the DP keys did travel (so the allow-list saw them)
        assert "config:fitres.metrics:epsilon" in seen[("train/collect_masked_vectors", "reply")]
        assert "config:fitins.config:clipping_norm" in seen[("train/collect_masked_vectors", "instruction")]
        assert "config:fitins.config:statistics-clipping-norm" in seen[("train/collect_masked_vectors", "instruction")]


def test_a_secaggplus_client_refuses_a_plain_round_and_never_lets_secaggplus_clip():
    config = run_config({**FEDERATION, "secure-aggregation": "secaggplus"}).resolved()
    sent, round_config, _ = server_view(config)
    grid = InProcessGrid(config)
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(sent), round_config), keep_input=True)
    (reply,) = grid.send_and_receive([Message(content, FIRST_NODE_ID, MessageType.TRAIN)])
    assert reply.has_error() and "a plain training instruction" in reply.error.reason

    tight = run_config({**FEDERATION, "secure-aggregation": "secaggplus", "secagg-clipping-range": 0.01}).resolved()
    outcome = secure_round(InProcessGrid(tight), tight, range(6), sent, round_config)
    assert outcome.mean is None and outcome.contributors == []  # nobody sent: the protocol stopped
    reasons = [reason for _, reason in outcome.dropped.values()]
    assert len(reasons) == 6 and all("exceeds secagg-clipping-range=0.01" in reason for reason in reasons)


@pytest.mark.parametrize("head", ["average", "ridge"])
def test_the_attack_on_a_methods_real_replies_recovers_each_clients_fingerprint(head):
    """benchmarks/attack_messages.py reads the fingerprint out of what the clients' own ClientApp
    clients send in round 1: from the conditioned layer's update, or from row 0 of a ridge reply."""
    from tests.scripts import load_script

    attack = load_script("benchmarks/attack_messages.py")
    settings = {"method": "recommended", "head-fit": head, "num-clusters": 2, "clients-per-cluster": 2,
                "data-fraction": 0.2, "local-epochs": 1}  # fmt: skip
    cells = attack.views(settings, attack.round_one(settings), clip=1.0, noises=[1.0], repeats=1)
    assert float(cells[0]) == pytest.approx(1.0, abs=1e-3)  # each client's reply, attacked alone
    assert 0.0 < float(cells[1]) < 1.0  # the mean of four replies mixes them
    # Clipping scales the update (a ridge reply's products with it): still exact.
    assert float(cells[2]) == pytest.approx(1.0, abs=1e-3)

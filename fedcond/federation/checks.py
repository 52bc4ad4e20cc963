"""Every check a run has before anything starts: how its settings fit together.

``RunConfig`` checks each value on its own; ``check_run`` checks the dataset, scenario, encoder,
method, held-out clients, server optimiser, privacy and secure-aggregation settings against each
other (and, with ``resume``, the run it continues), and is the one place every entry point calls: the ServerApp,
``fedcond run``, compare, sweep, deploy-local and export-partitions.
"""

from __future__ import annotations

from collections.abc import Collection

from fedcond.config import RunConfig
from fedcond.data.datasets import dataset_spec
from fedcond.data.scenarios import scenario_for, scenario_kind, validate_without_data
from fedcond.errors import FedcondError
from fedcond.federation import client_dp
from fedcond.federation.methods import (
    Method,
    client_dp_methods,
    declared_options,
    get_method,
    held_out_methods,
    registry,
    shared_options,
)
from fedcond.federation.sampling import check_sampling
from fedcond.fingerprint.fingerprints import check_label_free
from fedcond.model.networks import has_batch_norm
from fedcond.model.server_optimiser import check_server_optimiser
from fedcond.newcomers import NEWCOMER_STEPS
from fedcond.privacy import dp as privacy
from fedcond.privacy import secure_aggregation as secagg_settings
from fedcond.records.checkpoint import check_resume, resume_folder


def check_run(
    config: RunConfig,
    load_data: bool = False,
    compared_options: frozenset[str] = frozenset(),
    given: Collection[str] | None = None,
) -> Method:
    """Every check a run has before anything starts; returns its method.

    ``RunConfig`` has already checked each value on its own; this checks how they fit together
    (dataset, scenario, encoder, method, held-out clients) and, with ``resume``, that the run it
    names can go on with these settings (``fedcond.records.checkpoint.check_resume``). With ``load_data``
    it also reads and splits the data, so missing files or clients with too few samples stop the run here too.

    ``shared_options``: method settings a comparison gives every run, for the methods among it that
    read them (``ifca-models`` in a compare of IFCA beside FedAvg); another method's run ignores them.
    ``given``: the settings the user gave, the others being defaults (None: unknown), which a refused
    resume's advice tells apart.
    """
    validate_without_data(config)
    method = get_method(config.method)
    if config.held_out_clients and not method.serves_held_out_clients:
        supported = held_out_methods()
        raise FedcondError(
            f"held-out-clients has no meaning for {method.name} (a client that never trains has no model of its "
            f"own there); set held-out-clients=0 or use one of {', '.join(supported)} "
            f"(compare: --methods {','.join(supported)})"
        )
    check_options_apply(config, method, compared_options)
    check_server_optimiser(config, method.name, method.server_step_refusal)
    check_newcomers(config, method)
    check_model_settings(config, method)
    check_clusters_exist(config, method)
    if config.drift_fraction and method.protocol == "pooled":
        raise FedcondError(
            f"{method.name} trains centrally on pooled data that never changes: drift-fraction applies to "
            "federated methods; set drift-fraction=0 and drift-round=0"
        )
    if method.strategy is not None:
        method.strategy.check(config)
    if method.conditioned and scenario_kind(config.scenario).labels_only:
        check_label_free(config.fingerprint, config.scenario)
    check_privacy(config, method)
    secure = secagg_settings.SecureAggregation.of(config)
    check_sampling(config, secure.min_clients if secure.model_updates else None)
    if resume_folder(config) is not None:
        check_resume(config, given)
    if load_data:
        scenario_for(config)
    check_secure_aggregation(config, method)  # after the data: too many clients for the data says so first
    return method


def check_options_apply(config: RunConfig, method: Method, shared: frozenset[str] = frozenset()) -> None:
    """A method's own setting changed for a method that does not read it would be ignored silently:
    refused in one line, naming the methods it belongs to (unless a comparison shares it: ``shared``)."""
    own = (
        {option.key for option in method.options}
        | shared
        | {option.key for group in shared_options() for option in group.options}
    )
    for option in declared_options():
        value = option.of(config)
        if option.key in own or value == option.default:
            continue
        owners = [
            name
            for name, other in registry().items()
            if not other.variant_of and option.key in {o.key for o in other.options}
        ]
        raise FedcondError(
            f"{option.key}={value} is a setting of {', '.join(owners)}, and {method.name} does not read it; "
            f"leave it at its default ({option.default}) or choose one of those methods"
        )


def check_model_settings(config: RunConfig, method: Method) -> None:
    """``condition-scale``, ``hyper-init`` and ``feature-norm`` against the method and the dataset's network."""
    if not method.conditioned:
        defaults = RunConfig()
        for key in ("condition-scale", "hyper-init"):
            field = key.replace("-", "_")
            if getattr(config, field) != getattr(defaults, field):
                raise FedcondError(
                    f"{key} sets how a model reads the fingerprint, and {method.name}'s model takes none; "
                    "leave it at its default or pick a conditioned method"
                )
    if config.hyper_init != "random" and config.conditioning != "hyper":
        raise FedcondError(
            f"hyper-init={config.hyper_init} sets the generated head of conditioning=hyper; this run conditions by "
            f"{config.conditioning}: set conditioning=hyper or leave hyper-init=random"
        )
    if config.feature_norm == "batch":
        return
    if not has_batch_norm(dataset_spec(config.dataset).input_shape):
        raise FedcondError(
            f"feature-norm={config.feature_norm} changes the CIFAR network's batch norm, and {config.dataset}'s "
            "network has none; leave feature-norm=batch"
        )
    if config.feature_norm == "local-batch":
        if not (method.conditioned and method.protocol == "federated"):
            raise FedcondError(
                "feature-norm=local-batch keeps each client's batch-norm layers on the client, as the conditioned "
                f"federated methods do; {method.name} does not: use feature-norm=batch or group, or a conditioned "
                "method"
            )
        if resume_folder(config) is not None:
            raise FedcondError(
                "resume with feature-norm=local-batch: each client keeps its batch-norm layers in Flower's "
                "context.state, which a resumed run starts empty; start the run again without resume"
            )


def check_clusters_exist(config: RunConfig, method: Method) -> None:
    """A scenario without true clusters (``ScenarioKind.clustered``) has nothing to tell Oracle or a
    cluster-id control: refused in one line rather than run as FedAvg under another name."""
    if scenario_kind(config.scenario).clustered:
        return
    if method.needs_true_clusters:
        raise FedcondError(
            f"{method.name} is told the true clusters, and {config.scenario} has none (one population, each "
            "client's labels drawn by the partitioner); compare against fedavg, local or a personalised method"
        )
    if method.conditioned and config.fingerprint == "cluster-id":
        raise FedcondError(
            f"fingerprint cluster-id is the true cluster, and {config.scenario} has none; choose another fingerprint"
        )


def check_newcomers(config: RunConfig, method: Method) -> None:
    """``newcomer-steps`` fine-tunes what held-out clients are served (fedcond.newcomers), in one line."""
    steps = NEWCOMER_STEPS.of(config)
    if steps and not config.held_out_clients:
        raise FedcondError(
            f"newcomer-steps={steps} fine-tunes what held-out clients are served, and this run has none; "
            "set held-out-clients=1 (or more), or newcomer-steps=0"
        )
    if steps and method.protocol == "pooled":
        raise FedcondError(
            f"newcomer-steps applies to federated methods' newcomers; {method.name} trains centrally on pooled "
            "data: set newcomer-steps=0"
        )


def check_secure_aggregation(config: RunConfig, method: Method) -> None:
    """Secure aggregation (docs/privacy.md) against the method and the federation, in one line."""
    if method.strategy is not None:
        sums_statistics = method.conditioned and config.normalisation == "federated"
        refusal = method.strategy.secure_aggregation_refusal
        secagg_settings.check_secure_aggregation(config, refusal, sums_statistics)
    elif secagg_settings.SecureAggregation.of(config).model_updates:
        raise FedcondError(
            f"{method.name} trains centrally on pooled data: secure-aggregation applies to federated methods only; "
            "set secure-aggregation=none"
        )


def check_privacy(config: RunConfig, method: Method) -> None:
    """The DP settings (docs/privacy.md) against the method: refused in one line where they cannot hold."""
    sample_level = privacy.SampleLevelPrivacy.of(config)
    if method.protocol == "pooled" and (sample_level.enabled or client_dp.client_dp_mode(config) != "off"):
        raise FedcondError(
            f"{method.name} trains centrally on pooled data: the DP settings (dp-noise-multiplier, "
            "fingerprint-epsilon, client-dp) apply to federated methods only; set them to 0 / off"
        )
    if sample_level.dp_sgd and method.client is not None and method.client.released_beyond_training:
        raise FedcondError(
            f"dp-noise-multiplier cannot make {method.name} private: its clients also send "
            f"{method.client.released_beyond_training}, which DP-SGD does not cover; set dp-noise-multiplier=0 or "
            "pick another method"
        )
    if sample_level.enabled and resume_folder(config) is not None:
        raise FedcondError(
            "resume with sample-level DP (dp-noise-multiplier, fingerprint-epsilon): each client keeps its privacy "
            "ledger (and its noised fingerprint) in Flower's context.state, which a resumed run starts empty, so its "
            "epsilon would restart from 0; start the run again without resume"
        )
    privacy.check_sample_level(config, method.conditioned)
    client_dp.check_client_dp(config, method.strategy, client_dp_methods())

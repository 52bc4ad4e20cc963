"""The declared like-for-like grids give every arm the same tools: the chosen method's bundles are
`recommended`'s settings, and every arm whose server averages a model has the same server optimiser."""

from pathlib import Path

import pytest

from fedcond.federation import client_dp
from fedcond.federation.methods import get_method, run_config
from fedcond.model.server_optimiser import OPTIONS as SERVER_OPTIMISER_OPTIONS
from fedcond.tools.experiment import read_grid_file

GRIDS = Path(__file__).resolve().parent.parent / "experiments" / "grids"
#: (grid, profile): the comparisons whose arms must share one server optimiser.
DECLARED = [
    ("like-for-like.toml", "e4b"),
    ("per-shift.toml", None),
    ("privacy-cost.toml", None),
    ("privacy-cost.toml", "secagg"),
]
#: What each control changes on purpose, and nothing else.
CONTROLS = {"recommended-cluster-id": {"fingerprint"}, "recommended-other-concept": {"newcomer-fingerprint"}}
#: A privacy arm changes the mechanism's settings (privacy-cost.toml), nothing of the method.
MECHANISM = {option.key for option in client_dp.OPTIONS} | {"secure-aggregation"}


def arms(grid: str, profile: str | None) -> dict[str, dict]:
    experiment = read_grid_file(GRIDS / grid, profile)
    bundles = [value if isinstance(value, dict) else {"label": value, "method": value}
               for value in experiment.axes["method"]]  # fmt: skip
    return {bundle["label"]: {**experiment.settings, **bundle} for bundle in bundles}


def experiment_settings(grid: str, profile: str | None) -> dict:
    return dict(read_grid_file(GRIDS / grid, profile).settings)


def server_optimiser(settings: dict) -> tuple:
    config = run_config({key: value for key, value in settings.items() if key != "label"})
    return tuple(option.of(config) for option in SERVER_OPTIMISER_OPTIONS)


@pytest.mark.parametrize(("grid", "profile"), DECLARED)
def test_the_chosen_method_runs_as_recommended_is_defined_and_each_control_changes_one_thing(grid, profile):
    declared = arms(grid, profile)
    for label, settings in declared.items():
        if not label.startswith("recommended"):
            continue
        given = {key: value for key, value in settings.items() if key != "label"}
        config = run_config(given).to_mapping()
        # The same run named method=recommended, the bundle's server optimiser kept (a setting of
        # every averaging arm, not of the method): every other key must agree but the control's.
        optimiser = {option.key: given[option.key] for option in SERVER_OPTIMISER_OPTIONS if option.key in given}
        named = run_config({**experiment_settings(grid, profile), **optimiser, "method": "recommended"}).to_mapping()
        differing = {key for key in config if key != "method" and config[key] != named[key]} - MECHANISM
        assert differing == CONTROLS.get(label, set()), label


@pytest.mark.parametrize(("grid", "profile"), DECLARED)
def test_every_arm_that_averages_a_model_has_the_same_server_optimiser(grid, profile):
    declared = arms(grid, profile)
    averaging = {label: server_optimiser(settings) for label, settings in declared.items()
                 if get_method(str(settings["method"])).server_step_refusal is None}  # fmt: skip
    plain = tuple(option.default for option in SERVER_OPTIMISER_OPTIONS)
    assert len(set(averaging.values())) == 1, averaging
    # The selection chose FedAvgM for every averaging arm: a grid that forgot it on all of them
    # would still agree with itself.
    assert next(iter(averaging.values())) != plain
    for label, settings in declared.items():
        if label not in averaging:
            assert server_optimiser(settings) == plain, label


def test_a_profile_that_only_orders_the_e4b_runs_runs_e4bs_own_bundles():
    every = arms("like-for-like.toml", "e4b")
    first = arms("like-for-like.toml", "e4b-headline")
    assert first and all(every[label] == settings for label, settings in first.items())

"""The method table imports every module of strategies/, and a method written wrong fails at start,
naming its file: never silently left out, never listed by hand."""

from __future__ import annotations

import sys

import pytest

from fedcond import clients, strategies
from fedcond.errors import FedcondError
from fedcond.federation import methods
from fedcond.federation.client_app import client_class


@pytest.fixture
def extra_modules(tmp_path, monkeypatch):
    """A folder the strategies and clients packages also read: a method module written there is found
    as one written in strategies/ (or clients/) would be, without touching the checkout."""
    for package in (strategies, clients):
        folder = tmp_path / package.__name__.rpartition(".")[2]
        folder.mkdir()
        monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    methods.declared_methods.cache_clear()
    yield tmp_path
    methods.declared_methods.cache_clear()
    for name in [name for name in sys.modules if name.endswith(".fedrep")]:
        del sys.modules[name]


def test_every_module_in_strategies_is_a_declared_method_in_name_order():
    modules = methods.method_modules()
    assert "fedavg" in modules and modules == sorted(modules)
    assert [name.replace("-", "_") for name in methods.declared_methods()] == modules


def test_a_new_method_module_is_found_without_any_list(extra_modules):
    """Adding a method is adding its modules: the table finds strategies/fedrep.py by import."""
    (extra_modules / "strategies" / "fedrep.py").write_text(
        "from fedcond.federation.declaration import MODEL_REPLY, Declaration, Facts\n"
        "from fedcond.strategies.fedavg import FedcondFedAvg\n"
        "METHOD = Declaration('FedAvg again', FedcondFedAvg, Facts(*['x'] * 7, 'y', releases=(MODEL_REPLY,)))\n"
    )
    assert methods.declared_methods()["fedrep"].strategy.__name__ == "FedcondFedAvg"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("METHOD = {'summary': 'x'}\n", r"strategies/fedrep\.py: METHOD is a dict, not Declaration"),
        ("SUMMARY = 'no declaration'\n", r"strategies/fedrep\.py: METHOD is missing, not Declaration"),
        (
            "from fedcond.federation.declaration import Declaration\nMETHOD = Declaration('x', object, None)\n",
            r"strategies/fedrep\.py: METHOD's strategy <class 'object'> is no ServerMethod subclass",
        ),
        (
            "from fedcond.federation.declaration import Declaration, Facts\n"
            "from fedcond.strategies.fedavg import FedcondFedAvg\n"
            "METHOD = Declaration('x', FedcondFedAvg, Facts(*['x'] * 7, 'y'))\n",
            r"strategies/fedrep\.py: METHOD's facts declare no releases; say what its client sends",
        ),
        ("import not_a_package_anywhere\n", r"strategies/fedrep\.py cannot be imported: No module named"),
    ],
)
def test_a_malformed_declaration_fails_naming_its_file(extra_modules, source, message):
    (extra_modules / "strategies" / "fedrep.py").write_text(source)
    with pytest.raises(FedcondError, match=message):
        methods.declared_methods()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("Client = 3\n", r"clients/fedrep\.py: Client is 3, not a FedcondClient subclass"),
        ("CLIENT = None\n", r"clients/fedrep\.py: Client is missing, not a FedcondClient subclass"),
        ("import not_a_package_anywhere\n", r"clients/fedrep\.py cannot be imported"),
    ],
)
def test_a_client_module_without_its_client_class_fails_naming_its_file(extra_modules, source, message):
    (extra_modules / "clients" / "fedrep.py").write_text(source)
    with pytest.raises(FedcondError, match=message):
        client_class("fedrep")

"""The method table imports the modules it lists, and a method written wrong fails at start, naming
its file: never silently left out."""

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


def test_every_listed_method_is_declared_and_nothing_else_sits_in_strategies():
    assert [name.replace("-", "_") for name in methods.declared_methods()] == list(methods.METHOD_MODULES)
    assert methods.unlisted_method_modules() == []


def test_a_method_module_missing_from_the_list_is_refused_naming_its_file(extra_modules):
    (extra_modules / "strategies" / "fedrep.py").write_text("METHOD = None\n")
    with pytest.raises(
        FedcondError, match=r"strategies/fedrep\.py is in no method list: add 'fedrep' to METHOD_MODULES"
    ):
        methods.declared_methods()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("METHOD = {'summary': 'x'}\n", r"strategies/fedrep\.py: METHOD is a dict, not Declaration"),
        ("SUMMARY = 'no declaration'\n", r"strategies/fedrep\.py: METHOD is missing, not Declaration"),
        (
            "from fedcond.federation.declaration import Declaration\nMETHOD = Declaration('x', object, None)\n",
            r"strategies/fedrep\.py: METHOD's strategy <class 'object'> is no ServerMethod subclass",
        ),
        ("import not_a_package_anywhere\n", r"strategies/fedrep\.py cannot be imported: No module named"),
    ],
)
def test_a_malformed_declaration_fails_naming_its_file(extra_modules, monkeypatch, source, message):
    (extra_modules / "strategies" / "fedrep.py").write_text(source)
    monkeypatch.setattr(methods, "METHOD_MODULES", (*methods.METHOD_MODULES, "fedrep"))
    with pytest.raises(FedcondError, match=message):
        methods.declared_methods()


def test_a_listed_method_without_its_module_is_refused(extra_modules, monkeypatch):
    monkeypatch.setattr(methods, "METHOD_MODULES", (*methods.METHOD_MODULES, "fedrep"))
    with pytest.raises(FedcondError, match=r"strategies/fedrep\.py is missing: .* lists it"):
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

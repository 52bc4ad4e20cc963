"""What the tests that run every method add for a method that cannot run on their small digits
federation (``Declaration.test_settings``; FedBN needs a network with batch norm), with the data such
a dataset needs written under the test's folder: made-up images, nothing downloaded; and the methods
a test covers, found by what they declare rather than named by hand."""

from __future__ import annotations

from pathlib import Path

from fedcond.federation.methods import get_method, registry


def method_test_settings(method: str, folder: Path) -> dict[str, object]:
    """``method``'s declared test settings, with ``data-dir`` pointing at data written under ``folder``."""
    settings = dict(get_method(method).test_settings)
    dataset = settings.get("dataset", "digits")
    if dataset == "cifar10":
        from tests.test_cifar import write_cifar10_folder

        root = folder / "tiny-cifar10"
        if not root.exists():  # 8 training and 4 test images a class, each class a band a CNN finds at once
            write_cifar10_folder(root / "cifar10-jpeg", per_class=(8, 4), bands=True)
        settings["data-dir"] = str(root)
    elif dataset != "digits":
        raise ValueError(f"no test data for {dataset}: write a tiny folder of it here, as for cifar10")
    return settings


def peer_to_peer_methods() -> list[str]:
    """Every method whose clients exchange models with each other (the server simulates the exchange)."""
    return [name for name, method in registry().items() if method.strategy and method.strategy.peer_to_peer]


def methods_keeping_client_state() -> list[str]:
    """Every method (variants aside) whose client keeps arrays between rounds (``state_lost_on_resume``)."""
    return [name for name, method in registry().items() if method.state_lost_on_resume and not method.variant_of]

"""Shared fixtures: keep every test offline, on loopback, and out of the user's folders."""

from __future__ import annotations

import os

import pytest

# Set before Ray or Flower is imported by any test: no telemetry, and a local Ray bound to loopback.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(scope="session")
def _decoded_datasets(tmp_path_factory):
    """One folder of decoded datasets for the whole session (fedcond.datasets keys each copy by its
    source files): each test's processes, Ray actors included, map the digits instead of decoding them."""
    return tmp_path_factory.mktemp("decoded")


@pytest.fixture(autouse=True)
def _isolated_environment(tmp_path, tmp_path_factory, monkeypatch, _decoded_datasets):
    monkeypatch.delenv("FEDCOND_DATA_DIR", raising=False)
    # A cache folder of the test's own (downloads, trained encoders), beside tmp_path rather than
    # in it (tests list tmp_path), sharing the session's decoded datasets.
    cache = tmp_path_factory.mktemp("cache")
    (cache / "decoded").symlink_to(_decoded_datasets, target_is_directory=True)
    monkeypatch.setenv("FEDCOND_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path)

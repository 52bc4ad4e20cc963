"""Shared fixtures: keep every test offline, on loopback, and out of the user's folders."""

from __future__ import annotations

import os

import pytest

# Set before Ray or Flower is imported by any test: no telemetry, and a local Ray bound to loopback.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(autouse=True)
def _isolated_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDCOND_DATA_DIR", raising=False)
    monkeypatch.setenv("FEDCOND_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

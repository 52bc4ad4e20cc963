"""Shared fixtures: keep every test offline, on loopback, and out of the user's folders."""

from __future__ import annotations

import os

import pytest

# Set before Ray or Flower is imported by any test: no telemetry, and a local Ray bound to loopback.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test processes share the cores: one torch thread each, as Ray gives each virtual
    # client, rather than every process taking all cores (2 processes x 2 threads on 2 cores made
    # the in-process training tests 5-15 times slower).
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One torch thread for the test, as each of Ray's virtual clients trains (the same arithmetic,
    the same models), and tiny batches' OpenMP threads only wait on each other; restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def _decoded_datasets(tmp_path_factory):
    """One folder of decoded datasets for the whole session (fedcond.data.datasets keys each copy by its
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


@pytest.fixture(autouse=True)
def _client_apps_in_this_process(request, monkeypatch):
    """Every Flower simulation of a test runs its ClientApps in the test's process
    (tests/thread_backend.py), unless the test is marked ``ray``: then on Ray's actors, as users' do."""
    if request.node.get_closest_marker("ray"):
        return
    from tests.thread_backend import install

    marker = request.node.get_closest_marker("client_threads")
    install(marker.args[0] if marker else 1, monkeypatch.setattr)


@pytest.fixture
def task_identity(monkeypatch):
    """The identity Flower 1.42 stamps on every Message it builds, set as a ServerApp sets it: a test
    that builds Messages outside a run needs it whatever ran before it in the same process."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``waits`` spend minutes waiting on Flower (heartbeats, SuperNodes, ClientApp
    processes starting) rather than computing: they start first, longest first, each in a test process
    of its own, so that their waits overlap the other tests' work instead of adding to it.

    `make test` hands tests out one at a time (``--maxschedchunk 1``) after two to each process at
    the start: a waiting test and then a quick one each, so the longest waits begin at once on
    different processes. In collection order, with xdist's default hand-out (72 consecutive tests to
    each of 3 processes at the start), the TLS and node-killed deployments of test_deploy.py (tests
    131 and 135 of 865) ran one after the other in one process: 224 + 404 s of an 897-s suite."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the order does not change the time
    waiting = sorted((item for item in items if item.get_closest_marker("waits")),
                     key=lambda item: -item.get_closest_marker("waits").args[0])  # fmt: skip
    others = [item for item in items if not item.get_closest_marker("waits")]
    ordered: list[pytest.Item] = []
    for index, test in enumerate(waiting):
        ordered += [test, *others[index : index + 1]]
    items[:] = ordered + others[len(waiting) :]

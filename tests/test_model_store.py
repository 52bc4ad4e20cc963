"""Per-client models outside memory: the server's spilled copies (the peer-to-peer methods') and each
client's own files (every method whose client keeps arrays between rounds) compute what the in-memory
protocol computes, and hold what they say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedcond.model.store import SPILL_FOLDER, SpillingModels
from fedcond.tools.in_process import InProcessNode, run_in_process
from tests.method_settings import methods_keeping_client_state, peer_to_peer_methods
from tests.test_one_message import PROTOCOL_COLUMNS, config_for, history


def model(value: float, size: int = 256) -> list[np.ndarray]:
    return [np.full(size, value, np.float32), np.array(value, np.float32)]  # a 0-d array keeps its shape


def same(first: list[np.ndarray], second: list[np.ndarray]) -> bool:
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(first, second, strict=True))


def test_spilled_models_leave_memory_for_immutable_files_that_the_checkpoint_names(tmp_path):
    one = sum(array.nbytes for array in model(0))
    store = SpillingModels(model(0), tmp_path, memory_bytes=2 * one)  # room for two models
    store.update(1, [(pid, model(pid + 1)) for pid in range(4)])
    assert sorted(store.in_memory) == [2, 3] and store.on_disk == {0: 1, 1: 1}  # least recently used out
    assert same(store[0], model(1)) and same(store[3], model(4)) and same(store[7], model(0))  # 7: untouched

    held, values = store.checkpoint_state()
    assert sorted(held) == [2, 3] and values["spilled-client-models"] == {"0": 1, "1": 1}
    store.update(2, [(0, model(10))])  # client 0 trains again: its round-1 file is still the checkpoint's
    assert (tmp_path / "client-0-round-1.npz").exists()
    store.checkpoint_saved()  # the next checkpoint holds client 0 in memory (or names a newer file)
    assert not (tmp_path / "client-0-round-1.npz").exists() and (tmp_path / "client-1-round-1.npz").exists()

    restored = SpillingModels(model(0), tmp_path, memory_bytes=2 * one)
    held, values = store.checkpoint_state()
    restored.load(held, values)
    for pid in range(5):
        assert same(restored[pid], store[pid]), pid


def test_without_a_folder_every_model_stays_in_memory():
    store = SpillingModels(model(0), None, memory_bytes=0)
    store.update(1, [(pid, model(pid)) for pid in range(3)])
    assert len(store.in_memory) == 3 and not store.on_disk


@pytest.mark.parametrize("method", peer_to_peer_methods())
def test_a_peer_method_spilling_every_model_computes_what_it_computes_in_memory(tmp_path, method):
    histories = []
    for memory_mb in (1024, 0):
        recorder, _ = run_in_process(
            config_for(method, tmp_path / str(memory_mb), True, **{"client-models-memory-mb": memory_mb})
        )
        rows = history(recorder.folder)
        histories.append([{k: v for k, v in row.items() if k not in PROTOCOL_COLUMNS} for row in rows])
        spilled = sorted(path.name for path in (recorder.folder / SPILL_FOLDER).glob("*.npz"))
        # Memory 0: each client's latest model alone is on disk (older rounds' files removed).
        assert spilled == ([] if memory_mb else [f"client-{pid}-round-3.npz" for pid in range(4)]), spilled
    assert histories[0] == histories[1]


@pytest.mark.parametrize("method", methods_keeping_client_state())
def test_a_client_keeping_its_models_in_files_computes_what_it_computes_in_context_state(tmp_path, monkeypatch, method):
    contexts: list[InProcessNode] = []
    original = InProcessNode.__init__

    def keep(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        contexts.append(self)

    monkeypatch.setattr(InProcessNode, "__init__", keep)
    state_dir = tmp_path / "client-state"
    histories = []
    for settings in ({}, {"client-state-dir": str(state_dir)}):
        contexts.clear()
        recorder, _ = run_in_process(config_for(method, tmp_path / str(bool(settings)), True, **settings))
        histories.append([{k: v for k, v in row.items() if k != "elapsed_seconds" and k != "seconds"}
                          for row in history(recorder.folder)])  # fmt: skip
        kept_in_memory = [node for node in contexts if node.context.state.array_records]
        assert len(kept_in_memory) == (0 if settings else 4)
    assert histories[0] == histories[1]
    # One folder per Flower run (in-process: run 0) and training partition, the same files in each.
    kept = sorted(path.name for path in (state_dir / "run-0" / "partition-0").glob("*.npz"))
    assert kept and sorted(path.relative_to(state_dir).as_posix() for path in state_dir.rglob("*.npz")) == sorted(
        f"run-0/partition-{pid}/{name}" for pid in range(4) for name in kept
    )


def test_the_server_app_removes_a_finished_runs_client_state(tmp_path: Path):
    from fedcond.model.store import ClientModelFiles, remove_run_state, run_state_folder

    ClientModelFiles(str(tmp_path), 7, 0).put("kept", model(1))
    ClientModelFiles(str(tmp_path), 8, 0).put("kept", model(2))
    remove_run_state(str(tmp_path), 7)
    assert not run_state_folder(str(tmp_path), 7).exists()
    assert same(ClientModelFiles(str(tmp_path), 8, 0).get("kept"), model(2))  # another run's untouched


def test_a_client_state_dir_that_cannot_be_written_is_said_in_one_line(tmp_path: Path):
    from fedcond.errors import FedcondError
    from fedcond.model.store import ClientModelFiles

    (tmp_path / "a-file").write_text("")
    with pytest.raises(FedcondError, match=r"client-state-dir: cannot write .* give a folder this node can write"):
        ClientModelFiles(str(tmp_path / "a-file"), 1, 0).put("kept", model(1))

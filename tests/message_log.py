"""A Flower mod for the tests that writes down every key of every message a client receives and sends.

``MessageLog(path)`` is the outermost mod of a ClientApp (``simulate(..., client_mods=[log])``): it
sees the instruction as the server sent it and the reply as it leaves the node, after SecAgg+'s
masking. Each message becomes one JSON line: its kind (``train``, ``evaluate``, ``query``,
``get_properties``; a SecAgg+ stage as ``train/<stage>``), its direction and its keys, each as
``<record kind>:<record name>:<key>`` (array records by name only). Keys that are node ids (SecAgg+'s
key-sharing stage names the neighbours by them) are written ``<node-id>``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import ray.cloudpickle
from flwr.app import Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Context
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

# Ray actors unpickle the ClientApp, mods included: by value, as tests/ need not be importable there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def message_keys(content: RecordDict) -> list[str]:
    keys = [f"array:{name}" for name in content.array_records]
    for kind, records in (("config", content.config_records), ("metric", content.metric_records)):
        for name, record in records.items():
            keys += [f"{kind}:{name}:{'<node-id>' if key.isdigit() else key}" for key in record]
    return sorted(keys)


def message_kind(message: Message) -> str:
    kind = message.metadata.message_type
    if kind == "train" and message.has_content() and RECORD_KEY_CONFIGS in message.content.config_records:
        return f"train/{message.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)}"
    return kind


@dataclass(frozen=True)
class MessageLog:
    path: str

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        kind = message_kind(message)  # the stage is popped from the instruction by SecAgg+'s mod
        self.write(kind, "instruction", message_keys(message.content))
        reply = call_next(message, context)
        self.write(kind, "reply", message_keys(reply.content) if reply.has_content() else ["<error>"])
        return reply

    def write(self, kind: str, direction: str, keys: list[str]) -> None:
        # One short line per write, appended: whole lines even with several Ray actors writing.
        with Path(self.path).open("a") as handle:
            handle.write(json.dumps({"kind": kind, "direction": direction, "keys": keys}) + "\n")


def read_log(path: Path) -> dict[tuple[str, str], set[str]]:
    """(kind, direction) -> every key seen."""
    seen: dict[tuple[str, str], set[str]] = {}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        seen.setdefault((entry["kind"], entry["direction"]), set()).update(entry["keys"])
    return seen

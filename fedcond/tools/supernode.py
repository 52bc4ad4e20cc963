"""``fedcond supernode``: Flower's ``flower-supernode``, with what its operator needs around it.

Every argument is ``flower-supernode``'s, passed on unchanged. Around it:

- **before** Flower starts, this node's files are checked: ``--node-config`` holds an integer
  ``partition-id`` and ``num-partitions``, its ``partition-file`` exists and is that partition's,
  ``--root-certificates`` and ``--auth-supernode-private-key`` exist; a problem is one line naming
  the fix, and nothing starts;
- **while** it runs, its output is shown as it is, and Flower's refusals and retries get one line
  saying what to fix (``HINTS``): a key the SuperLink never registered; for a SuperLink it cannot
  reach or a failed TLS handshake, fedcond dials ``--superlink`` itself (``superlink_probe``) and
  says which it is: nothing listening there, a certificate ``--root-certificates`` did not sign
  (naming that file and the certificate's issuer and names), or one that does not name the host;
- **stopping** it by the PID of this command (Ctrl+C, ``kill``, a service manager's SIGTERM) stops
  everything the SuperNode started, its ``flower-superexec`` and ClientApp processes included
  (``flower-supernode``'s own children outlive a signal sent to it alone).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedcond.errors import FedcondError
from fedcond.tools import superlink_probe
from fedcond.tools.flwr_commands import executable, flower_environment
from fedcond.tools.processes import Processes

#: Text of a line of flower-supernode's output -> what fedcond says once after it.
HINTS = {
    "[code: 2004]": (
        "the SuperLink refused this node's key: it is not registered there (on the SuperLink machine: "
        "flwr supernode register KEY.pub CONNECTION, which prints the node id), or the node it belongs to "
        "is still listed online after a crash (wait two 30-s heartbeats, then start it again)"
    ),
    "[code: 2001]": (
        "the SuperLink admits registered keys only: start the node with --auth-supernode-private-key "
        "KEY (its .pub registered on the SuperLink machine)"
    ),
    "UNAUTHENTICATED": (
        "the SuperLink no longer knows this node: it was restarted without --database and forgot every "
        "registered key; register this node's key again there (flwr supernode register KEY.pub CONNECTION) and "
        "start the node again, and start the SuperLink with --database state.db so a restart keeps them"
    ),
    "CERTIFICATE_VERIFY_FAILED": (
        "this node does not trust the SuperLink's certificate: --root-certificates must be the ca.crt that "
        "signed the SuperLink's (or its proxy's) server.pem, and --superlink an address the certificate names"
    ),
}
#: flower-supernode retries an unreachable SuperLink forever; after this many failed attempts in a row
#: fedcond dials the address itself (``superlink_probe``) and says what answers there.
UNREACHABLE_AFTER = 3
UNREACHABLE = "Connection attempt failed"
#: flower-supernode's lines when a TLS handshake failed (it gives up at once), whatever the cause: a CA
#: file that did not sign the certificate, a certificate naming another host, a SuperLink without TLS.
TLS_FAILED = ("SSL/TLS handshake error detected", "CERTIFICATE_VERIFY_FAILED")


def _option(arguments: Sequence[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in flower-supernode's arguments."""
    for index, argument in enumerate(arguments):
        if argument == name and index + 1 < len(arguments):
            return arguments[index + 1]
        if argument.startswith(f"{name}="):
            return argument.split("=", 1)[1]
    return None


def check_node(arguments: Sequence[str]) -> None:
    """This node's settings and files, before Flower starts: one line naming the fix, or nothing."""
    from flwr.common.config import parse_config_args

    for flag in ("--root-certificates", "--auth-supernode-private-key"):
        path = _option(arguments, flag)
        if path is not None and not Path(path).expanduser().is_file():
            raise FedcondError(f"{flag} {path}: no such file; give the path of this node's copy")
    raw = _option(arguments, "--node-config")
    if raw is None:
        raise FedcondError(
            'no --node-config; give this node its client: --node-config "partition-id=I num-partitions=N '
            "partition-file='/path/to/partition-I.npz'\""
        )
    try:
        node = parse_config_args([raw])
    except Exception as error:  # Flower's parser raises several kinds on a malformed string
        raise FedcondError(f"--node-config {raw!r} is not key=value pairs ({error}); quote strings inside it") from None
    for key in ("partition-id", "num-partitions"):
        if not isinstance(node.get(key), int) or isinstance(node.get(key), bool):
            raise FedcondError(f"--node-config needs an integer {key}=... (got {node.get(key)!r})")
    partition_id, num_partitions = int(node["partition-id"]), int(node["num-partitions"])
    if not 0 <= partition_id < num_partitions:
        raise FedcondError(f"partition-id {partition_id} is outside 0..{num_partitions - 1}; fix --node-config")
    if "partition-file" in node:
        _check_partition_file(Path(str(node["partition-file"])).expanduser(), partition_id)


def _check_partition_file(path: Path, partition_id: int) -> None:
    fix = "copy this client's partition-<id>.npz from fedcond export-partitions there"
    if not path.is_absolute():
        raise FedcondError(
            f"partition-file {path} is relative: the ClientApp runs in another folder; give its absolute path"
        )
    try:
        with np.load(path, allow_pickle=False) as stored:
            held = int(stored["partition_id"])
    except FileNotFoundError:
        raise FedcondError(f"no partition file {path}; {fix}") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise FedcondError(f"{path} is not a readable partition file ({error}); {fix}") from None
    if held != partition_id:
        raise FedcondError(f"{path} holds partition {held} but --node-config says partition-id={partition_id}")


def run_supernode(arguments: Sequence[str]) -> int:
    """Check, start and watch ``flower-supernode ARGUMENTS``; its exit status (130 when stopped)."""
    from fedcond.tools.deploy import sigterm_as_interrupt

    check_node(arguments)
    logs = Path(tempfile.mkdtemp(prefix="fedcond-supernode-"))  # unused: the output is piped to ours
    processes = Processes(flower_environment(), logs)
    processes.guard()  # kill -9 of this command must not leave the SuperNode and its SuperExec running
    try:
        with sigterm_as_interrupt():
            node = processes.start("supernode", [executable("flower-supernode"), *arguments], Path.cwd(), log=False,
                                   pipe=True)  # fmt: skip
            # Its children hold the pipe too and outlive it: read in a thread, watch the SuperNode here.
            reader = threading.Thread(target=_show, args=(node, arguments), daemon=True)
            reader.start()
            while node.poll() is None:
                time.sleep(0.2)
            processes.stop_all()  # what it leaves behind (its SuperExec) ends with it
            reader.join(timeout=5)
            return node.returncode
    except KeyboardInterrupt:
        print("fedcond: stopping the SuperNode and everything it started", file=sys.stderr, flush=True)
        return 130
    finally:
        processes.stop_all()
        logs.rmdir()


class Tracebacks:
    """Python tracebacks in a stream of lines, held until they end: ``feed`` returns what to show
    now. A traceback whose text holds a ``HINTS`` pattern is shown as its last exception line alone
    (fedcond's hint says the rest); any other is shown whole. A traceback runs from its
    ``Traceback`` line through indented frame lines to its exception, whose message may go on in
    indented lines; chained ones (``During handling ...``) stay in the same block."""

    CHAINS = ("During handling of the above exception", "The above exception was the direct cause")

    def __init__(self) -> None:
        self.block: list[str] = []
        self.in_message = False

    def feed(self, line: str) -> list[str]:
        text = line.rstrip("\n")
        if not self.block:
            if text.startswith("Traceback (most recent call last):"):
                self.block = [line]
                return []
            return [line]
        if text[:1] in (" ", "\t") or not text.strip() or text.startswith((*self.CHAINS, "Traceback")):
            self.in_message = self.in_message and text[:1] in (" ", "\t")
            self.block.append(line)
            return []
        if not self.in_message and not self.block[-1].rstrip("\n").startswith(self.CHAINS):
            self.in_message = True  # the exception's own line
            self.block.append(line)
            return []
        return [*self.flush(), *self.feed(line)]

    def flush(self) -> list[str]:
        """The held traceback as it is to be shown (nothing held: nothing)."""
        block, self.block, self.in_message = self.block, [], False
        if not block or not any(pattern in "".join(block) for pattern in HINTS):
            return block
        exceptions = [line for line in block if line[:1] not in (" ", "\t") and line.strip()
                      and not line.startswith(("Traceback", *self.CHAINS))]  # fmt: skip
        return [(exceptions or block)[-1]]


def _show(node: subprocess.Popen[bytes], arguments: Sequence[str]) -> None:
    """flower-supernode's output as it is (a traceback Flower ends with on a refusal fedcond
    explains: its exception line alone), and after a line of ``HINTS`` fedcond's line saying what
    to fix, once each; after a failed TLS handshake or repeated failures to reach the SuperLink,
    what fedcond's own probe of ``--superlink`` found."""
    assert node.stdout is not None
    said: set[str] = set()
    failed_attempts = 0
    tls_probed = False
    root_certificates = _option(arguments, "--root-certificates")  # None: --insecure, no TLS of its own
    tracebacks = Tracebacks()
    # Line by line as Flower writes them (it retries an unreachable SuperLink forever), then None: the end.
    for raw in itertools.chain(node.stdout, [None]):
        line = raw.decode(errors="replace") if raw is not None else None
        for shown in tracebacks.feed(line) if line is not None else tracebacks.flush():
            sys.stdout.write(shown)
        sys.stdout.flush()
        if line is None:
            break
        failed_attempts += UNREACHABLE in line
        if failed_attempts == UNREACHABLE_AFTER:
            _say_once(_unreachable_line(arguments), said)
        if root_certificates is not None and not tls_probed and any(pattern in line for pattern in TLS_FAILED):
            tls_probed = True
            found = superlink_probe.probe(_superlink(arguments), root_certificates)
            if found is not None:  # more precise than Flower's words and the general hint: said instead
                said.add("CERTIFICATE_VERIFY_FAILED")
                _say_once(found, said)
        for pattern, hint in HINTS.items():
            if pattern in line and pattern not in said:
                said.add(pattern)
                _say(hint)


def _superlink(arguments: Sequence[str]) -> str:
    """The address the node dials: its --superlink, else Flower's default."""
    from flwr.supercore.constant import SUPERLINK_DEFAULT_CLIENT_ADDRESS

    return _option(arguments, "--superlink") or SUPERLINK_DEFAULT_CLIENT_ADDRESS


def _unreachable_line(arguments: Sequence[str]) -> str:
    """What answers at --superlink, after Flower failed to connect UNREACHABLE_AFTER times."""
    address, root_certificates = _superlink(arguments), _option(arguments, "--root-certificates")
    found = superlink_probe.probe(address, root_certificates)
    if found is not None:
        return found
    verified = f" and --root-certificates {root_certificates} verifies its certificate" if root_certificates else ""
    return (
        f"Flower's connection attempts fail, yet something answers at {address}{verified}: check that it is "
        "the SuperLink's Fleet API (or its proxy's, docs/deployment.md) and read Flower's lines above; Flower "
        "keeps retrying"
    )


def _say_once(text: str, said: set[str]) -> None:
    if text not in said:
        said.add(text)
        _say(text)


def _say(text: str) -> None:
    print(f"fedcond: {text}", file=sys.stderr, flush=True)

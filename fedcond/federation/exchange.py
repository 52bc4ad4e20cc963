"""Talking to the federation: check its size, ask clients a question, and tell why a client did not
answer (failed or timed out). Secure sums go through SecAgg+ (fedcond/federation/secagg_workflow.py)."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

from flwr.common import Code, GetPropertiesIns
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from fedcond import stopping
from fedcond.config import Option, RunConfig
from fedcond.errors import FedcondError
from fedcond.federation.messages import ERROR, PARTITION_ID, STEP, STEP_IDENTITY
from fedcond.federation.participation import FAILED, NODE_LEFT, TIMED_OUT

ROUND_TIMEOUT = Option(
    "round-timeout",
    3600,
    "seconds a client has to answer each instruction (the lifetime of Flower's message); 0: Flower's 12 hours",
    minimum=0,
)
NODE_TIMEOUT = Option(
    "node-timeout", 60, "seconds the server waits for all nodes to connect, before round 1", minimum=1
)

# How Flower's SuperLink says a message got no reply (the texts of its error replies, in
# flwr.server.superlink.linkstate.utils; importing that module costs seconds, so matched here and
# checked against it in the tests): the instruction or its reply outlived its lifetime, or was
# deleted with its node, or the node stopped sending heartbeats.
MESSAGE_UNAVAILABLE = "Message Unavailable"
REPLY_EXPIRED = "The reply message has expired"
NODE_UNAVAILABLE = "Node Unavailable"
# How Flower's legacy client proxy words an error reply, and how it words a ClientApp's exception.
FLOWER_WRAPPER = re.compile(r"Message contains an Error \(reason: (.*)\)\. It originated", re.DOTALL)
EXCEPTION_TEXT = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>:<'(.*)'>", re.DOTALL)
# How Flower's Ray actor wraps what a simulated ClientApp raised (flwr.clientapp.client_app).
CLIENT_APP_EXCEPTION = "ClientAppException"


def message_timeout(config: RunConfig) -> float | None:
    """``round-timeout`` as Flower takes it (a message's TTL): None for no limit of fedcond's own."""
    seconds = ROUND_TIMEOUT.of(config)
    return float(seconds) if seconds > 0 else None


def raised_by_client(error: BaseException | str) -> bool:
    """Whether a simulated client's own code raised ``error`` (rather than its Ray worker dying, its
    message going unanswered): a failure a stop cannot have made (``fedcond.stopping.settled``)."""
    return CLIENT_APP_EXCEPTION in str(error)


def failure_reason(error: BaseException | str) -> str:
    """The one line that says why a client failed, from what reached the server.

    Flower wraps what a ClientApp raised in its own words: ``Message contains an Error (reason:
    ...)`` around ``<class 'X'>:<'message'>`` (deployment) or a ``ClientAppException`` whose text
    ends in ``Message: <message>`` (simulation). A client's own ``FedcondError`` may also arrive
    inside a traceback. The reason is the client's message, with its exception's name unless it is
    a ``FedcondError`` (whose message names the fix).
    """
    text = str(error)
    if wrapped := FLOWER_WRAPPER.search(text):
        text = wrapped.group(1)
    for line in reversed(text.splitlines()):
        if "FedcondError:" in line:
            return line.split("FedcondError:", 1)[1].strip()
    if "Message: " in text:
        text = text.rsplit("Message: ", 1)[1].removesuffix("'>")
    elif raised := EXCEPTION_TEXT.fullmatch(text.strip()):
        name, message = raised.groups()
        text = message if name == "FedcondError" else f"{name}: {message}"
    return " ".join(text.split()) or type(error).__name__


def classify_failure(error: BaseException, seconds: float, timeout: float | None) -> tuple[str, str]:
    """(outcome, reason) of an instruction that raised after ``seconds``: timed out when its message
    outlived ``timeout``, failed with "node left" when its node went away, else failed with the
    client's own reason."""
    text = str(error)
    if NODE_UNAVAILABLE in text:
        return FAILED, NODE_LEFT
    if MESSAGE_UNAVAILABLE in text or REPLY_EXPIRED in text:
        if timeout is not None and seconds >= timeout:
            return TIMED_OUT, f"no answer within round-timeout={timeout:g} s"
        # Gone before its lifetime ended: Flower deleted it with its node.
        return FAILED, NODE_LEFT
    return FAILED, failure_reason(error)


def all_clients(client_manager: ClientManager, config: RunConfig) -> list[ClientProxy]:
    """Every node, after checking there is exactly one per client of the scenario (held-out ones included)."""
    expected = config.num_clients
    waited = NODE_TIMEOUT.of(config)
    # Flower's grid client manager learns of connected nodes when asked how many there are, else
    # only every 5 s: its wait_for slept up to those 5 s at the start of every run. Ask instead.
    deadline = time.monotonic() + waited
    while (found := client_manager.num_available()) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    if found != expected:
        held_out = f" + {config.held_out_clients} held-out" if config.held_out_clients else ""
        raise FedcondError(
            f"the federation has {found} nodes but num-clusters x (clients-per-cluster{held_out}) = "
            f"{config.num_clusters} x {config.clients_per_cluster + config.held_out_clients} = {expected} "
            f"(waited {waited} s); {missing_nodes(client_manager, expected, waited)}"
        )
    return list(client_manager.all().values())


def missing_nodes(client_manager: ClientManager, expected: int, timeout: float) -> str:
    """Which partitions have no node (the connected nodes are asked which they hold), and the fix, for
    a deployment and for a simulation."""
    answers = ask_each(list(client_manager.all().values()), {STEP: STEP_IDENTITY}, timeout)
    # An answer is the node's properties (a ConfigRecord through Flower's grid, a mapping either way) or
    # the one-line reason it gave none.
    held = {
        int(str(answer[PARTITION_ID])) for answer in answers if not isinstance(answer, str) and PARTITION_ID in answer
    }
    missing = [partition for partition in range(expected) if partition not in held]
    simulation = f'a simulation: --federation-config "num-supernodes={expected}"'
    if not missing:
        return (
            f"every partition 0..{expected - 1} has a node, and more nodes are connected: stop those whose "
            f"--node-config names another partition or run ({simulation}), or submit with settings for them"
        )
    shown = ", ".join(map(str, missing[:10])) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
    return (
        f"partition-id {shown} {'has' if len(missing) == 1 else 'have'} no node: start a SuperNode with "
        f'--node-config "partition-id={missing[0]} num-partitions={expected} ..." for each ({simulation}), '
        "or submit with settings for the nodes there are"
    )


def ask_each(
    proxies: list[ClientProxy], question: dict[str, object], timeout: float | None
) -> list[dict[str, object] | str]:
    """Ask every client ``question`` at once; each client's answer, or the one-line reason it gave none."""

    def ask(proxy: ClientProxy) -> dict[str, object] | str:
        started = time.monotonic()
        try:
            response = proxy.get_properties(GetPropertiesIns(config=question), timeout=timeout, group_id=0)
        except Exception as error:  # the client's exception, its node's departure or an expired message
            if not raised_by_client(error):
                stopping.settled("a client's failure to answer before round 1")
            return classify_failure(error, time.monotonic() - started, timeout)[1]
        if response.status.code != Code.OK:
            return failure_reason(response.status.message)
        if ERROR in response.properties:
            return str(response.properties[ERROR])
        return response.properties

    if not proxies:
        return []
    with ThreadPoolExecutor(max_workers=min(len(proxies), 16)) as pool:
        return list(pool.map(ask, proxies))


def ask_all(proxies: list[ClientProxy], question: dict[str, object], timeout: float | None) -> list[dict[str, object]]:
    """Every client's answer to ``question`` before round 1; the first failure stops the run (one line)."""
    answers = ask_each(proxies, question, timeout)
    for answer in answers:
        if isinstance(answer, str):
            raise FedcondError(f"a client failed to answer before round 1: {answer}")
    return answers  # type: ignore[return-value]

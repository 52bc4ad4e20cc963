"""The Flower ServerApp: validates the run, writes its results folder, runs the method's strategy.

A run the ServerApp stops (a refused setting, two nodes claiming one partition, too few answers)
ends with one line, ``fedcond: error: <reason>``, on its output, which Flower streams to whoever
submitted it (``flwr run --stream``), and with ``RunStopped``, which Flower's ServerApp runner
(simulation and deployment alike) records as the run's failure with that reason (``flwr list``:
``finished:failed``) before it exits, at once: a ``SystemExit`` would skip the runner's exit path,
leaving the SuperLink to wait a minute for the missing heartbeat and the last lines unsent.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Collection, Iterator

from flwr.common import Context
from flwr.common.logger import FLOWER_LOGGER
from flwr.server import Grid, ServerApp, ServerConfig
from flwr.server.compat import start_grid
from flwr.supercore.exit import add_exit_handler

from fedcond import stopping
from fedcond.config import RunConfig
from fedcond.data.scenarios import scenario_for
from fedcond.errors import FedcondError
from fedcond.federation import client_dp
from fedcond.federation.checks import check_run
from fedcond.federation.exchange import message_timeout
from fedcond.federation.methods import federated, run_config
from fedcond.federation.round_loop import CheckpointingServer
from fedcond.federation.server_method import StrategyInputs
from fedcond.federation.strategy import FedcondStrategy
from fedcond.fingerprint.encoder import load_encoder
from fedcond.model.store import CLIENT_STATE_DIR, remove_run_state
from fedcond.privacy import dp as privacy
from fedcond.privacy import secure_aggregation as secagg_settings
from fedcond.records.checkpoint import check_resumed_rounds, load_checkpoint, resume_folder, resumption_note, run_info
from fedcond.records.history import (
    STOPPED_STATUS,
    RunRecorder,
    error_line,
    failures_recorded,
    mark_failed,
    open_run,
    reopen_run,
)


def run_server(grid: Grid, config: RunConfig, given: Collection[str] | None = None) -> RunRecorder:
    """Everything the ServerApp does, given its settings; returns the run's recorder.

    With ``resume`` set, the run continues in that folder from its checkpoint (``check_run`` has
    refused a resume that cannot be). ``given``: the settings ``--run-config`` gave, the others
    being pyproject.toml's (None: unknown).
    """
    with served_run(config, grid, given) as (server, _, rounds_left):
        # `flwr stop` ends the run through Flower's exit handlers (its heartbeat raises SIGINT in the
        # ServerApp's process, deployed or `flwr run`'s simulation), with no exception here to record.
        folder = server.recorder.folder
        add_exit_handler(functools.partial(mark_failed, folder, stopped_reason(folder), STOPPED_STATUS))
        # Flower gives every fit and evaluate message round_timeout as its lifetime (TTL).
        server_config = ServerConfig(num_rounds=rounds_left, round_timeout=message_timeout(config))
        try:
            start_grid(grid=grid, server=server, config=server_config)
        finally:
            # Clients' own models of this Flower run (client-state-dir): no later run reads them.
            remove_run_state(CLIENT_STATE_DIR.of(config), grid.run.run_id)
    return server.recorder


@contextlib.contextmanager
def served_run(
    config: RunConfig, grid: Grid | None, given: Collection[str] | None = None
) -> Iterator[tuple[CheckpointingServer, FedcondStrategy, int]]:
    """A run's checks, results folder (a new one, or the resumed one), round loop, the method's
    strategy (inside Flower's DP wrapper where client-dp asks for one) and the rounds left to run.
    The body runs them (the ServerApp through ``grid``; the in-process runner,
    ``fedcond.tools.in_process``, with ``grid`` None, through proxies it registers); the run is
    recorded as finished after it, or as failed with the body's error."""
    method = check_run(config, given=given)
    _, strategy_class = federated(method)
    config = config.resolved()
    scenario = scenario_for(config)
    if method.conditioned and config.fingerprint_encoder != "pixels":
        # Trained (once, then cached) here, before any client needs it to compute its fingerprint.
        if config.verbose:
            print(f"fedcond: fingerprint encoder trained on {config.fingerprint_encoder} (cached after the first run)")
        load_encoder(config.fingerprint_encoder, config.resolved_data_dir())
    privacy_details = {
        "sample_level": privacy.describe(config, method.conditioned),
        "client_level": client_dp.describe(
            config, strategy_class.released_sums(config), strategy_class.client_dp_per_model
        ),
        "secure_aggregation": secagg_settings.describe(config),
    }
    folder = resume_folder(config)
    checkpoint = None
    if folder is None:
        recorder = open_run(
            config, scenario, method.name, method.summary, method.conditioned, extra={"privacy": privacy_details}
        )
    else:
        checkpoint = load_checkpoint(folder)
        if checkpoint is None:
            raise FedcondError(f"resume={folder}: its checkpoint went away; start the run again without resume")
        note = resumption_note(checkpoint, run_info(folder), method.state_lost_on_resume)
        recorder = reopen_run(config, folder, scenario.num_clusters, checkpoint.history, note)
    rounds_before = checkpoint.round if checkpoint else 0
    with failures_recorded(recorder):
        inputs = StrategyInputs(config, scenario.num_classes, method.conditioned, recorder, checkpoint, scenario, grid)
        strategy = FedcondStrategy(strategy_class(inputs))
        # Flower's DP wrapper around the strategy, when client-dp asks for one.
        server = CheckpointingServer(strategy, recorder, rounds_before, client_dp.with_client_dp(strategy, config))
        yield server, strategy, config.num_server_rounds - rounds_before
        recorder.finish({"secure_sum_bytes": strategy.secure_sum_bytes, "checkpoint": server.checkpoint_cost()})


def stopped_reason(folder: object) -> str:
    """run.json's error of a run Flower stopped from outside (``flwr stop``, a signal to its process)."""
    return (
        f"stopped before it finished (flwr stop, or a signal to the ServerApp's process); resume={folder} "
        "with num-server-rounds continues it"
    )


class RunStopped(Exception):
    """The ServerApp stopped the run; ``str(self)`` is its one-line reason, already printed and in run.json."""


class _WithoutTraceback(logging.Filter):
    """Flower logs a ServerApp's exception with its traceback: a ``RunStopped`` has said its one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], RunStopped))


FLOWER_LOGGER.addFilter(_WithoutTraceback())

#: Flower's line for a round with no evaluate message. fedcond's training clients evaluate a round's
#: model in the next round's fit (evaluate-in-fit), so most rounds send none by design and the line,
#: one per round, reads as if evaluation were off.
NO_EVALUATION_LINE = "configure_evaluate: no clients selected, skipping evaluation"


class _WithoutSkippedEvaluation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != NO_EVALUATION_LINE


FLOWER_LOGGER.addFilter(_WithoutSkippedEvaluation())


def make_server_app(config: RunConfig | None = None) -> ServerApp:
    """A ServerApp reading its settings from the run config, or from ``config`` when given (tests)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            settings, given = config, None
            if settings is None:  # from the run config Flower merged with pyproject.toml's defaults
                settings = run_config(context.run_config)
                # The keys `--run-config` gave: a refused resume's advice tells them from pyproject's.
                given = grid.run.override_config.keys()
                check_resumed_rounds(settings, given)
            run_server(grid, settings, given)
        except stopping.Interrupted as interrupted:
            # A compare's or sweep's stop (Ctrl+C, SIGTERM): the round under way is dropped, the main
            # thread shuts the run down and says so in run.json (fedcond.records.history.mark_stopped).
            print(f"fedcond: {interrupted}", file=sys.stderr, flush=True)
        except Exception as error:
            # Any failure (a FedcondError, or an unexpected one such as a client's error at the
            # secure-sum step) ends here as one line: run.json already says failed (failures_recorded).
            line = error_line(error)
            print(f"fedcond: error: {line}", file=sys.stderr, flush=True)
            raise RunStopped(line) from None

    return app


app = make_server_app()

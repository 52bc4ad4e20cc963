"""The Flower ServerApp: validates the run, writes its results folder, runs the method's strategy."""

from __future__ import annotations

import sys

from flwr.common import Context
from flwr.server import Grid, ServerApp, ServerConfig
from flwr.server.compat import start_grid

from fedcond.config import RunConfig
from fedcond.encoder import load_encoder
from fedcond.history import RunRecorder, error_line, failures_recorded, open_run
from fedcond.scenarios import scenario_for
from strategies.base import StrategyInputs
from strategies.federation import message_timeout
from strategies.registry import check_run, federated, run_config


def run_server(grid: Grid, config: RunConfig) -> RunRecorder:
    """Everything the ServerApp does, given its settings; returns the run's recorder."""
    method = check_run(config)
    _, strategy_class = federated(method)
    config = config.resolved()
    scenario = scenario_for(config)
    if method.conditioned and config.fingerprint_encoder != "pixels":
        # Trained (once, then cached) here, before any client needs it to compute its fingerprint.
        if config.verbose:
            print(f"fedcond: fingerprint encoder trained on {config.fingerprint_encoder} (cached after the first run)")
        load_encoder(config.fingerprint_encoder, config.resolved_data_dir())
    recorder = open_run(config, scenario, method.name, method.summary, method.conditioned)
    with failures_recorded(recorder):
        strategy = strategy_class(StrategyInputs(config, scenario.num_classes, method.conditioned, recorder))
        # Flower gives every fit and evaluate message round_timeout as its lifetime (TTL).
        server_config = ServerConfig(num_rounds=config.num_server_rounds, round_timeout=message_timeout(config))
        start_grid(grid=grid, strategy=strategy, config=server_config)
    return recorder


def make_server_app(config: RunConfig | None = None) -> ServerApp:
    """A ServerApp reading its settings from the run config, or from ``config`` when given (tests)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_server(grid, config or run_config(context.run_config))
        except Exception as error:
            # Any failure (a FedcondError, or an unexpected one such as a client's error at the
            # secure-sum step) ends here as one line: run.json already says failed (failures_recorded),
            # and SystemExit ends an in-process simulation quietly, so compare and sweep go on.
            print(f"fedcond: error: {error_line(error)}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    return app


app = make_server_app()

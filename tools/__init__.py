"""This repository's record tooling, run from a checkout (``python -m tools.<module>``) and never
installed: the wheel and the Flower app ship ``fedcond`` alone (pyproject.toml).

``tools.docs`` regenerates the files generated from the code's declarations (pyproject.toml's
``[tool.flwr.app.config]``, docs/settings.md, the method tables); ``tools.reproduction`` writes
experiments/REPRODUCTION.md with the claims' verdict table (``tools.claims``) and the README's verdict
lines; ``tools.prose_numbers`` checks the numbers typed into the docs against the committed runs.
``tools`` imports ``fedcond``; ``fedcond`` never imports ``tools`` (tests/test_layers.py).
"""

from collections.abc import Callable


def reported(command: str, work: Callable[[], object]) -> int:
    """A tool's exit status for ``work``: 0, or 2 with a user-fixable problem printed as one line
    ("command: error: ..."), never a traceback."""
    from fedcond.errors import FedcondError

    try:
        work()
    except FedcondError as error:
        import sys

        print(f"{command}: error: {error}", file=sys.stderr)
        return 2
    return 0

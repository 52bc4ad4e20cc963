"""``fedcond.clients``: the methods' client sides, whose files are the top-level clients/ folder.

In a checkout (and in the FAB Flower ships, the same layout) this package is a portal: its modules are
read from ../../clients/, so that the methods keep the design card's top-level folder and have one
import name, ``fedcond.clients.<method>``, everywhere. A built wheel maps clients/ into this package
directly (pyproject.toml, ``[tool.setuptools.package-dir]``) and holds no portal.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "clients")]

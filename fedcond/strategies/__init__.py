"""``fedcond.strategies``: the methods' server sides, whose files are the top-level strategies/ folder.

In a checkout (and in the FAB Flower ships, the same layout) this package is a portal: its modules are
read from ../../strategies/, so that the methods keep the design card's top-level folder and have one
import name, ``fedcond.strategies.<method>``, everywhere. A built wheel maps strategies/ into this
package directly (pyproject.toml, ``[tool.setuptools.package-dir]``) and holds no portal.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "strategies")]

"""The project as a wheel: a plain ``pip install .`` (not editable) gets every module.

``make`` installs in editable mode, which reads the source tree and so hides a package left out of
the build; this builds the wheel from a copy of the project and imports every module from it.
"""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedcond", "clients", "strategies")


@pytest.mark.slow
def test_a_built_wheel_holds_and_imports_every_module(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    # A copy: building in the checkout would leave build/ and *.egg-info behind in it.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", dist, source],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("fedcond-*.whl")
    modules = {path.relative_to(source).as_posix() for package in PACKAGES for path in (source / package).rglob("*.py")}
    assert modules - set(zipfile.ZipFile(wheel).namelist()) == set()

    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    names = sorted(module.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for module in modules)
    check = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(installed)!r}), (name, module.__file__)\n"
    )
    # From a folder outside the checkout, the unpacked wheel first on the path.
    environment = {**os.environ, "PYTHONPATH": str(installed)}
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=environment, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]

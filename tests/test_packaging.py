"""The project as a wheel: a plain ``pip install .`` (not editable) gets every module and runs.

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
#: The checkout's record tooling (claims, prose numbers, generated docs): in the build's source, as in
#: the checkout, and never in the wheel.
NOT_INSTALLED = ("tools",)
#: Where each folder of the checkout lies in the wheel: the methods' folders inside fedcond.
INSTALLED_AS = {"fedcond": "fedcond", "clients": "fedcond/clients", "strategies": "fedcond/strategies"}
#: The portals that lead a checkout's fedcond.clients and fedcond.strategies to the top-level folders.
PORTALS = {"fedcond/clients/__init__.py", "fedcond/strategies/__init__.py"}


def installed_path(path: str) -> str:
    folder, _, rest = path.partition("/")
    return f"{INSTALLED_AS[folder]}/{rest}"


@pytest.mark.slow
def test_a_built_wheel_holds_and_imports_every_module(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    # A copy: building in the checkout would leave build/ and *.egg-info behind in it.
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, source / name)
    for package in (*PACKAGES, *NOT_INSTALLED):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", dist, source],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("fedcond-*.whl")
    checkout = {
        path.relative_to(source).as_posix() for package in PACKAGES for path in (source / package).rglob("*.py")
    }
    modules = {installed_path(path) for path in checkout - PORTALS}
    listed = set(zipfile.ZipFile(wheel).namelist())
    assert modules - listed == set()
    # No record tooling of this repository: no tools package, and none of its modules (the claims, the
    # prose-number checks, the method-doc generator) anywhere inside fedcond either.
    record_tooling = {path.name for path in (ROOT / "tools").glob("*.py")} - {"__init__.py"}
    assert {"claims.py", "prose_numbers.py", "method_docs.py"} <= record_tooling
    assert sorted(name for name in listed if name.split("/")[0] in NOT_INSTALLED) == []
    assert sorted(name for name in listed if name.rsplit("/", 1)[-1] in record_tooling) == []
    # One top-level package: no `clients` or `strategies` beside a user's own packages.
    assert {name.split("/")[0] for name in listed} == {"fedcond", "fedcond-0.1.0.dist-info"}
    # The wheel's fedcond.strategies is the methods' folder itself, not the checkout's portal.
    assert "__path__" not in zipfile.ZipFile(wheel).read("fedcond/strategies/__init__.py").decode()

    installed = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(installed)
    names = sorted(module.removesuffix(".py").replace("/", ".").removesuffix(".__init__") for module in modules)
    check = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    module = importlib.import_module(name)\n"
        f"    assert module.__file__.startswith({str(installed)!r}), (name, module.__file__)\n"
    )
    # From a folder outside the checkout, the unpacked wheel first on the path. (Not a fresh virtual
    # environment: installing torch and Flower into one takes minutes; this one's packages serve.)
    environment = {**os.environ, "PYTHONPATH": str(installed)}

    def run(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *arguments], cwd=tmp_path, env=environment, capture_output=True, text=True
        )

    result = run("-c", check)
    assert result.returncode == 0, result.stderr[-2000:]
    listed = run("-m", "fedcond.tools.cli", "list")
    assert listed.returncode == 0 and "fedavg (one global" in listed.stdout, listed.stderr[-2000:]
    # A run needs no pyproject.toml: its defaults come from the settings' declarations.
    small = ("num-server-rounds=1", "num-clusters=2", "clients-per-cluster=2")
    compared = run("-m", "fedcond.tools.cli", "compare", "--dataset", "digits", "--methods", "fedavg",
                   "--runner", "in-process", "--out", "out", *small)  # fmt: skip
    assert compared.returncode == 0, compared.stderr[-2000:]
    assert '"status": "finished"' in (tmp_path / "out" / "runs" / "method-fedavg_seed-0" / "run.json").read_text()
    # Outside a checkout there is no Flower app for `flwr run`: the run and its dry run refuse alike.
    ran, dry = run("-m", "fedcond.tools.cli", "run", *small), run("-m", "fedcond.tools.cli", "run", "--dry-run", *small)
    assert "no Flower app" in ran.stderr and ran.returncode != 0, ran.stderr[-2000:]
    assert (dry.returncode, dry.stderr) == (ran.returncode, ran.stderr)

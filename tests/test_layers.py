"""The layers: the core knows nothing of Flower, and no module imports itself back round a circle."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What the wheel installs (fedcond, the methods' folders inside it) and the checkout's record tooling.
INSTALLED = ("fedcond", "clients", "strategies")
PACKAGES = (*INSTALLED, "tools")


#: The methods' folders: top-level in the checkout, imported as fedcond.clients and fedcond.strategies.
METHOD_PACKAGES = ("fedcond.clients", "fedcond.strategies")


def module_name(path: Path) -> str:
    """A file's import name: strategies/x.py is fedcond.strategies.x (the portal's package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join(("fedcond", *parts) if parts[0] in ("clients", "strategies") else parts)


def project_modules() -> dict[str, Path]:
    """Every module by its import name (the methods' folders, not the portals leading to them)."""
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if path.parent.relative_to(ROOT).as_posix() not in ("fedcond/clients", "fedcond/strategies")}  # fmt: skip


#: The layers above the core: the round protocol (Flower's adapters) and the command line on top.
ABOVE_THE_CORE = ("fedcond.federation", "fedcond.tools", *METHOD_PACKAGES)
#: The protocol's client side: what a ClientApp process imports (never the server's modules).
CLIENT_SIDE = {
    f"fedcond.federation.{name}"
    for name in ("client_app", "client", "client_state", "secagg_mod", "clipping_mod", "messages", "participation")
}


def core_modules() -> list[str]:
    """Everything in fedcond/ except the round protocol and the tools on top."""
    return sorted(
        name for name in project_modules() if name.startswith("fedcond") and not name.startswith(ABOVE_THE_CORE)
    )


def server_side_modules() -> list[str]:
    """The protocol's server side: every module of fedcond.federation a ClientApp never needs."""
    return sorted(
        name for name in project_modules()
        if name.startswith("fedcond.federation.") and name not in CLIENT_SIDE and name != "fedcond.federation"
    )  # fmt: skip


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in the file (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


@pytest.mark.slow
def test_the_core_imports_neither_flower_nor_the_flower_layer():
    script = (
        "import sys\n"
        f"for name in {core_modules()!r}:\n"
        "    __import__(name)\n"
        f"above = ('flwr', *{ABOVE_THE_CORE!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith(above)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "fedcond.model.training" in core_modules() and "fedcond.tools.cli" not in core_modules()
    assert "fedcond.federation.server_app" not in core_modules()
    assert result.stdout.strip() == "[]"


def test_no_import_circle_between_the_projects_modules():
    modules = project_modules()
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    # A package's __init__ is imported with its modules: an edge to it is no dependency of substance.
    graph = {
        name: {target for target in targets if modules[target].name != "__init__.py"} for name, targets in graph.items()
    }
    circles, state = [], dict.fromkeys(graph, 0)

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state[target] == 1:
                circles.append([*trail[trail.index(target) :], target])
            elif state[target] == 0:
                visit(target, [*trail, target])
        state[name] = 2

    for name in sorted(graph):
        if state[name] == 0:
            visit(name, [name])
    assert not circles, circles


def imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports (``import``, absolute ``from``), and every text it could hand
    ``importlib.import_module`` or ``__import__`` that names a module of the checkout's tools/."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] == "tools":
            found.add(node.value)
    return found


def test_nothing_installed_imports_the_checkouts_tools():
    """tools/ (claims, prose numbers, generated docs) runs from a checkout and is never installed: no
    module of fedcond, or of the methods' folders installed in it, imports it, so an installed fedcond
    never reaches for a package it does not have. tools/ imports fedcond."""
    offending = {
        path.relative_to(ROOT).as_posix(): sorted(
            name for name in imported_names(path) if name.split(".")[0] == "tools"
        )
        for package in INSTALLED
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in offending.items() if names} == {}
    assert any(name.startswith("fedcond.") for name in imported_names(ROOT / "tools" / "claims.py"))


def test_the_layers_point_one_way():
    modules = project_modules()
    core, server_side = set(core_modules()), set(server_side_modules())
    for name, path in modules.items():
        imported = imports_of(path, set(modules))
        if name in core:
            assert not any(target.startswith(ABOVE_THE_CORE) for target in imported), (name, imported)
        if name.startswith((*METHOD_PACKAGES, "fedcond.federation")):
            assert not any(target.startswith("fedcond.tools") for target in imported), (name, imported)
        if name.startswith("fedcond.clients") or name in CLIENT_SIDE:
            # The ClientApp finds the method's client by its name: nothing of the server's.
            server = {t for t in imported if t.startswith("fedcond.strategies") or t in server_side}
            assert not server, (name, server)
    # The method table finds the methods' modules by name and imports them when asked: it imports no
    # client or strategy when it is imported.
    tree = ast.parse(modules["fedcond.federation.methods"].read_text())
    top = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)] + [
        alias.name for n in tree.body if isinstance(n, ast.Import) for alias in n.names
    ]
    assert not [name for name in top if name and name.startswith(METHOD_PACKAGES)], top


@pytest.mark.slow
def test_a_clientapp_process_imports_no_server_or_report_libraries():
    """A deployed ClientApp is a new process per message (Flower 1.42): every import is paid twice a
    round on every node. Building every method's client (each found by its name, a named variant's
    settings applied) loads its own client class and no strategy:
    scikit-learn (IFCA's ARI), scipy's sparse SVD (computing a fingerprint, once per node), plotting,
    the tools, the server's strategies and the protocol's server side stay out of it."""
    from fedcond.federation.methods import flower_method_names

    script = (
        "import sys\n"
        "from fedcond.federation import client_app\n"
        "from flwr.common import Context, RecordDict\n"
        f"for method in {flower_method_names()!r}:\n"
        "    context = Context(0, 0, {'partition-id': 0, 'num-partitions': 4}, RecordDict(), {})\n"
        "    settings = {'method': method, 'num-clusters': 2, 'clients-per-cluster': 2}\n"
        "    client_app.build_client(context, client_app.client_run_config(settings))\n"
        "heavy = ('sklearn', 'scipy.stats', 'scipy.sparse.linalg', 'matplotlib', 'fedcond.tools', 'ray')\n"
        f"heavy += ('fedcond.strategies', *{server_side_modules()!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    from fedcond.data.datasets import load_dataset

    load_dataset("digits", None)  # decoded into the shared cache here, as a deployed node finds its data
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"


def test_clients_and_strategies_import_nothing_of_each_other():
    """The Flower adapters stay apart: what runs both (the in-process simulation) sits with the tools;
    the ClientApp finds its method's client by name (``fedcond.variants.client_path``)."""
    modules = project_modules()

    def side(module: str) -> str | None:
        return next((package for package in METHOD_PACKAGES if module.startswith(package + ".")), None)

    across = {
        (name, target)
        for name, path in modules.items()
        for target in imports_of(path, set(modules))
        if {side(name), side(target)} == set(METHOD_PACKAGES)
    }
    assert across == set()


#: The core's concerns, one package each; what sits directly under fedcond/ beside them stays a handful.
CONCERNS = ("data", "fingerprint", "model", "privacy", "records")


def test_the_core_is_filed_by_concern():
    top_modules = sorted(path.stem for path in (ROOT / "fedcond").glob("*.py"))
    packages = sorted(path.parent.name for path in (ROOT / "fedcond").glob("*/__init__.py"))
    assert set(CONCERNS) <= set(packages), packages
    assert len(top_modules) <= 12, f"{len(top_modules)} modules directly under fedcond/: file them by concern"


def test_strategies_and_clients_hold_only_methods():
    """A method is its strategy module (``METHOD``) and its client module (``Client``), found by name:
    the protocol they share lives in fedcond/federation/, never beside them."""
    for folder, name in (("strategies", "\nMETHOD = Declaration("), ("clients", "\nClient = ")):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name != "__init__.py":
                assert name in path.read_text(), f"{folder}/{path.name} is no method: move it to fedcond/federation/"


#: The most methods one class of the project may define: a class past it does several things
#: (the round protocol and the method hooks were one 37-method class before they were composed).
MOST_METHODS_PER_CLASS = 20


def test_no_class_has_more_than_twenty_methods():
    crowded = []
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined = [item for item in node.body if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)]
                if len(defined) > MOST_METHODS_PER_CLASS:
                    crowded.append(f"{name}.{node.name}: {len(defined)}")
    assert not crowded, f"split these classes by concern: {crowded}"

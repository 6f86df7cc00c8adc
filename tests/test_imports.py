"""What edged's modules import: no circle anywhere, settings that load no runtime, and ``edged run``
without the offline tools, their ONNX dependencies, OpenVINO or paho."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import free_port, write_config
from onnx_models import colour_probe

PACKAGE = Path(__file__).resolve().parent.parent / "edged"
DEMO_MODEL = PACKAGE.parent / "models" / "demo.onnx"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[ast.AST]:
    """The nodes under ``if TYPE_CHECKING:``: imports a type checker reads and Python never runs."""
    hidden: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                hidden.update(ast.walk(child))
    return hidden


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the package's modules importing it runs.

    Every ``import``, at any level (a function's own imports too: they run when it does), with
    relative imports resolved; importing ``edged.a.b`` also runs the package ``edged.a`` first. The
    root package, which imports nothing, is left out; so is what only a type checker reads.
    """
    modules = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_only(tree)
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        named: set[str] = set()
        for node in ast.walk(tree):
            if node in hidden:
                continue
            if isinstance(node, ast.Import):
                named.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                named.add(target)
                named.update(f"{target}.{alias.name}" for alias in node.names)
        runs = {".".join(t.split(".")[:i]) for t in named for i in range(2, len(t.split(".")) + 1)}
        graph[name] = {m for m in runs if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports, each as the modules on it (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            component.append(v)
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_circle_through_a_package_and_a_lazy_import(tmp_path: Path) -> None:
    package = tmp_path / "edged"
    (package / "kinds").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "kinds" / "__init__.py").write_text("from edged.kinds.one import One\n")  # a registry in __init__
    (package / "kinds" / "one.py").write_text("from edged.kinds.base import Base\nclass One(Base): ...\n")
    (package / "kinds" / "base.py").write_text("class Base: ...\n")
    (package / "a.py").write_text("def f():\n    from edged import b\n")
    (package / "b.py").write_text("from . import a\n")
    assert cycles(import_graph(package)) == [["edged.a", "edged.b"], ["edged.kinds", "edged.kinds.one"]]


def _loaded_after(statements: str, *argv: str) -> set[str]:
    """Every module a fresh interpreter has loaded once it ran ``statements`` (with ``argv``)."""
    code = f"import sys\n{statements}\nprint('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


@pytest.mark.integration
def test_the_settings_load_nothing_of_the_runtime_no_camera_library_and_no_network() -> None:
    modules = _loaded_after("import edged.config")
    edged = {m for m in modules if m.split(".")[0] == "edged" and not m.startswith("edged.settings")}
    assert edged == {"edged", "edged.config", "edged.errors"}  # and the sections in edged/settings/
    runtime = ("numpy", "cv2", "zmq", "onnxruntime", "openvino", "paho", "prometheus_client", "asyncua", "pymodbus")
    assert {m for m in modules if m.split(".")[0] in runtime} == set()
    assert "http.server" not in modules


@pytest.mark.integration
def test_the_reject_line_process_loads_no_numpy_and_no_camera_library() -> None:
    """`python -m edged.reject`, a process per camera with a reject line: numpy alone is 12 MB of it."""
    modules = _loaded_after("import edged.reject")
    assert {m for m in modules if m.split(".")[0] in ("numpy", "cv2", "zmq", "onnxruntime", "openvino")} == set()


# In a fresh interpreter: the command line as `edged run` parses it, the daemon, and camera sources
# built and opened the way the capture thread does it; then every module that got imported.
RUN_IMPORTS = """
from pathlib import Path
from edged.cli import main
main(["run", "--config", sys.argv[1]])  # a missing config: stops after parsing, with exit 78
import edged.daemon
from edged.settings.sources import FileSourceConfig, SyntheticSourceConfig
from edged.sources.registry import open_source
open_source(FileSourceConfig(path=Path(sys.argv[1])))
synthetic = open_source(SyntheticSourceConfig(width=64, height=64))
synthetic.open()
synthetic.close()
"""


@pytest.mark.integration
def test_edged_run_imports_no_tool_no_onnx_no_openvino_and_without_mqtt_no_paho_nor_without_opcua_asyncua(
    tmp_path: Path,
) -> None:
    modules = _loaded_after(RUN_IMPORTS, str(tmp_path / "missing.toml"))
    assert {"edged.daemon", "edged.sources.file", "edged.sources.scenes"} <= modules  # the synthetic camera painted
    tools = {m for m in modules if m == "edged.tools" or m.startswith("edged.tools.")}
    onnx = {m for m in modules if m.split(".")[0] in ("onnx", "sympy")}
    paho = {m for m in modules if m.split(".")[0] == "paho"}  # imported only for an [mqtt] section
    openvino = {m for m in modules if m.split(".")[0] == "openvino" or m == "edged.engine_openvino"}  # model.engine
    asyncua = {m for m in modules if m.split(".")[0] == "asyncua" or m == "edged.opcua_server"}  # only for [opcua]
    assert tools == set() and onnx == set() and paho == set() and openvino == set() and asyncua == set()


# The outputs of a configuration started as `edged run` starts them, then every module imported.
OUTPUTS_IMPORTS = """
import threading
from pathlib import Path
from edged.config import load_config
from edged.output import Services
from edged.outputs import Outputs
outputs = Outputs(load_config(Path(sys.argv[1])), Services(lambda: None, threading.Event()))
outputs.close()
"""


@pytest.mark.integration
@pytest.mark.parametrize("on", [False, True])
def test_the_http_server_and_prometheus_load_only_with_an_http_listen_address(tmp_path: Path, on: bool) -> None:
    """Some 40 ms of CPU at every start, and their memory, spared where the live view is off."""
    listen = f"127.0.0.1:{free_port()}" if on else ""
    sections = {
        "model": {"path": str(DEMO_MODEL)},
        "publish": {"endpoints": ["tcp://127.0.0.1:0"]},
        "http": {"listen": listen},
    }
    config = write_config(tmp_path / "edged.toml", {"source": {"type": "synthetic"}, **sections})
    modules = _loaded_after(OUTPUTS_IMPORTS, str(config))
    server = {m for m in modules if m.split(".")[0] == "prometheus_client"} | {"http.server", "edged.http_server"} & modules
    assert bool(server) == on, server
    assert "edged.publish" in modules  # the outputs were made


# numpy imported after edged, then the threads the process has: its own and OpenBLAS's workers.
BLAS_THREADS = """
import os
import edged.config
import numpy
print(len(os.listdir("/proc/self/task")))
"""


@pytest.mark.integration
@pytest.mark.parametrize(("environment", "threads"), [({}, 1), ({"OPENBLAS_NUM_THREADS": "2"}, 2)])
def test_numpy_in_edged_starts_no_blas_threads_unless_the_environment_asks(
    environment: dict[str, str], threads: int
) -> None:
    """Left to itself OpenBLAS would start one thread per core (two here, the count asked for below)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"} | environment
    result = subprocess.run([sys.executable, "-c", BLAS_THREADS], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == threads


# A session as `edged run` makes one, in a process that imported edged first.
ONE_SESSION = """
import sys
import edged.engine
import onnxruntime
onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
"""


# ONNX Runtime and OpenVINO report nothing where one of these says they run on a build service, and
# ONNX Runtime keeps its cache under XDG_CACHE_HOME where that is set: the checks below run without
# them, or they could not fail on such a service.
TELEMETRY_ENVIRONMENT = {
    "ORT_DISABLE_TELEMETRY",
    "XDG_CACHE_HOME",
    "CI",
    "TF_BUILD",
    "GITHUB_ACTIONS",
    "GITLAB_CI",
    "CIRCLECI",
    "TRAVIS",
    "JENKINS_URL",
    "CODEBUILD_BUILD_ID",
    "BUILDKITE",
    "TEAMCITY_VERSION",
    "APPVEYOR",
    "BITBUCKET_BUILD_NUMBER",
}


def as_on_a_board(home: Path) -> dict[str, str]:
    """This process's environment with `home` as $HOME and nothing that turns telemetry off."""
    return {k: v for k, v in os.environ.items() if k not in TELEMETRY_ENVIRONMENT} | {"HOME": str(home)}


@pytest.mark.integration
@pytest.mark.parametrize(("environment", "reported"), [({}, False), ({"ORT_DISABLE_TELEMETRY": "0"}, True)])
def test_onnx_runtime_in_edged_reports_nothing_unless_the_environment_asks(
    tmp_path: Path, environment: dict[str, str], reported: bool
) -> None:
    """ONNX Runtime's own builds keep a device id and queue events for Microsoft under $HOME; in
    edged they do neither, unless ORT_DISABLE_TELEMETRY says otherwise (as here, to show they would)."""
    colour_probe(tmp_path / "model.onnx")
    env = as_on_a_board(tmp_path) | environment
    result = subprocess.run(
        [sys.executable, "-c", ONE_SESSION, str(tmp_path / "model.onnx")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / ".cache" / "Microsoft").exists() == reported, sorted(p.name for p in tmp_path.rglob("*"))


@pytest.mark.integration
def test_openvino_in_edged_keeps_no_usage_record(tmp_path: Path) -> None:
    """Importing openvino made a client id and a usage count under $HOME for its model converter's
    telemetry, and logged three warnings where $HOME may not be written (the service's)."""
    code = "import edged.engine_openvino, openvino; print(openvino.get_version())"
    env = as_on_a_board(tmp_path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.iterdir()), sorted(str(p) for p in tmp_path.rglob("*"))

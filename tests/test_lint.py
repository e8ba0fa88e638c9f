"""The repository's structure, checked: ruff (its default rules plus import sorting) is clean, the
import-linter contracts of pyproject.toml hold, a deliberate layering violation breaks them, and
only the device layer touches the C++ extension ``rdmaflow._core``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "rdmaflow"
# The device layer: the only modules that import the extension itself.
DEVICE_LAYER = {"__init__.py", "device.py", "arena.py", "_cuda_ipc.py", "_views.py", "errors.py", "deadline.py"}

# Runs import-linter on the package found in sys.argv[1] rather than on the editable install
# (whose import hook would otherwise win over sys.path); it runs there too, because import-linter
# puts the working directory first on sys.path.
LINT_IMPORTS = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path.insert(0, sys.argv[1])
from importlinter.cli import lint_imports
sys.exit(lint_imports(config_filename=sys.argv[2], no_cache=True, no_logo=True))
"""


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT_IMPORTS, str(tree), str(ROOT / "pyproject.toml")],
                          cwd=tree, capture_output=True, text=True, timeout=300, check=False)


def test_ruff_is_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout, r.stdout


def test_a_layering_violation_breaks_the_contract(tmp_path):
    """The check can fail: the transfer layer importing the parameter server is reported."""
    shutil.copytree(PACKAGE, tmp_path / "rdmaflow", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(tmp_path / "rdmaflow" / "transfer" / "common.py", "a") as f:
        f.write("\nimport rdmaflow.ps  # a deliberate violation\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "rdmaflow.transfer is not allowed to import rdmaflow.ps" in r.stdout, r.stdout


def _imports_core(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "rdmaflow" and any(
                a.name == "_core" for a in node.names) or isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rdmaflow._core") or isinstance(node, ast.Import) and any(a.name.startswith("rdmaflow._core") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_only_the_device_layer_imports_the_extension():
    # import-linter cannot see a compiled module, so this one is checked here.
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(PACKAGE.rglob("*.py"))
                 if p.relative_to(PACKAGE).as_posix() not in DEVICE_LAYER for n in _imports_core(p)]
    assert not offenders, "upper layers import rdmaflow._core (use the names `rdmaflow` exports): " + ", ".join(
        offenders)


def test_the_extension_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rdmaflow import _core\nimport rdmaflow._core\nfrom rdmaflow._core import Device\n")
    assert _imports_core(bad) == [1, 2, 3]


def test_an_import_circle_breaks_the_contract(tmp_path):
    """The check can fail: two modules of one package that import each other (even inside a
    function) are reported."""
    shutil.copytree(PACKAGE, tmp_path / "rdmaflow", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(tmp_path / "rdmaflow" / "graph" / "report.py", "a") as f:
        f.write("\n\ndef _legend():\n    from rdmaflow.graph import analysis  # a deliberate circle\n    return analysis\n")
    r = lint_imports(tmp_path)
    assert r.returncode != 0, r.stdout
    assert "no import circle" in r.stdout and "BROKEN" in r.stdout, r.stdout
    assert "No cycles are allowed in rdmaflow.graph" in r.stdout and ".report -> .analysis" in r.stdout, r.stdout

"""shoal.protocol stays light: standard library and msgpack only, no pickle, torch kept in one module.

Run: .venv/bin/python -m pytest tests/test_protocol_purity.py -q
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import shoal.protocol

PACKAGE_DIR = Path(shoal.protocol.__file__).parent
TORCH_MODULE = "torch_tensors"
HEAVY = ("torch", "hivemind", "numpy")
UNSAFE = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}

_PROBE = """
import json, pkgutil, sys, importlib
import shoal.protocol
pure = sorted(sys.modules)
for info in pkgutil.iter_modules(shoal.protocol.__path__):
    if info.name != "torch_tensors":
        importlib.import_module("shoal.protocol." + info.name)
print(json.dumps({"after_init": pure, "after_all": sorted(sys.modules)}))
"""


def _imports(path: Path) -> set[str]:
    """Top-level names of every module a file imports (relative imports as '.name')."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("." + (node.module or ""))
                names |= {"." + alias.name for alias in node.names if not node.module}
            else:
                names.add(node.module or "")
    return names


def test_importing_the_protocol_loads_neither_torch_nor_hivemind() -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True)
    loaded = json.loads(result.stdout)
    for stage in ("after_init", "after_all"):
        heavy = [m for m in loaded[stage] if m.split(".")[0] in HEAVY]
        assert heavy == [], f"{stage}: importing shoal.protocol loaded {heavy[:5]}"
    assert "shoal.protocol.torch_tensors" not in loaded["after_all"]
    assert "msgpack" in loaded["after_init"]


def test_modules_import_only_the_standard_library_msgpack_and_each_other() -> None:
    files = sorted(PACKAGE_DIR.glob("*.py"))
    assert {f.stem for f in files} >= {
        "__init__",
        "codec",
        "errors",
        "limits",
        "messages",
        "tensors",
        "version",
    }
    for path in files:
        for name in _imports(path):
            root = name.split(".")[0]
            if path.stem == TORCH_MODULE and root == "torch":
                continue
            assert name.startswith(".") or root in sys.stdlib_module_names or root == "msgpack", (
                f"{path.name} imports {name}"
            )


def test_nothing_imports_the_torch_module_and_nothing_uses_pickle() -> None:
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        names = _imports(path)
        assert not {n.split(".")[-1] for n in names} & {TORCH_MODULE}, f"{path.name} imports torch_tensors"
        assert not {n.lstrip(".").split(".")[0] for n in names} & UNSAFE, f"{path.name} imports a pickler"
        assert "pickle" not in path.read_text(), f"{path.name} mentions pickle"

"""The package reads its ODC_* environment in one place, torch_odc_backend/config.py: no other
module of it reads an ODC_ variable (os.environ[...], os.environ.get / pop / setdefault,
os.getenv, ``in os.environ``), by a literal name, an f-string starting with ODC_, or a name
bound to such a literal (in the module, or a constant of config.py). Writes are fine
(emulate_hosts sets ODC_HOST_SIZE for the script it runs). And the decoupled-mode hooks use
the state's public guard, not its private methods."""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "torch_odc_backend"

_READ_METHODS = {"get", "pop", "setdefault", "__getitem__", "__contains__"}


def _odc_constants(tree: ast.AST) -> dict[str, str]:
    """Names bound anywhere in ``tree`` to an ODC_ string literal (NAME = "ODC_...")."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant):
            value = node.value.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if isinstance(value, str) and value.startswith("ODC_"):
                out.update({t.id: value for t in targets if isinstance(t, ast.Name)})
    return out


def env_reads(path: Path, config_constants: dict[str, str], base: Path = ROOT) -> list[str]:
    """``file:line: source`` of each read of an ODC_ variable in the module at ``path``."""
    text = path.read_text()
    tree = ast.parse(text)
    names = _odc_constants(tree)
    environ: set[str] = set()  # names bound to os.environ / os.getenv by `from os import`
    getenv: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.module == "os" and alias.name == "environ":
                    environ.add(bound)
                elif node.module == "os" and alias.name == "getenv":
                    getenv.add(bound)
                elif (node.module or "").endswith("config") and alias.name in config_constants:
                    names[bound] = config_constants[alias.name]

    def is_environ(n) -> bool:
        return ((isinstance(n, ast.Attribute) and n.attr == "environ" and isinstance(n.value, ast.Name)
                 and n.value.id == "os") or (isinstance(n, ast.Name) and n.id in environ))

    def is_getenv(n) -> bool:
        return ((isinstance(n, ast.Attribute) and n.attr == "getenv" and isinstance(n.value, ast.Name)
                 and n.value.id == "os") or (isinstance(n, ast.Name) and n.id in getenv))

    def is_odc(n) -> bool:
        if isinstance(n, ast.Constant):
            return isinstance(n.value, str) and n.value.startswith("ODC_")
        if isinstance(n, ast.JoinedStr):  # f"ODC_{...}"
            return bool(n.values) and is_odc(n.values[0])
        if isinstance(n, ast.Name):
            return n.id in names
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "config":
            return n.attr in config_constants
        return False

    found = []
    for node in sorted(ast.walk(tree), key=lambda n: getattr(n, "lineno", 0)):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if ((isinstance(f, ast.Attribute) and f.attr in _READ_METHODS and is_environ(f.value))
                    or is_getenv(f)):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
            key = node.slice
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1
              and isinstance(node.ops[0], (ast.In, ast.NotIn)) and is_environ(node.comparators[0])):
            key = node.left
        if key is not None and is_odc(key):
            found.append(f"{path.relative_to(base)}:{node.lineno}: "
                         f"{ast.get_source_segment(text, node)}")
    return found


def reads_outside_config(pkg: Path) -> list[str]:
    config_constants = _odc_constants(ast.parse((pkg / "config.py").read_text()))
    return [r for f in sorted(pkg.rglob("*.py")) if f.name != "config.py" or f.parent != pkg
            for r in env_reads(f, config_constants, pkg.parent)]


def test_no_odc_environment_read_outside_config():
    found = reads_outside_config(PKG)
    assert not found, ("ODC_* read outside torch_odc_backend/config.py (add a function there):\n"
                       + "\n".join(found))


def test_the_scan_finds_each_kind_of_read(tmp_path):
    """The check above is not vacuous: each form of read is found, writes are not."""
    src = textwrap.dedent('''
        import os
        from os import environ as env, getenv
        from . import config
        from .config import HOST_SIZE
        NAME = "ODC_N"
        a = os.environ.get("ODC_A")                      # 7
        b = os.environ["ODC_B"]                          # 8
        c = "ODC_C" in os.environ                        # 9
        d = os.getenv("ODC_D", "")                       # 10
        e = env.get(NAME)                                # 11
        f = getenv(f"ODC_{b}")                           # 12
        g = os.environ.get(config.HOST_SIZE)             # 13
        h = os.environ.pop(HOST_SIZE, None)              # 14
        i = "ODC_I" not in env                           # 15
        os.environ["ODC_W"] = "1"                        # writes: not reads
        os.environ.update({"ODC_W": "1"})
        j = os.environ.get("CUDA_MODULE_LOADING")        # not odc's
    ''')
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "config.py").write_text('HOST_SIZE = "ODC_HOST_SIZE"\nimport os\nx = os.environ.get("ODC_X")\n')
    (pkg / "mod.py").write_text(src)
    lines = [int(r.split(":")[1]) for r in reads_outside_config(pkg)]
    assert lines == list(range(7, 16)), reads_outside_config(pkg)
    # config.py itself reads: the scan sees it
    assert env_reads(PKG / "config.py", {}), "the scan found no read in config.py"


def test_decoupled_hooks_use_only_the_public_guard():
    """No module but decoupled.py calls a private method of DecoupledState (the comm hooks go
    through its ``guard``)."""
    tree = ast.parse((PKG / "decoupled.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DecoupledState")
    private = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)
               and f.name.startswith("_") and not f.name.endswith("__")}
    assert "_fail" in private, private
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path == PKG / "decoupled.py":
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in private:
                found.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: "
                             f"{ast.get_source_segment(text, node)}")
    found.sort(key=lambda r: (r.split(":")[0], int(r.split(":")[1])))
    assert not found, "private DecoupledState methods used outside decoupled.py:\n" + "\n".join(found)

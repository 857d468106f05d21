"""The package's shape: no import cycle among its modules (counting the imports inside
functions, which only postpone a cycle to the first call), and no module over 600 lines."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "torch_odc_backend"
MAX_LINES = 500


def modules_of(package_dir: Path) -> dict[str, Path]:
    """Dotted name -> file, for every Python module of the package (``__init__`` names its package)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (package_dir.name,) + path.relative_to(package_dir).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def names_of(path: Path) -> set[str]:
    """What ``from <module> import NAME`` can take from this file: its top-level bindings, and
    the identifiers it names in strings (what a module ``__getattr__`` serves lazily)."""
    tree = ast.parse(path.read_text(), str(path))
    names = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier()}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports anywhere in its body: module level
    or inside functions, relative or absolute, and ``importlib.import_module`` of a literal."""
    top = name.partition(".")[0]
    context = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def resolve(module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = context.split(".")
        base = base[:len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    targets = set()

    def add(target: str, names=()) -> None:
        if not (target == top or target.startswith(top + ".")):
            return
        for alias in names:
            if f"{target}.{alias}" in modules:
                targets.add(f"{target}.{alias}")
            elif alias == "*" or (target in modules and alias in names_of(modules[target])):
                targets.add(target)
            # else a module with no Python source here (the compiled _C, the generated _build_info)
        if not names:
            targets.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            add(resolve(node.module, node.level), [a.name for a in node.names])
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            literal = node.args[0].value
            level = len(literal) - len(literal.lstrip("."))
            add(resolve(literal.lstrip(".") or None, level))
    return {t for t in targets if t in modules and t != name}


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = modules_of(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_inside_the_package():
    cycle = find_cycle(import_graph(PACKAGE_DIR))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules_of(PACKAGE_DIR).items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


CSRC = ROOT / "csrc"
MAX_FUNCTION_LINES = 80


def top_level_functions(text: str):
    """(first line, line count, signature) of each function defined at the top level of a
    C++/CUDA file (a line at column 0 with a parenthesis whose body opens with a brace)."""
    lines = text.split("\n")
    skip = (" ", "/", "#", "}", "namespace", "struct", "class", "template", "using",
            "static_assert", "enum", "constexpr")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line and not line.startswith(skip) and "(" in line:
            j = i
            while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
                j += 1
            if j < len(lines) and "{" in lines[j]:
                depth, k = 0, j
                while k < len(lines):
                    depth += lines[k].count("{") - lines[k].count("}")
                    if depth <= 0:
                        break
                    k += 1
                yield i + 1, k - i + 1, line.strip()
                i = k + 1
                continue
        i += 1


def test_native_sources_are_short():
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".hpp", ".cu", ".cuh")]
    long_files = {str(p.relative_to(ROOT)): n for p in sources
                  if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long_files, f"files over {MAX_LINES} lines: {long_files}"
    long_functions = [f"{p.relative_to(ROOT)}:{first} ({n} lines) {sig[:60]}" for p in sources
                      for first, n, sig in top_level_functions(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long_functions, "functions over 80 lines:\n" + "\n".join(long_functions)


def test_the_function_finder_measures_bodies():
    text = "int f(int a,\n      int b) {\n  if (a) {\n    return b;\n  }\n  return a;\n}\nint g();\n"
    assert list(top_level_functions(text)) == [(1, 7, "int f(int a,")]


def test_the_c10d_face_holds_no_device_code():
    assert "#ifdef" not in (CSRC / "backend.cpp").read_text()


def test_results_folder_stays_small():
    # one current headline file (JSON + PNG) per benchmark and machine kind; git keeps the rest
    results = PACKAGE_DIR.parent / "benchmarks" / "results"
    total = sum(p.stat().st_size for p in results.iterdir() if p.is_file())
    assert total <= 1_500_000, f"benchmarks/results holds {total / 1e6:.2f} MB (limit 1.5 MB)"


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "torch_odc_backend"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import importlib\n"
                                     "def lazy():\n    importlib.import_module('.a', __name__)\n")
    (pkg / "a.py").write_text("from . import _C  # compiled: outside the graph\n\n"
                              "def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import torch\n\ndef g():\n    from ..c import x\n")
    (pkg / "c.py").write_text("from . import lazy\nx = 1\n")  # a name of the package's __init__
    graph = import_graph(pkg)
    assert graph == {"torch_odc_backend": {"torch_odc_backend.a"}, "torch_odc_backend.a": {"torch_odc_backend.sub.b"},
                     "torch_odc_backend.sub": set(), "torch_odc_backend.sub.b": {"torch_odc_backend.c"},
                     "torch_odc_backend.c": {"torch_odc_backend"}}
    assert find_cycle(graph) == ["torch_odc_backend", "torch_odc_backend.a", "torch_odc_backend.sub.b",
                                 "torch_odc_backend.c", "torch_odc_backend"]
    (pkg / "c.py").write_text("x = 1\n")
    assert find_cycle(import_graph(pkg)) is None


def test_the_gpu_suite_parts_hold_every_gpu_test_file():
    """benchmarks/gpu_suite.sh's stages suite_a/b/c run `pytest -m gpu` on three lists of files:
    together they hold every test file that marks GPU tests, each once."""
    import re

    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    parts = {name: re.findall(r"tests/[\w/]+\.py", body)
             for name, body in re.findall(r"^(SUITE_[ABC])=\(([^)]*)\)", script, flags=re.M)}
    assert sorted(parts) == ["SUITE_A", "SUITE_B", "SUITE_C"], parts
    listed = [f for files in parts.values() for f in files]
    marks = re.compile(r"cuda_case|gpu_test\(|needs_gpus|mark\.gpu")
    gpu_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                 if marks.search(p.read_text())}
    gpu_files -= {"tests/test_nvshmem.py", "tests/test_structure.py"}  # its own stage; this check
    assert len(listed) == len(set(listed)), f"a file in two parts: {listed}"
    assert set(listed) == gpu_files, (f"missing from the parts: {sorted(gpu_files - set(listed))}; "
                                      f"listed but no GPU tests: {sorted(set(listed) - gpu_files)}")

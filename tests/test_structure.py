"""The package's shape: no import cycle among its modules (counting the imports inside
functions, which only postpone a cycle to the first call), no module or native file over 500
lines, no native function over 80, and no comment naming a file that does not exist."""
from __future__ import annotations

import ast
import re
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


def _code_only(text: str) -> str:
    """The text with comments, string and character literals and preprocessor lines blanked
    (newlines kept, so that offsets keep their line numbers)."""
    out, i, n = [], 0, len(text)
    blank = lambda chunk: "".join("\n" if c == "\n" else " " for c in chunk)
    while i < n:
        c = text[i]
        if text.startswith("//", i) or (c == "#" and text[text.rfind("\n", 0, i) + 1:i].strip() == ""):
            j = text.find("\n", i)
            j = n if j < 0 else j
            while c == "#" and text[j - 1] == "\\" and j < n:  # a continued preprocessor line
                j = text.find("\n", j + 1)
                j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i:j + 1]))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


_CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b[^()]*$|^extern\s*$")
_FUNCTION_HEAD = re.compile(r"\)\s*(const|override|final|noexcept|mutable|volatile|&&?|\s)*$"
                            r"|\)\s*(const\s*)?(noexcept\s*)?->\s*[\w:<>,\s*&]+$"
                            r"|\)\s*:\s*\w.*$", re.S)
_ACCESS = re.compile(r"^\s*((public|private|protected)\s*:\s*)+")


def functions(text: str):
    """(first line, line count, signature) of each function defined in a C++/CUDA file: at the
    top level, in namespaces, and inside classes and structs (member functions), measured from
    the first line of its head to its closing brace. Bodies are not searched further (a lambda
    or local class counts as part of its function)."""
    code = _code_only(text)
    found, head_start, i = [], 0, 0
    while i < len(code):
        c = code[i]
        if c in ";}":
            head_start = i + 1
        elif c == "{":
            head = _ACCESS.sub("", code[head_start:i]).strip()
            if "(" in head and _FUNCTION_HEAD.search(head) and not _CONTAINER.search(head.split("(")[0]):
                depth, k = 0, i
                while k < len(code):
                    depth += (code[k] == "{") - (code[k] == "}")
                    if depth == 0:
                        break
                    k += 1
                first = head_start + len(code[head_start:i]) - len(code[head_start:i].lstrip())
                access = _ACCESS.match(code[first:i])
                first_line = code.count("\n", 0, first + (len(access.group(0)) if access else 0)) + 1
                found.append((first_line, code.count("\n", 0, k) + 2 - first_line, " ".join(head.split())))
                i = head_start = k + 1
                continue
            head_start = i + 1
        i += 1
    return found


def test_native_sources_are_short():
    sources = [p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".hpp", ".cu", ".cuh")]
    long_files = {str(p.relative_to(ROOT)): n for p in sources
                  if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long_files, f"files over {MAX_LINES} lines: {long_files}"
    long_functions = [f"{p.relative_to(ROOT)}:{first} ({n} lines) {sig[:60]}" for p in sources
                      for first, n, sig in functions(p.read_text()) if n > MAX_FUNCTION_LINES]
    assert not long_functions, "functions over 80 lines:\n" + "\n".join(long_functions)


def test_the_function_finder_measures_bodies():
    text = "int f(int a,\n      int b) {\n  if (a) {\n    return b;\n  }\n  return a;\n}\nint g();\n"
    assert functions(text) == [(1, 7, "int f(int a, int b)")]


def test_the_function_finder_measures_member_functions():
    text = ("namespace odc {\n"
            "class A : public B {\n"
            " public:\n"
            "  // a comment with a { brace\n"
            "  A(int x) : x_(x) {\n"
            "    if (x) { f(\"}\"); }\n"
            "  }\n"
            "  int get() const override { return x_; }\n"
            "  struct Inner {\n"
            "    int twice() const {\n"
            "      auto g = [](int y) { return 2 * y; };\n"
            "      return g(1);\n"
            "    }\n"
            "  };\n"
            "  int x_ = 0;\n"
            "  int v_[2] = {1, 2};\n"
            "};\n"
            "}  // namespace odc\n")
    assert [(first, n) for first, n, _ in functions(text)] == [(5, 3), (8, 1), (10, 4)]


def test_the_c10d_face_holds_no_device_code():
    # device code goes through the device seam (device_work.hpp)
    for name in ("backend.cpp", "collective_plan.cpp", "decoupled.cpp"):
        assert "#if" not in (CSRC / name).read_text(), name


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


_FILE_NAME = re.compile(r"(?<![\w/.-])([\w./-]*\w\.(?:cpp|hpp|cuh|cu|py|md|sh|toml|json))\b")


def _comments(path: Path):
    """(line, text) of each comment of a C++/CUDA file, or each ``#`` comment of a Python one."""
    text = path.read_text()
    if path.suffix == ".py":
        for number, line in enumerate(text.split("\n"), 1):
            if "#" in line and not line.lstrip().startswith(("'", '"')):
                yield number, line[line.index("#"):]
        return
    for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
        yield text.count("\n", 0, m.start()) + 1, m.group(0)


def names_missing(paths, root: Path):
    """file:line and name of each file a comment names that is nowhere in the tree (resolved
    beside the file, from the root, or as the end of some file's path)."""
    tree = [str(p) for p in root.rglob("*") if p.is_file()
            and not {".git", "build", ".venv", ".venv-verl"} & set(p.relative_to(root).parts)]
    missing = []
    for path in paths:
        for line, comment in _comments(path):
            for name in _FILE_NAME.findall(comment):
                if (path.parent / name).exists() or (root / name).exists():
                    continue
                if not any(t.endswith("/" + name.lstrip("./")) for t in tree):
                    missing.append(f"{path.relative_to(root)}:{line} {name}")
    return missing


def test_comments_name_only_files_that_exist():
    paths = [p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".hpp", ".cu", ".cuh")]
    paths += sorted(PACKAGE_DIR.rglob("*.py"))
    missing = names_missing(paths, ROOT)
    assert not missing, "comments name files that do not exist:\n" + "\n".join(missing)


def test_the_comment_check_finds_a_missing_file(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "here.cpp").write_text("// see there.cpp and here.cpp\nint x;  // gone/kernels.cu\n")
    (tmp_path / "src" / "a.py").write_text("x = 1  # beside here.cpp, not in moved.py\n")
    assert names_missing(sorted((tmp_path / "src").iterdir()), tmp_path) == [
        "src/a.py:1 moved.py", "src/here.cpp:1 there.cpp", "src/here.cpp:2 gone/kernels.cu"]


def _class_body(text: str, name: str) -> str:
    """The body of `class NAME ... {...};` in a header, comments and strings blanked."""
    code = _code_only(text)
    start = re.search(rf"\bclass {name}\b[^;{{]*{{", code).end()
    depth, k = 1, start
    while depth:
        depth += (code[k] == "{") - (code[k] == "}")
        k += 1
    return code[start:k - 1]


def test_the_transport_core_stays_narrow():
    # The core every transport has; what only some can do is a capability interface beside it.
    body = _class_body((CSRC / "transport.hpp").read_text(), "Transport")
    virtuals = re.findall(r"\bvirtual\s+(?!~)[^;{]*?(\w+)\s*\(", body)
    assert len(virtuals) <= 12, f"Transport declares {len(virtuals)} virtual methods: {virtuals}"


def test_the_cuda_transport_is_a_coordinator():
    # Its parts own their state (cuda/*.hpp); the transport itself keeps a few fields.
    body = _class_body((CSRC / "cuda" / "cuda_transport.hpp").read_text(), "CudaTransport")
    depth, flat = 0, []
    for c in body:  # the class's own level: no nested struct's fields, no function bodies
        depth += (c == "{") - (c == "}")
        flat.append(c if depth == 0 and c != "}" else " ")
    fields = re.findall(r"\b(\w+_)\s*(?:=[^;]*)?;", "".join(flat))
    assert 0 < len(fields) <= 15, f"CudaTransport declares {len(fields)} fields: {fields}"

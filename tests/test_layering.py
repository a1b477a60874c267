"""The layout is the architecture: dependencies point one way (kvstreamd -> transport -> codec),
each room of kvstreamd imports only the rooms its row of ROOMS names and each of codec and
transport those of SUBROOMS (codec: pool -> tuning -> method), the daemon never imports its
test and benchmark harness, only the vLLM connector imports vLLM, no module imports itself
round a circle, and a file grows past ~500 lines only with its reason in its docstring."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("codec", "transport", "kvstreamd")
LONG = 500
# The reason, in so many words: "The file is long (~N lines) because ..." (or "on purpose: ...");
# a docstring that merely says "longest prefix" or "long contexts" does not count.
LONG_BECAUSE = re.compile(r"\bfile is long\b[^.]*\b(because|on purpose)\b", re.I)

# Each room of kvstreamd and the rooms of kvstreamd it may import (besides itself). "base" is the
# package's top-level modules but client and cli; the harness is models/, lab/ and bench/.
BASE = "base"
ROOMS = {
    "store": set(),
    "handoff": set(),
    BASE: {BASE},
    "client": {BASE, "handoff"},
    "cluster": {BASE, "store"},
    "ops": {BASE, "store", "cluster", "client", "models"},
    "node": {BASE, "store", "handoff", "client", "cluster", "ops"},
    "models": {BASE, "client", "models"},
    "lab": {BASE, "client", "store", "handoff", "cluster", "ops", "models", "lab"},
    "bench": {BASE, "client", "store", "handoff", "cluster", "ops", "models", "lab", "bench"},
    "engines": {BASE, "client"},
}
# The rooms of codec and transport, each with the rooms of its package it may import (besides
# itself). A package's top-level modules are its first room; each subpackage is a room of its
# own. The package itself (its __init__, the face callers import from) belongs to none.
# codec: the method (what a chunk is turned into and back) never imports the tuning that picks
# its values nor the process pool that runs it; tuning never imports the pool (codec/__init__.py).
# transport has one room: it has no subpackages.
TOP = {"codec": "method", "transport": "transport"}
SUBROOMS = {
    "codec": {"method": set(), "tuning": {"method"}, "pool": {"method", "tuning"}},
    "transport": {"transport": set()},
}
# The modules that import the serving engine: the connector, and the harness's driver script that
# vLLM's own environment runs (lab/vllm_engine.py starts it as a process). The daemon and the rest
# of the package run (and their tests import them) where vLLM is not installed.
VLLM_MODULES = ["kvstreamd.engines.vllm_connector", "kvstreamd.lab.vllm_driver"]


def room(module: str) -> str | None:
    """The room of a kvstreamd module: its subpackage, `client`, or BASE; None outside kvstreamd
    and for the package itself and the CLI (the entry point, which may import anything)."""
    parts = module.split(".")
    if parts[0] != "kvstreamd" or len(parts) == 1 or parts[1] == "cli":
        return None
    if (ROOT / "kvstreamd" / parts[1]).is_dir():
        return parts[1]
    return "client" if parts[1] == "client" else BASE


def subroom(module: str) -> str | None:
    """The room of a codec or transport module (SUBROOMS): its subpackage, or its package's top
    room (TOP); None for other packages and for the package itself."""
    parts = module.split(".")
    if parts[0] not in SUBROOMS or len(parts) == 1:
        return None
    return parts[1] if (ROOT / parts[0] / parts[1]).is_dir() else TOP[parts[0]]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports, at module level or inside functions alike (a lazy import
    still couples the two); `if TYPE_CHECKING:` blocks count too."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = base[:len(base) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_dependencies_point_one_way(graph):
    bad = [(a, b) for a, deps in graph.items() for b in deps
           if a.startswith("codec") and not b.startswith("codec")
           or a.startswith("transport") and b.startswith("kvstreamd")]
    assert not bad, f"imports against the layering: {bad}"


def test_every_room_of_kvstreamd_has_a_row():
    rooms = {p.name for p in (ROOT / "kvstreamd").iterdir() if (p / "__init__.py").exists()}
    assert rooms | {BASE, "client"} == set(ROOMS), "a room without an import rule, or a rule without a room"


def crossings(graph: dict[str, set[str]], room_of, rows: dict[str, set[str]]) -> list[str]:
    """Each import from one room into another that the importer's row does not name (room_of:
    a module's room, None where no rule applies)."""
    bad = []
    for a, deps in graph.items():
        ra = room_of(a)
        if ra is None:
            continue
        for b in deps:
            rb = room_of(b)
            if rb is not None and rb != ra and rb not in rows[ra]:
                bad.append(f"{a} ({ra}) -> {b} ({rb})")
    return bad


def test_each_room_imports_only_what_its_row_allows(graph):
    bad = crossings(graph, room, ROOMS)
    assert not bad, "imports against the rooms' rules:\n" + "\n".join(bad)


def test_every_room_of_codec_and_transport_has_a_row():
    for pkg, rows in SUBROOMS.items():
        rooms = {p.name for p in (ROOT / pkg).iterdir() if (p / "__init__.py").exists()} | {TOP[pkg]}
        assert rooms == set(rows), f"{pkg}: a room without an import rule, or a rule without a room"


def test_the_codec_and_transport_rooms_import_only_what_their_rows_allow(graph):
    bad = [line for pkg, rows in SUBROOMS.items()
           for line in crossings(graph, lambda m, pkg=pkg: subroom(m) if m.split(".")[0] == pkg else None, rows)]
    assert not bad, "imports against the rooms' rules:\n" + "\n".join(bad)


def test_the_daemon_never_imports_its_harness(graph):
    harness = ("kvstreamd.lab", "kvstreamd.bench", "kvstreamd.cli", "kvstreamd.models")
    daemon = [m for m in graph if m.startswith("kvstreamd") and not m.startswith(harness) and m != "kvstreamd"]
    bad = [(a, b) for a in daemon for b in graph[a] if b.startswith(("kvstreamd.lab", "kvstreamd.bench"))]
    assert not bad, f"daemon modules importing test/benchmark harness: {bad}"


def test_only_the_vllm_connector_and_its_driver_import_vllm():
    mods = modules()
    importers = sorted(name for name, path in mods.items() if "vllm" in imports(name, path, {"vllm"}))
    assert importers == VLLM_MODULES, f"modules importing vllm (only {VLLM_MODULES} may): {importers}"


def test_no_import_circle(graph):
    # A package's __init__ importing its own submodules is how packages work, not a circle.
    edges = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in graph.items()}
    cycles, state = [], {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_long_file_says_why_in_its_docstring():
    long = []
    for name, path in modules().items():
        lines = path.read_text().count("\n")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > LONG and not LONG_BECAUSE.search(" ".join(doc.split())):
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not long, f"files over {LONG} lines without a reason in their docstring: {long}"


def test_the_readme_map_names_every_module():
    """README's "Where things are" names each module of kvstreamd, in its room's entry."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Where things are"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "kvstreamd").rglob("*.py")
               if p.name != "__init__.py" and f"`{p.name}`" not in section]
    assert not missing, f"modules the README's map does not name: {missing}"

"""A module name in prose is a name that is there: every dotted `kvstreamd.`/`codec.`/`transport.`
name in a docstring or a comment of the product packages names a module, or a module's attribute
(a function, a class, a constant, a class's method), as the tree is now. When a module moves, the
prose that sends a reader to it moves too.

Names are resolved from the source (ast), not by importing: a module that imports vLLM or a GPU
library is checked where neither is installed. A name whose last part is a file's extension
(`kvstreamd.json`, `kvstreamd.toml`) is a file's name, not a module's."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("codec", "transport", "kvstreamd")
DOTTED = re.compile(r"(?<![\w./-])(?:kvstreamd|codec|transport)(?:\.[A-Za-z_]\w*)+")
FILE_SUFFIXES = {"json", "toml", "service", "conf", "sock", "socket", "log", "kvc", "kvprofile", "yaml", "yml",
                 "txt", "md", "py", "c", "h", "so", "d", "target", "timer", "tmp", "gguf", "safetensors"}


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each docstring and each comment in `path`."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.append((body[0].lineno, body[0].value.value))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    return out


def module_file(parts: tuple[str, ...]) -> Path | None:
    """The file of module `parts` (a package's __init__.py, or its folder for a namespace
    package), or None when there is no such module."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() and any(base.glob("*.py")) else None


@cache
def names_in(path: Path) -> dict[str, ast.AST | None]:
    """The names a module defines at its top level (what `module.name` can be), each with its
    class node when it is a class (so that `module.Class.method` can be checked too)."""
    if path.is_dir():
        return {}
    out: dict[str, ast.AST | None] = {}
    for node in ast.parse(path.read_text()).body:
        for sub in ([node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node)):
            if isinstance(sub, ast.ClassDef):
                out[sub.name] = sub
            elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[sub.name] = None
            elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out[n.id] = None
            elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                for a in sub.names:
                    out[(a.asname or a.name).split(".")[0]] = None
    return out


def class_members(node: ast.ClassDef) -> set[str]:
    out = set()
    for sub in node.body:
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(sub.name)
        elif isinstance(sub, ast.Assign):
            out.update(t.id for t in sub.targets if isinstance(t, ast.Name))
        elif isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
            out.add(sub.target.id)
    # a dataclass's fields and a class's attributes set in its methods (self.x = ...)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                and isinstance(sub.ctx, ast.Store):
            out.add(sub.attr)
    return out


def resolves(name: str) -> bool:
    parts = tuple(name.split("."))
    if parts[-1] in FILE_SUFFIXES:
        return True
    for n in range(len(parts), 0, -1):
        path = module_file(parts[:n])
        if path is None:
            continue
        rest = parts[n:]
        if not rest:
            return True
        defined = names_in(path)
        if rest[0] not in defined:
            return False
        node = defined[rest[0]]
        if len(rest) == 1 or not isinstance(node, ast.ClassDef):
            return True  # an attribute of a function or a value: as far as the source can tell
        return rest[1] in class_members(node) or any(isinstance(b, ast.Name) for b in node.bases)
    return False


def test_every_dotted_name_in_prose_resolves():
    stale = []
    for path in sources():
        for line, text in prose(path):
            for m in DOTTED.finditer(text):
                if not resolves(m.group()):
                    stale.append(f"{path.relative_to(ROOT)}:{line}: {m.group()}")
    assert not stale, "names in docstrings/comments that name no module or attribute:\n" + "\n".join(stale)


def test_the_check_finds_a_stale_name_and_passes_a_good_one():
    assert resolves("kvstreamd.store.keys") and resolves("kvstreamd.store.keys.chunk_key")
    assert resolves("kvstreamd.config.FetchConfig.deadline_ms") and resolves("kvstreamd.json")
    assert not resolves("kvstreamd.chunkdir") and not resolves("kvstreamd.store.keys.no_such_thing")

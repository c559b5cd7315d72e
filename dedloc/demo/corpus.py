"""The demo's data, built at run time from text already on the machine: the standard library's docstrings.

Nothing is downloaded and no text is stored in the repository. The docstrings are written as a
local JSON-lines file, which the demo's peers then read like any other ``--data`` source.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path


def stdlib_docstrings(max_files: int = 1500) -> list[str]:
    """Docstrings (>= 40 characters, whitespace-normalised) of the standard library's modules, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if not {"site-packages", "test", "tests", "idle_test"} & set(f.relative_to(root).parts))
    texts: list[str] = []
    for f in files[:max_files]:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    texts.append(" ".join(doc.split()))
    if not texts:
        raise RuntimeError(f"found no docstrings under {root}; the demo needs Python's standard library sources")
    return texts


def write_corpus(path: Path, max_files: int = 1500) -> int:
    """Write the docstrings to ``path`` as JSON lines (``{"text": ...}``); returns how many."""
    texts = stdlib_docstrings(max_files)
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return len(texts)

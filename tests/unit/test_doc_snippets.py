"""Every ``shoal.…`` name in the docs' Python examples exists and is reachable from what the document imports.

``import shoal`` does not import its submodules: an example that writes
``shoal.elastic.ElasticGroup()`` after only ``import shoal`` raises
AttributeError. The names a bare ``import shoal`` makes reachable come from a
fresh interpreter (this one may have imported more); a document's own
``import``/``from`` lines add theirs (examples read top to bottom, so a later
block may use an earlier block's imports).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
IMPORT = re.compile(r"^\s*(?:import\s+([\w., ]+)|from\s+(shoal[\w.]*)\s+import\s)", re.M)
NAME = re.compile(r"(?<![\w.])shoal(?:\.\w+)+")


@functools.lru_cache(maxsize=1)
def _after_bare_import() -> frozenset[str]:
    code = "import json, sys, shoal; print(json.dumps(sorted(m for m in sys.modules if m.startswith('shoal'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return frozenset(json.loads(out.stdout))


def _imported(code: str) -> set[str]:
    """The shoal modules (and their parents) that ``code``'s import lines load."""
    names: set[str] = set()
    for plain, source in IMPORT.findall(code):
        mods = [source] if source else [m.strip().split(" as ")[0] for m in plain.split(",")]
        for m in mods:
            parts = m.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[0] == "shoal")
    return names


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):   # the parent is not a package
        return False


def _problem(dotted: str, reachable: frozenset[str] | set[str]) -> str | None:
    obj: object = importlib.import_module("shoal")
    prefix = "shoal"
    for part in dotted.split(".")[1:]:
        full = f"{prefix}.{part}"
        if prefix in reachable and _is_module(full):
            if full not in reachable:
                return f"{dotted}: {full} is a module the document never imports (add `import {full}`)"
            obj = importlib.import_module(full)
        elif not hasattr(obj, part):
            return f"{dotted}: {prefix} has no attribute {part!r}"
        else:
            obj = getattr(obj, part)
        prefix = full
    return None


@pytest.mark.timeout(180)
def test_doc_examples_name_only_reachable_shoal_objects() -> None:
    base = _after_bare_import()
    problems = []
    for doc in DOCS:
        blocks = BLOCK.findall(doc.read_text())
        reachable = base.union(*(_imported(b) for b in blocks))
        for block in blocks:
            for dotted in sorted(set(NAME.findall(block))):
                why = _problem(dotted, reachable)
                if why:
                    problems.append(f"{doc.relative_to(ROOT)}: {why}")
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_submodule_left_unimported() -> None:
    base = _after_bare_import()
    assert "shoal.elastic" not in base, "import shoal now loads shoal.elastic: this check needs a new example"
    assert _problem("shoal.elastic.ElasticGroup", base) is not None
    assert _problem("shoal.elastic.ElasticGroup", base | {"shoal.elastic"}) is None
    assert _problem("shoal.NoSuchThing", base) is not None

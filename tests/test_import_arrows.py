"""Which part of steplens may import which, checked on the import statements of every module (ast, so
imports inside functions count too, and nothing is imported to check it).

    collect/           -> steplens.analyze.contract only (never analysis code)
    analyze/contract/  -> the standard library, pyarrow, polars and itself only
    analyze/, reports/ -> never torch or deepspeed (the analyzer runs where neither is installed)
    reports/           -> never scipy, statistics, steplens.collect or torch (it renders, it does not compute)
    steplens.reports   <- imported only by analyze/cli*.py

One arrow per test. An arrow that does not hold yet is marked xfail(strict=True): when it is fixed the test
passes, strict turns that into a failure, and the mark is removed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"analyze": "steplens.analyze", "collect": "steplens.collect", "reports": "steplens.reports"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    dotted = [PACKAGES[parts[0]]] + parts[1:]
    return ".".join(dotted[:-1] if dotted[-1] == "__init__" else dotted)


def imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                # `from . import x`: x may be a module of the package
                found.update([target] if node.module else [f"{target}.{alias.name}" for alias in node.names])
            else:
                found.add(node.module)
    return found


def modules(folder: str) -> dict[str, set[str]]:
    """Relative path -> imports, for every module under `folder` (relative to the repository root)."""
    return {str(p.relative_to(ROOT)): imports(p) for p in sorted((ROOT / folder).rglob("*.py"))}


def top(name: str) -> str:
    return name.split(".")[0]


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(folder: str, forbidden) -> dict[str, list[str]]:
    found = {path: sorted(n for n in names if forbidden(n)) for path, names in modules(folder).items()}
    return {path: names for path, names in found.items() if names}


def test_the_scan_sees_imports():
    """The checks below look at real import statements: a known module's known imports are found."""
    collector = imports(ROOT / "collect" / "collector.py")
    assert {"steplens.analyze.contract", "steplens.collect.parts", "torch"} <= collector
    assert "steplens.analyze.contract.bus_bandwidth" in imports(ROOT / "collect" / "collector.py")


def test_collect_imports_only_the_contract_from_the_analyzer():
    assert violations("collect", lambda n: within(n, "steplens.analyze") and not within(n, "steplens.analyze.contract")) == {}


def test_contract_imports_only_stdlib_pyarrow_polars_and_itself():
    def forbidden(name):
        if within(name, "steplens"):
            return not within(name, "steplens.analyze.contract")
        return top(name) not in sys.stdlib_module_names and top(name) not in ("pyarrow", "polars")

    assert violations("analyze/contract", forbidden) == {}


def test_analyzer_never_imports_torch_or_deepspeed():
    assert violations("analyze", lambda n: top(n) in ("torch", "deepspeed")) == {}


def test_reports_never_import_torch_or_deepspeed():
    assert violations("reports", lambda n: top(n) in ("torch", "deepspeed")) == {}


def test_reports_never_compute_statistics():
    assert violations("reports", lambda n: top(n) in ("scipy", "statistics")) == {}


def test_reports_never_import_the_collector():
    assert violations("reports", lambda n: within(n, "steplens.collect")) == {}


def test_only_the_cli_imports_the_reports():
    def is_cli(path: str) -> bool:  # analyze/cli.py, analyze/cli_render.py, ...
        return Path(path).parent == Path("analyze") and Path(path).name.startswith("cli")

    found = {path: names for folder in ("analyze", "collect")
             for path, names in violations(folder, lambda n: within(n, "steplens.reports")).items() if not is_cli(path)}
    assert found == {}


SUBPACKAGES = ("contract", "importers", "trace", "pipeline", "analyses", "query")


def test_importers_never_import_the_analyses():
    assert violations("analyze/importers", lambda n: within(n, "steplens.analyze.analyses")) == {}


def test_the_pipeline_never_imports_the_cli():
    assert violations("analyze/pipeline", lambda n: within(n, "steplens.analyze.cli") or n.startswith(
        "steplens.analyze.cli")) == {}


def _package_graph() -> dict[str, set[str]]:
    """analyze/ sub-package -> the other sub-packages its modules import."""
    graph = {package: set() for package in SUBPACKAGES}
    for package in SUBPACKAGES:
        for names in modules(f"analyze/{package}").values():
            graph[package] |= {other for other in SUBPACKAGES if other != package
                               and any(within(n, f"steplens.analyze.{other}") for n in names)}
    return graph


def test_the_analyzer_packages_import_each_other_without_cycles():
    graph = _package_graph()
    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph[b]})
    assert cycles == []


def test_the_pipeline_never_imports_the_reports():
    """pipeline/run.py runs a run from discovery to publish; the report is what the CLI adds (Hooks)."""
    assert violations("analyze/pipeline", lambda n: within(n, "steplens.reports")) == {}


def test_importers_only_decode_ingest_applies_the_trace_semantics():
    """A trace importer returns a DecodedTrace; steps, launch links and the source column are ingest's."""
    applied = {path for path in modules("analyze/importers")
               if "semantics.apply(" in (ROOT / path).read_text() or "pl.lit(source)" in (ROOT / path).read_text()}
    assert applied == set()


def test_the_trace_importer_registry_is_read_without_polars():
    """The early worker start reads TRACE_NAMES before polars is imported; no format module comes with it."""
    probe = ("import sys; from steplens.analyze.importers import TRACE_NAMES, TRACE_IMPORTERS; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('polars', 'pyarrow', 'msgspec') "
             "or m.startswith('steplens.analyze.importers.')))")
    import subprocess

    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

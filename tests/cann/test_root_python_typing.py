"""The simulated CANN root's ``llm_datadist`` package is typed (PEP 561): a type checker cannot
follow the run-time module swap of its ``__init__.py``, so the root ships a stub re-exporting
kvdd.llm_datadist and ``py.typed``; without them ``mypy --strict`` of client code stops at
"module is installed, but missing library stubs or py.typed marker"."""

from __future__ import annotations

import ast
from pathlib import Path

import kvdd.llm_datadist as facade


def test_root_package_ships_a_stub_and_the_marker(root: Path) -> None:
    package = root / "python/site-packages/llm_datadist"
    assert (package / "py.typed").is_file()
    stub = ast.parse((package / "__init__.pyi").read_text())
    imports = {(node.module, alias.name, alias.asname) for node in stub.body
               if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert ("kvdd.llm_datadist", "*", None) in imports
    assert ("kvdd.llm_datadist", "v2_list", "v2_list") in imports
    assert hasattr(facade, "v2_list") and "LLMDataDist" in facade.__all__

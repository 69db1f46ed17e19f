#!/usr/bin/env python3
"""Mutation testing of kvdd's checks: weaken one check at a time and see whether a test fails.

A *check* is an ``if`` whose body refuses something (it raises, or returns a status or a refusal),
inside the functions a target names.  Each check is weakened in every way below, one mutant at a
time, and the target's tests run against each mutant; a mutant no test fails on *survives*, and
names a behaviour no test checks.

Operators (on the condition of a check):

* ``skip``: the condition becomes ``False`` (the check is gone);
* ``boundary``: one comparison moved by one (``<`` and ``<=``, ``>`` and ``>=`` swapped);
* ``flip``: ``==`` and ``!=`` swapped, ``in`` and ``not in``, ``is`` and ``is not``;
* ``constant``: an integer constant of a comparison moved by +1 and by -1;
* ``connective``: ``and`` and ``or`` swapped;
* ``negation``: a ``not`` dropped.

A line holding ``mutation: equivalent(...)`` (a comment saying why) is not mutated in the ways
listed between the parentheses: an operator (``skip``, ``boundary``, ...) or one mutant's
description as ``--list`` prints it (``1 -> 0``, ``0:<= -> <``, ``or -> and``), e.g.
``# mutation: equivalent(skip, 1 -> 0): ...``; a bare ``mutation: equivalent`` covers every
mutant of its line.  A mutant that cannot change behaviour is not a missing test; the comment
must say why no behaviour can change.

Usage (from the repository root, with kvdd installed in editable mode so that the mutated
source is what the tests import)::

    python tools/mutate.py                 # every target
    python tools/mutate.py auth leases     # some targets
    python tools/mutate.py --list          # the mutants, without running anything
    python tools/mutate.py --equivalent    # the mutants marked equivalent, with their lines
    python tools/mutate.py auth --at kvdd/sim/fabric/auth.py:109   # one line's mutants

The exit status is 0 when every mutant was killed, 1 when some survived.  Each mutated file is
restored after its mutant ran (and on Ctrl-C).  A run of the whole catalogue takes tens of
minutes on two cores: it is for before a change to these files lands, not for CI.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    """The checks of some functions of one file, and the tests that should guard them."""

    name: str
    file: str
    functions: tuple[str, ...]  # qualified names ("Class.method"); "*" = every function
    tests: tuple[str, ...]


HOSTILE = "tests/hostile"
TARGETS: tuple[Target, ...] = (
    Target("auth", "kvdd/sim/fabric/auth.py",
           ("*",),
           ("tests/hostile/test_auth_socket_bounds.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_secret.py")),
    Target("secret", "kvdd/sim/fabric/secret.py", ("*",),
           ("tests/hostile/test_secret_bounds.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_secret.py",
            # test_bounds.py's secret tests (its floods guard the listener)
            *(f"tests/hostile/test_bounds.py::test_{name}" for name in (
                "special_file_as_the_secret_is_refused_within_a_second", "all_zero_secret_is_refused",
                "home_through_a_symbolic_link_is_used",
                "the_secret_is_read_once_and_again_when_it_changes")))),
    Target("listener", "kvdd/sim/fabric/listener.py", ("*",),
           ("tests/hostile/test_listener_bounds.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_attacks.py", "tests/hostile/test_admission_attacks.py",
            "tests/hostile/test_admission.py", "tests/hostile/test_bounds.py")),
    Target("listener-auth", "kvdd/sim/fabric/listener_auth.py", ("*",),
           ("tests/hostile/test_listener_bounds.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_attacks.py", "tests/hostile/test_admission_attacks.py",
            "tests/hostile/test_samehost_announce.py")),
    Target("admission", "kvdd/sim/fabric/admission.py", ("*",),
           ("tests/hostile/test_admission.py", "tests/hostile/test_bounds.py")),
    Target("handshake", "kvdd/sim/fabric/handshake.py", ("*",),
           ("tests/hostile/test_handshake_bounds.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_attacks.py", "tests/sim/test_fabric.py")),
    Target("leases", "kvdd/sim/fabric/leases.py", ("*",),
           ("tests/sim/test_lease_states.py", "tests/hostile/test_check_bounds.py",
            "tests/hostile/test_attacks.py", "tests/llm_datadist/test_engine_twosided.py")),
    Target("serving", "kvdd/sim/fabric/serving.py", ("check_request",),
           ("tests/hostile/test_check_bounds.py",)),
    Target("engine-links", "kvdd/sim/engine.py", ("SimBackend._link_one", "SimBackend._unlink_one"),
           ("tests/conformance/test_link.py", "tests/conformance/test_hixl_relink.py",
            "tests/conformance/test_hixl_already_linked.py", "tests/conformance/test_peer_hangs_up.py",
            "tests/sim/test_faults.py", "tests/sim/test_fault_points.py",
            "tests/sim/test_hixl_link_race.py", "tests/sim/test_unlink_refusals.py")),
    Target("option-json", "kvdd/option_json.py", ("adxl_engine_config",),
           ("tests/test_option_table.py", "tests/conformance/test_options_fidelity.py",
            "tests/conformance/test_option_bounds.py")),
    Target("samehost-shm", "kvdd/sim/fabric/samehost_shm.py",
           ("_read_records", "_distinct_files", "map_owner"),
           ("tests/hostile/test_samehost_shm_checks.py", "tests/hostile/test_samehost_shm.py",
            "tests/hostile/test_samehost_shm_bounds.py", "tests/hostile/test_samehost_closer.py",
            "tests/hostile/test_samehost_shm_seals.py")),
    Target("widths", "kvdd/widths.py", ("*",),
           ("tests/test_widths.py", "tests/test_argument_bounds.py", "tests/test_argument_checks.py")),
)


@dataclass(frozen=True)
class Mutant:
    target: Target
    line: int
    operator: str
    what: str
    index: int  # the how-manieth candidate of this operator in the file (stable across runs)


_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_OPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
        ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}


def _refuses(body: list[ast.stmt]) -> bool:
    """True for the body of a check: it raises, or returns (a status, a refusal)."""
    return any(isinstance(s, (ast.Raise, ast.Return)) for s in body)


def _functions(tree: ast.Module, wanted: tuple[str, ...]) -> Iterator[ast.AST]:
    def walk(node: ast.AST, prefix: str) -> Iterator[ast.AST]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                if "*" in wanted or name in wanted:
                    yield child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
    yield from walk(tree, "")


def _checks(tree: ast.Module, wanted: tuple[str, ...]) -> list[ast.If]:
    seen: dict[int, ast.If] = {}
    for fn in _functions(tree, wanted):
        for node in ast.walk(fn):
            if isinstance(node, ast.If) and _refuses(node.body):
                seen[id(node)] = node
    return sorted(seen.values(), key=lambda n: (n.lineno, n.col_offset))


def _sites(check: ast.If) -> Iterator[tuple[str, ast.AST, str]]:
    """(operator, node, description) of every way to weaken ``check``."""
    yield "skip", check, "check removed"
    for node in ast.walk(check.test):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _BOUNDARY:
                    yield "boundary", node, f"{i}:{_OPS[type(op)]} -> {_OPS[_BOUNDARY[type(op)]]}"
                if type(op) in _FLIP:
                    yield "flip", node, f"{i}:{_OPS[type(op)]} -> {_OPS[_FLIP[type(op)]]}"
            for operand in (node.left, *node.comparators):
                if isinstance(operand, ast.Constant) and type(operand.value) is int:
                    yield "constant", operand, f"{operand.value} -> {operand.value + 1}"
                    yield "constant", operand, f"{operand.value} -> {operand.value - 1}"
        elif isinstance(node, ast.BoolOp):
            yield "connective", node, "and -> or" if isinstance(node.op, ast.And) else "or -> and"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield "negation", node, "not dropped"


_EQUIVALENT = re.compile(r"mutation: equivalent(?:\(([^)]*)\))?")


def _equivalent(line: str, operator: str, what: str) -> bool:
    """True when ``line`` marks the mutant (``operator``, ``what``) as equivalent."""
    m = _EQUIVALENT.search(line)
    if m is None:
        return False
    if m.group(1) is None:  # bare: every mutant of the line
        return True
    listed = {item.strip() for item in m.group(1).split(",")}
    return operator in listed or what in listed


def mutants(target: Target, *, equivalent: bool = False) -> list[Mutant]:
    """The mutants of ``target`` (``equivalent``: only those marked equivalent instead)."""
    source = (ROOT / target.file).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    out: list[Mutant] = []
    counter = 0
    for check in _checks(tree, target.functions):
        for operator, node, what in _sites(check):
            line = getattr(node, "lineno", check.lineno)
            if _equivalent(lines[line - 1], operator, what) == equivalent:
                out.append(Mutant(target, line, operator, what, counter))
            counter += 1
    return out


def _apply(source: str, m: Mutant) -> str:
    """The source of ``m.target.file`` with mutant ``m`` applied (re-found by its index)."""
    tree = ast.parse(source)
    counter = 0
    for check in _checks(tree, m.target.functions):
        for operator, node, what in _sites(check):
            if counter == m.index:
                assert (operator, what) == (m.operator, m.what), "the file changed under the run"
                _mutate(check, node, operator, what)
                return ast.unparse(ast.fix_missing_locations(tree)) + "\n"
            counter += 1
    raise AssertionError(f"mutant {m} not found")


def _mutate(check: ast.If, node: ast.AST, operator: str, what: str) -> None:
    if operator == "skip":
        check.test = ast.Constant(False)
    elif operator in ("boundary", "flip"):
        assert isinstance(node, ast.Compare)
        i = int(what.split(":")[0])
        table = _BOUNDARY if operator == "boundary" else _FLIP
        node.ops[i] = table[type(node.ops[i])]()
    elif operator == "constant":
        assert isinstance(node, ast.Constant) and isinstance(node.value, int)
        node.value = int(what.split(" -> ")[1])
    elif operator == "connective":
        assert isinstance(node, ast.BoolOp)
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif operator == "negation":
        assert isinstance(node, ast.UnaryOp)
        node.operand = ast.UnaryOp(ast.Not(), node.operand)  # not (not x): the test of x


def _pytest(tests: tuple[str, ...], timeout: float) -> str:
    """'passed', 'failed' or 'timeout' for the target's tests against the current tree."""
    cmd = [str(Path(sys.executable).parent / "pytest"), "-x", "-q", "-p", "no:cacheprovider",
           "--no-header", *tests]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "passed" if r.returncode == 0 else "failed"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", help=f"targets to run (default all): "
                    f"{', '.join(t.name for t in TARGETS)}")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--at", action="append", default=[], metavar="FILE:LINE",
                    help="only the mutants of this line (repeatable; e.g. the survivors of a run)")
    ap.add_argument("--equivalent", action="store_true",
                    help="list the mutants marked equivalent (with their lines) and exit")
    ap.add_argument("--timeout", type=float, default=90.0,
                    help="seconds one test run may take; longer counts as killed (default 90)")
    args = ap.parse_args(argv)
    by_name = {t.name: t for t in TARGETS}
    unknown = [n for n in args.targets if n not in by_name]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.targets] if args.targets else list(TARGETS)
    if args.equivalent:
        marked = [m for t in chosen for m in mutants(t, equivalent=True)]
        for m in marked:
            text = (ROOT / m.target.file).read_text().splitlines()[m.line - 1].strip()
            print(f"{m.target.file}:{m.line}  {m.operator:10}  {m.what:16}  {text}")
        print(f"{len(marked)} mutants marked equivalent")
        return 0
    todo = [m for t in chosen for m in mutants(t)]
    if args.at:
        todo = [m for m in todo if f"{m.target.file}:{m.line}" in set(args.at)]
    if args.list:
        for m in todo:
            print(f"{m.target.file}:{m.line}  {m.operator:10}  {m.what}")
        print(f"{len(todo)} mutants")
        return 0
    tests_of = {t.name: tuple(str(ROOT / p) for p in t.tests) for t in chosen}
    for t in chosen:  # the tests must pass on the unmutated tree first
        if _pytest(tests_of[t.name], args.timeout) != "passed":
            print(f"mutate: the tests of target {t.name} fail without a mutant; fix that first",
                  file=sys.stderr)
            return 2
    survived: list[Mutant] = []
    killed = 0
    start = time.monotonic()
    for i, m in enumerate(todo, 1):
        path = ROOT / m.target.file
        original = path.read_text()
        try:
            path.write_text(_apply(original, m))
            outcome = _pytest(tests_of[m.target.name], args.timeout)
        finally:
            path.write_text(original)
        if outcome == "passed":
            survived.append(m)
        else:
            killed += 1
        mark = "SURVIVED" if outcome == "passed" else outcome
        print(f"[{i}/{len(todo)}] {mark:8}  {m.target.file}:{m.line}  {m.operator}: {m.what}",
              flush=True)
    total = killed + len(survived)
    print(f"\n{killed} of {total} mutants killed ({100.0 * killed / max(total, 1):.1f}%) in "
          f"{time.monotonic() - start:.0f} s")
    for m in survived:
        print(f"  survived: {m.target.file}:{m.line}  {m.operator}: {m.what}")
    return 0 if not survived else 1


if __name__ == "__main__":
    sys.exit(main())

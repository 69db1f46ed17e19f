"""The ``kvdd`` command line: ``demo`` (the main job), ``bench`` and ``doctor``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _doctor(args: argparse.Namespace) -> int:
    import platform

    from . import __version__
    from .backend import BACKEND_NAMES, backend_problem, looks_like_ascend_node, resolve_backend_name

    try:
        cfg = importlib.import_module("kvdd._build_config")
        built = f"native built={cfg.NATIVE_BUILT} test_double={cfg.NATIVE_TEST_DOUBLE} " \
                f"ascend_home={cfg.ASCEND_HOME or '-'} cxx11_abi={cfg.CXX11_ABI}"
        if cfg.NATIVE_BUILT:  # otherwise the native backend line below gives the reason
            built += f" ({cfg.NATIVE_REASON})"
    except ImportError:
        built = "no build configuration (kvdd is not installed through meson)"
    print(f"kvdd {__version__} on Python {platform.python_version()} ({platform.machine()})")
    print(f"build: {built}")
    for name in BACKEND_NAMES:
        problem = backend_problem(name)
        print(f"backend {name}: {'usable' if problem is None else 'unavailable: ' + problem}")
    print(f"looks like an Ascend node: {looks_like_ascend_node()}")
    from .sim.fabric import describe_secret

    print(f"fabric secret: {describe_secret()}")
    try:
        print(f"backend=None selects: {resolve_backend_name(None)}")
    except (ImportError, ValueError) as exc:
        print(f"backend=None selects: nothing ({exc})")
    try:
        from ._native import _copy

        print(f"copy kernels: {_copy.cpu_features()}")
    except (ImportError, AttributeError) as exc:
        print(f"copy kernels: unavailable ({exc})")
    return 0


def _fabric_secret(args: argparse.Namespace) -> int:
    from .sim.fabric import generate_secret

    print(generate_secret())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_from_args

    return run_from_args(args)


def _bench(args: argparse.Namespace) -> int:
    from .bench import run_from_args as run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="which backends are built and usable here, and why not")
    doctor.set_defaults(func=_doctor)
    secret = sub.add_parser(
        "fabric-secret", help="print a new secret for KVDD_FABRIC_SECRET (links across hosts)",
        description="Print 32 random bytes as hex: put them into KVDD_FABRIC_SECRET or a file named by "
                    "KVDD_FABRIC_SECRET_FILE (mode 0600) on every host whose instances link (docs/security.md).")
    secret.set_defaults(func=_fabric_secret)
    from .demo import add_demo_arguments

    demo = sub.add_parser(
        "demo", help="prefill and decode move a real model's KV cache, verified byte for byte",
        description="Run a prefill and a decode LLM-DataDist instance (two processes on loopback by "
                    "default) that move a real model's KV cache with the transfers serving engines use "
                    "(paged block pull, layer-by-layer pull, batch-row pull, prefix pull, push) and "
                    "verify every byte. Exit status 0 when everything verified, 1 on any failure.")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)
    from .bench import add_bench_arguments

    bench = sub.add_parser(
        "bench", help="simulator transfer speed on real model geometries vs. memcpy, per-call overhead",
        description="Move real models' KV caches between two in-process simulator instances with each "
                    "transfer kind (PullKvCache row / size / layer range, PullKvBlocks, PushKvBlocks) and "
                    "report time, GB/s and the ratio to the best plain memcpy of the same bytes measured "
                    "in the same run, plus the per-call overhead of a 64-byte pull. A benchmark: it "
                    "reports, it does not judge (exit status 0; 2 for unusable options).")
    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())

"""Transfers from several threads over several links (kvdd rule §10.5): every byte still ends up
where the reference model says.  Smoke test only: it never asserts on time."""

from __future__ import annotations

import threading

from kvdd import LlmRole

from . import reference as ref
from .harness import Spec, World, link, pair


def test_parallel_pulls_over_two_links(world: World, transfer: str) -> None:
    d, p = pair(world, transfer)
    p2 = world.peer(3, LlmRole.PROMPT)
    p2.initialize(listen=True, transfer=transfer)
    spec = Spec(n=2, shape=(8, 16))
    ph = p.register(spec.n, spec.dtype, spec.shape)
    p2h = p2.register(spec.n, spec.dtype, spec.shape)
    # D pulls P's rows into its first cache and P2's rows into its second one.
    dh1 = d.register(spec.n, spec.dtype, spec.shape)
    dh2 = d.register(spec.n, spec.dtype, spec.shape)
    link(d, p)
    link(d, p2)
    before = world.snapshot()
    errors: list[BaseException] = []

    def worker(src_cluster: int) -> None:
        try:
            src, dst = (ph, dh1) if src_cluster == 1 else (p2h, dh2)
            for rnd in range(20):
                for row in range(8):
                    d.pull_kv_cache(src.index((row + rnd) % 8), dst.cache(), row)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in (1, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = before.copy()
    for src, dst in ((ph, dh1), (p2h, dh2)):
        for row in range(8):
            ref.pull_cache(expected.tensors(dst), before.tensors(src), dst.geom,
                           src_batch=(row + 19) % 8, dst_batch=row)
    world.assert_memory(expected)

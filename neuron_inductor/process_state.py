"""`neuron_inductor.reset()`: forget every process-wide store, as a new process would start."""

from __future__ import annotations


def reset() -> None:
    """Forget what this process compiled and recorded: the programs and compile records `report()`
    reads, the in-memory compile caches and their counters (entries on disk stay; `cache_stats()`
    starts from zero), the symbolic shape families, the rendered-kernel memo, the dump folders
    (the next dump makes a new one) and the kernels rebuilt for users' nki_ops. Users' nki_op
    definitions stay registered. Dynamo's own caches are `torch._dynamo.reset()`'s.
    """
    from . import cache, generalize
    from .codegen import render
    from .nki_ops import sources, wrap
    from .observe import cache_events, dump, hooks, session

    session.clear()
    hooks._PENDING.clear()
    cache_events._seen.clear()
    cache._caches.clear()
    generalize.reset()
    render._rendered.clear()
    dump._run_folders.clear()
    sources._interpreted.clear()
    wrap._eager_toolchains.clear()

"""The programs of one launch as cooperating NeuronCores: core_barrier and sendrecv between them.

`kernel[grid](...)` runs one program per grid point. Programs run one at a time, in grid
order, and switch only at a synchronisation point (nisa.core_barrier, nisa.sendrecv): the
program that reaches one waits there until every participant has arrived, and the next
program that can run takes over. Without synchronisation this is exactly sequential
execution; with it, each core sees the other's writes made before the matching sync point,
which is what the hardware guarantees. Every program has its own SBUF, PSUM and registers
and shares the launch's shared_hbm tensors (SPMD: the k-th shared_hbm allocation of every
program is one tensor). A sync point no other program can ever match is a deadlock error.

Grids of more than one program run each program on its own Python thread (handing over
a baton, never concurrently); torch's grad / inference mode and a replay's recording are
carried into the thread.
"""

from __future__ import annotations

import itertools
import threading

import torch

from . import context, op_replay
from .errors import NkiError


class _Aborted(Exception):
    """Raised in a waiting program when another program failed."""


class _Group:
    """Scheduling state of one launch: whose turn it is, who waits on which sync point."""

    def __init__(self, count):
        self.cond = threading.Condition()
        self.count = count
        self.turn = None           # index of the program allowed to run
        self.blocked = {}          # program index -> sync key it waits on
        self.arrived = {}          # sync key -> {program index: payload}
        self.complete = {}         # sync key -> {program index: payload} once everyone arrived
        self.finished = set()
        self.error = None

    def runnable(self, index) -> bool:
        key = self.blocked.get(index)
        return index not in self.finished and (key is None or key in self.complete)


_local = threading.local()  # .group and .index of the program running on this thread


def run_programs(func, args, kwargs, target, grid, name):
    """Run every program of `grid`; the result is program 0's return value."""
    ids = list(itertools.product(*(range(g) for g in grid)))
    shared = context.SharedOutputs()
    if len(ids) == 1:
        return _run_one(func, args, kwargs, target, ids[0], grid, name, shared)
    group = _Group(len(ids))
    results = [None] * len(ids)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    recorder = op_replay.active()  # a replay recording this launch: each program's thread records into it

    def body(index):
        _local.group, _local.index = group, index
        try:
            with group.cond:
                group.cond.wait_for(lambda: group.turn == index or group.error is not None)
                if group.error is not None:
                    return
            with torch.inference_mode(inference), torch.set_grad_enabled(grad), op_replay.recording_into(recorder):
                results[index] = _run_one(func, args, kwargs, target, ids[index], grid, name,
                                          context.SharedOutputs(shared.tensors))
        except _Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 -- re-raised on the launching thread
            with group.cond:
                if group.error is None:
                    group.error = error
        finally:
            with group.cond:
                group.finished.add(index)
                group.turn = None
                group.cond.notify_all()

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"{name}[{i}]") for i in range(len(ids))]
    for t in threads:
        t.start()
    _schedule(group)
    for t in threads:
        t.join()
    if group.error is not None:
        raise group.error
    return results[0]


def _schedule(group):
    with group.cond:
        while len(group.finished) < group.count and group.error is None:
            ready = [i for i in range(group.count) if group.runnable(i)]
            if not ready:
                waits = {i: group.blocked[i] for i in range(group.count) if i not in group.finished}
                group.error = NkiError(f"the programs of the launch deadlocked: {_describe(waits)} can never be "
                                       "matched (every participant must reach the same sync points in the same order)")
                break
            group.turn = ready[0]
            group.cond.notify_all()
            group.cond.wait_for(lambda: group.turn is None)
        group.cond.notify_all()


def _describe(waits) -> str:
    return ", ".join(f"program {i} waits at {key[0]} #{key[-1]}" for i, key in sorted(waits.items()))


def _run_one(func, args, kwargs, target, program_id, grid, name, shared):
    program = context.ProgramContext(target, program_id, grid, name, shared)
    context.push(program)
    try:
        return func(*args, **kwargs)
    finally:
        context.pop()


def sync(api, kind, participants, payload):
    """Arrive at the next `kind` sync point with `participants`; wait for them; -> {index: payload}."""
    group = getattr(_local, "group", None)
    index = getattr(_local, "index", 0)
    participants = frozenset(participants)
    if group is None or index not in participants or max(participants) >= group.count:
        count = group.count if group is not None else 1
        raise NkiError(f"{api}: synchronises programs {sorted(participants)}, but the launch has {count} "
                       f"program(s) and this is program {index} (launch the kernel as kernel[2](...) for LNC=2)")
    counts = context.current().sync_counts
    sequence = counts.get(kind, 0)
    counts[kind] = sequence + 1
    key = kind + (tuple(sorted(participants)), sequence)
    with group.cond:
        arrived = group.arrived.setdefault(key, {})
        arrived[index] = payload
        if set(arrived) == participants:
            group.complete[key] = arrived
        group.blocked[index] = key
        group.turn = None
        group.cond.notify_all()
        group.cond.wait_for(lambda: group.turn == index or group.error is not None)
        del group.blocked[index]
        if group.error is not None:
            raise _Aborted()
        return group.complete[key]

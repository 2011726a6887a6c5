"""The programs of one launch as NeuronCores running side by side on shared HBM.

`kernel[grid](...)` runs one program per grid point. The physical cores of the target's logical
core (`target.default_lnc`: 2 on trn2 / trn3, 1 on trn1) start together; program k runs on core
k % cores, and the programs of one core run one after another (the cost model's placement).

What one core can observe of another is its HBM traffic: SBUF, PSUM and registers are each
program's own. So the programs advance in lockstep on their HBM accesses (`step`, called by
every DMA: dma_copy, dma_transpose, dma_compute, nl.load / nl.store; and by register_load /
register_store on an HBM tensor): each program counts the
accesses it made, and the next access made is always the one with the smallest count (ties go
to the lower program). Between two accesses a program runs alone, touching only its own memory.
This is cores running the same instruction stream at the same speed: two programs that zero and
then fill shared HBM without a barrier interleave as on hardware (both zero, then both fill),
not as program 0 running to its end first. The order is deterministic.

Sync points (nisa.core_barrier, nisa.sendrecv; `sync`): a program waits there until every
participant has arrived; they leave together (their access counts become the largest among
them), so each sees the others' writes made before it. A sync point no other program can ever
reach is a deadlock, raised as NkiRuleError naming each program and where it waits. An error in
one program stops the others at their next HBM access or sync point; it is raised on the
launching thread with a note naming the program that raised it.

Each program runs on its own Python thread and only the holder of the baton runs (never two at
once). The threads keep the caller's inference mode (recycled tiles depend on it) but run with
grad disabled: kernel instructions are not differentiable, and interleaved programs writing views
of one shared tensor would hand autograd's view histories from one program to another. A
one-program launch runs on the caller's thread with no scheduling. A replay recording the launch
records every program's ops, in the order they run (op_replay.recording_into).
"""

from __future__ import annotations

import itertools
import threading

import torch

from . import context, op_replay
from .errors import NkiError, NkiRuleError


class _Aborted(BaseException):
    """Raised in a waiting program when another program failed (a BaseException: a kernel's own
    `except Exception` must not swallow it and run on past the failure)."""


class _Group:
    """Scheduling state of one launch: the programs' lockstep positions, whose turn it is, who waits where.

    Every field is read and written with `lock` held."""

    def __init__(self, count, cores):
        self.lock = threading.Lock()
        self.wakeups = [threading.Condition(self.lock) for _ in range(count)]  # one per program
        self.count, self.cores = count, cores
        self.clock = [0] * count   # HBM accesses made so far, per program
        self.turn = None           # index of the program holding the baton
        self.blocked = {}          # program index -> sync key it waits on
        self.arrived = {}          # sync key -> {program index: payload}
        self.complete = {}         # sync key -> {program index: payload} once everyone arrived
        self.finished = set()
        self.error = None

    def waits_for(self, index):
        """Why program `index` cannot run now (a sync key, the earlier program of its core, "finished"), or None."""
        if index in self.finished:
            return "finished"
        earlier = index - self.cores
        if earlier >= 0 and earlier not in self.finished:
            return earlier
        key = self.blocked.get(index)
        return None if key is None or key in self.complete else key

    def pass_baton(self):
        """Give the baton to the runnable program with the smallest lockstep position (maybe the caller)."""
        if self.error is None:
            ready = [i for i in range(self.count) if self.waits_for(i) is None]
            if ready:
                self.turn = min(ready, key=lambda i: (self.clock[i], i))
                self.wakeups[self.turn].notify()
                return
            if len(self.finished) < self.count:
                self.error = self._deadlock()
        self.turn = None
        for wakeup in self.wakeups:
            wakeup.notify()

    def wait_turn(self, index):
        if self.turn != index:
            self.wakeups[index].wait_for(lambda: self.turn == index or self.error is not None)
        if self.error is not None:
            raise _Aborted()

    def finish(self, index):
        self.finished.add(index)
        successor = index + self.cores  # the next program of this core starts where this one stopped
        if successor < self.count:
            self.clock[successor] = max(self.clock[successor], self.clock[index])
        self.pass_baton()

    def _deadlock(self) -> NkiRuleError:
        states, first_sync = [], None
        for i in range(self.count):
            why = self.waits_for(i)
            if why == "finished":
                states.append(f"program {i} has finished")
            elif isinstance(why, int):
                states.append(f"program {i} waits for program {why} to finish (both run on core {i % self.cores})")
            else:
                api, participants, sequence = _sync_api(why), why[-2], why[-1]
                first_sync = first_sync or api
                states.append(f"program {i} waits at {api} #{sequence} with programs {list(participants)}, "
                              f"which programs {sorted(self.arrived[why])} reached")
        return NkiRuleError(first_sync, "every participant reaches the same sync points in the same order",
                            states, "the programs of the launch deadlocked: " + "; ".join(states))


def _sync_api(key) -> str:
    kind = key[0]
    return f"nisa.sendrecv(pipe_id={key[1]})" if kind == "sendrecv" else f"nisa.{kind}"


class _Local(threading.local):
    group = None  # the _Group of the program running on this thread, None outside multi-program launches
    index = 0


_local = _Local()
_launches = 0  # multi-program launches running (in any thread): step() is free while there are none
_launches_lock = threading.Lock()


def run_programs(func, args, kwargs, target, grid, name):
    """Run every program of `grid`; the result is program 0's return value."""
    ids = list(itertools.product(*(range(g) for g in grid)))
    shared = context.SharedOutputs()
    if len(ids) == 1:
        return _run_one(func, args, kwargs, target, ids[0], grid, name, shared)
    global _launches
    group = _Group(len(ids), target.default_lnc)
    results = [None] * len(ids)
    inference = torch.is_inference_mode_enabled()
    recorder = op_replay.active()  # a replay recording this launch: each program's thread records into it

    def body(index):
        _local.group, _local.index = group, index
        try:
            with group.lock:
                group.wait_turn(index)
            with torch.inference_mode(inference), torch.no_grad(), op_replay.recording_into(recorder):
                results[index] = _run_one(func, args, kwargs, target, ids[index], grid, name,
                                          context.SharedOutputs(shared.tensors))
        except _Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 -- re-raised on the launching thread
            error.add_note(f"(in program {index} of the {len(ids)}-program launch {name}[{', '.join(map(str, grid))}])")
            with group.lock:
                if group.error is None:
                    group.error = error
        finally:
            with group.lock:
                group.finish(index)

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"{name}[{i}]") for i in range(len(ids))]
    with _launches_lock:
        _launches += 1
    try:
        for t in threads:
            t.start()
        with group.lock:
            group.pass_baton()
        for t in threads:
            t.join()
    finally:
        with _launches_lock:
            _launches -= 1
    if group.error is not None:
        raise group.error
    return results[0]


def _run_one(func, args, kwargs, target, program_id, grid, name, shared):
    program = context.ProgramContext(target, program_id, grid, name, shared)
    context.push(program)
    try:
        return func(*args, **kwargs)
    finally:
        context.pop()


def step() -> None:
    """An HBM access of the running program: it happens at this program's next lockstep position, after
    every other program's accesses at earlier positions. Free outside multi-program launches."""
    if not _launches:
        return
    group = _local.group
    if group is None:
        return
    index = _local.index
    with group.lock:
        group.clock[index] += 1
        group.pass_baton()
        group.wait_turn(index)


def sync(api, kind, participants, payload):
    """Arrive at the next `kind` sync point with `participants`; wait for them; -> {index: payload}."""
    group, index = _local.group, _local.index
    participants = frozenset(participants)
    if group is None or index not in participants or max(participants) >= group.count:
        count = group.count if group is not None else 1
        raise NkiError(f"{api}: synchronises programs {sorted(participants)}, but the launch has {count} "
                       f"program(s) and this is program {index} (launch the kernel as kernel[2](...) for LNC=2)")
    counts = context.current().sync_counts
    sequence = counts.get(kind, 0)
    counts[kind] = sequence + 1
    key = kind + (tuple(sorted(participants)), sequence)
    with group.lock:
        arrived = group.arrived.setdefault(key, {})
        arrived[index] = payload
        group.blocked[index] = key
        if set(arrived) == participants:
            group.complete[key] = arrived
            position = max(group.clock[i] for i in participants)  # they leave the sync point together
            for i in participants:
                group.clock[i] = position
        group.pass_baton()
        group.wait_turn(index)
        del group.blocked[index]
        return group.complete[key]

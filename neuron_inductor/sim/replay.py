"""Record and replay of copy-only kernels: a kernel whose every instruction is an exact dma_copy
(same dtype, no indirection) is run for real and recorded; later calls with arguments of the same
shapes, strides, dtypes and aliasing replay its copies as plain torch copies. A signature is recorded
on its second call, its first runs normally (`_SEEN`): most signatures are called once (a test's,
a compiled program's first call), and recording costs about what the run does.

Such a kernel's control flow, its rule checks and its trace depend on shapes only, so the recorded run
checks the rules and records the trace; a replay appends the same instructions to the active traces
and performs the same copies in the same order, bit for bit. A tile that is written whole by one DMA
and then read whole (with no write to the source in between) is skipped: each read copies straight
from the tile's source, the same bytes; the copies of one tile loop become one strided copy
(copy_batching.py). Kernels that do anything else, that allocate private HBM,
or whose tiles are used otherwise are never replayed (they run normally, every time).

Only kernels that opt in (`Kernel(..., replay=True)`: the backend's generated kernels, which read no
register values) are recorded.
"""

from __future__ import annotations

import copy
import os
import weakref

import torch

from . import copy_batching, dtypes, op_replay, rules, tracing
from .targets import get_target
from .tensor import NkiTensor

_RECORDER = None  # the Recording of the kernel running now, if one is being recorded
_PLANS: dict = {}  # (func, signature) -> Plan, or None when the kernel cannot be replayed
_MAX_PLANS = 4096
_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # func -> the same kernel under another name
# (func, signature) called once, run normally: a signature is recorded on its second call (the first
# bf16 step at d=1024 takes 6.7 s run, 13.7 s recorded, 18.3 s with its plans made)
_SEEN: set = set()


def forget() -> None:
    """Drop every recorded plan (`neuron_inductor.reset()`)."""
    _PLANS.clear()
    _TWINS.clear()
    _SEEN.clear()
    op_replay.release()


def share_plans(func, twin) -> None:
    """`func` is `twin`'s kernel under another name (a model's repeated layers repeat kernels): a call
    of `func` with a signature `twin` has recorded replays `twin`'s plan, its instructions named
    after `func`, instead of running slowly to record the same plan again."""
    _TWINS[func] = twin


def _twin_plan(func, key: tuple):
    """The plan of `func`'s twin for `key`, its trace renamed; None when it has recorded none."""
    plan = _PLANS.get((_TWINS[func], key))
    return None if plan is None else _renamed(plan, func)


def _renamed(plan, func):
    """A copy of `plan` whose trace names kernel `func`."""
    name = func.__name__
    plan = copy.copy(plan)
    plan.instructions = [tracing.Instruction(i.engine, i.op, i.flops, i.bytes, i.free_size, i.partitions, i.operands,
                                             name, i.program_id, i.allocs, i.dma_run_bytes)
                         for i in plan.instructions]
    return plan


class Recording:
    """The exact copies of one run, as (dst view, src view) per dma_copy. A view is (owner, sizes,
    strides, offset into the owner's storage, whole), owner = ("arg", i) | ("out", k) | ("tile", n);
    `whole`: the view is all of its allocation, in the allocation's own layout."""

    def __init__(self, args: tuple) -> None:
        self.args = {id(a): i for i, a in enumerate(args)}  # the caller's tensors are the HBM storage
        self.tiles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Allocation -> tile number
        self.outputs: list = []  # (Allocation, NKI dtype) of each shared_hbm output, in order
        self.copies: list = []
        self.replayable = True

    def view(self, t) -> tuple | None:
        alloc = t.alloc
        storage = alloc.storage
        if id(storage) in self.args:
            owner = ("arg", self.args[id(storage)])
        elif alloc.pool is not None:  # an on-chip tile (recycled storage gets a new Allocation)
            number = self.tiles.get(alloc)
            if number is None:
                number = self.tiles[alloc] = len(self.tiles) + len(self.copies)
            owner = ("tile", number)
        else:
            found = [k for k, (a, _) in enumerate(self.outputs) if a is alloc]
            if not found:
                return None  # private HBM, a staged gather, a reshape's read-only copy: not replayed
            owner = ("out", found[0])
        data = t.data
        offset = data.storage_offset() - storage.storage_offset()
        whole = (offset == 0 and data.numel() == storage.numel() and data.is_contiguous()
                 and storage.is_contiguous())
        return owner, tuple(data.shape), data.stride(), offset, whole

    def note_copy(self, dst, src) -> None:
        if self.replayable:
            d, s = self.view(dst), self.view(src)
            if d is None or s is None:
                self.replayable = False
            else:
                self.copies.append((d, s))


def note_copy(dst, src) -> None:
    """isa's exact dma_copy (same dtype and storage): remembered while recording."""
    if _RECORDER is not None:
        _RECORDER.note_copy(dst, src)


def note_output(t) -> None:
    """A new shared_hbm output: remembered while recording."""
    if _RECORDER is not None:
        _RECORDER.outputs.append((t.alloc, t.dtype))


def signature(args: tuple, kwargs: dict, grid, platform_target) -> tuple | None:
    """What a replay must match (every argument's layout, dtype and which of the call's storages it is
    on, the grid, inference mode (it changes which operations torch dispatches, and its tensors are
    not written outside it), the target), or None when the call is not replayed (keyword or non-tensor
    arguments). Arguments sharing memory (`cat([x, x])` passes x twice) replay only if the kernel
    writes none of its arguments (`run`)."""
    if kwargs:
        return None
    parts, storages = [], {}
    grad = torch.is_grad_enabled()
    for a in args:
        if type(a) not in _TENSOR_TYPES or (a.requires_grad and grad) or a.is_meta:
            return None
        storage = storages.setdefault(a.untyped_storage().data_ptr(), len(storages))
        parts.append((a.shape, a.stride(), a.storage_offset(), a.dtype, storage))  # (a torch.Size is a tuple)
    return (tuple(parts), grid, torch.is_inference_mode_enabled(), get_target(platform_target).name, os.environ.get(dtypes.FP32_STORAGE_ENV, ""),
            os.environ.get(rules.STRICT_ENV, ""))


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # (a parameter is a plain tensor to the kernel)


class _Leaf:
    """A returned tensor in a Plan's result structure."""

    __slots__ = ("view",)

    def __init__(self, view) -> None:
        self.view = view


class Plan:
    """What a replay does: make the outputs, perform the copies (tiles fused away), record the trace."""

    def __init__(self, copies, outputs, result, instructions) -> None:
        self.copies = copies              # [(dst view, src view)] on arguments and outputs only
        self.outputs = outputs            # [(shape, storage dtype, fill)] of the shared_hbm outputs
        self.result = result              # the return structure, tensors as _Leaf
        self.instructions = instructions  # the first run's trace
        self.written_args = tuple(sorted({dst[0][1] for dst, _ in copies if dst[0][0] == "arg"}))

    def run(self, args: tuple):
        outs = [torch.full(shape, fill, dtype=dtype) for shape, dtype, fill in self.outputs]

        def view(spec):
            (kind, index), sizes, strides, offset, whole = spec
            base = args[index] if kind == "arg" else outs[index]
            if offset == 0 and sizes == base.shape and strides == base.stride():
                return base  # the tensor itself, as a kernel returning it gives it back
            return base.as_strided(sizes, strides, base.storage_offset() + offset)

        with op_replay.below_autograd():
            for dst_spec, src_spec in self.copies:
                dst, src = view(dst_spec), view(src_spec)
                if dst_spec[0] == src_spec[0]:
                    src = src.clone()  # overlapping views of one allocation, as isa._copy_exact
                dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
        op_replay.bump_versions(args, self.written_args)
        for trace in tracing.ACTIVE:
            trace.instructions.extend(self.instructions)
        return _rebuild(self.result, view)


def _rebuild(result, view):
    if isinstance(result, _Leaf):
        return view(result.view)
    if isinstance(result, (tuple, list)):
        return type(result)(_rebuild(r, view) for r in result)
    return result


def _fuse_tiles(copies) -> list | None:
    """The copies with each tile replaced by its source, or None when a tile is used any other way
    than written whole once (from an argument or output) and then read whole."""
    loaded: dict = {}  # tile owner -> (src view, index of its write)
    fused = []
    for index, (dst, src) in enumerate(copies):
        if dst[0][0] == "tile":
            if dst[0] in loaded or not dst[4] or src[0][0] == "tile":
                return None
            loaded[dst[0]] = (src, index)
        elif src[0][0] == "tile":
            found = loaded.get(src[0])
            if found is None or not src[4]:
                return None
            source, at = found
            if any(d[0] == source[0] for d, _ in copies[at + 1:index]):
                return None  # the tile's source was written after the tile was loaded
            fused.append((dst, source))
        else:
            fused.append((dst, src))
    return fused


def plan_for(recording: Recording, result, instructions: list) -> Plan | None:
    if not recording.replayable or len(instructions) != len(recording.copies) \
            or any(i.op != "dma_copy" for i in instructions):
        return None  # another instruction, or a DMA that converts
    copies = _fuse_tiles(recording.copies)
    if copies is None:
        return None
    copies = copy_batching.batched(copies)
    leaves = []

    def structure(value):
        if isinstance(value, NkiTensor):
            found = recording.view(value)
            leaves.append(found)
            return _Leaf(found)
        if isinstance(value, (tuple, list)):
            return type(value)(structure(v) for v in value)
        return value

    shape = structure(result)
    if any(v is None or v[0][0] == "tile" for v in leaves):
        return None
    outputs = [(tuple(a.storage.shape), a.storage.dtype, dtypes.fill_value(dtype)) for a, dtype in recording.outputs]
    return Plan(copies, outputs, shape, instructions)


_NOT_RECORDED = object()


def run(func, args: tuple, kwargs: dict, grid, platform_target, launch, unwrap):
    """The kernel's torch result: `launch()` (-> the NKI result) run normally the first time, recorded the
    second, replayed after."""
    global _RECORDER
    key = signature(args, kwargs, grid, platform_target)
    if key is None or _RECORDER is not None:
        return unwrap(launch())
    signature_key, key = key, (func, key)
    plan = _PLANS.get(key, _NOT_RECORDED)  # (one lookup: a signature's hash is not cached)
    if plan is _NOT_RECORDED and func in _TWINS and len(_PLANS) < _MAX_PLANS:
        twin = _twin_plan(func, signature_key)
        if twin is not None:
            _PLANS[key] = plan = twin
    if plan is not _NOT_RECORDED:
        if plan is not None:
            try:
                return plan.run(args)
            except op_replay.Mismatch:
                pass  # a value-dependent read differed: this call runs normally
        return unwrap(launch())
    seen = (_TWINS.get(func, func), signature_key)  # a twin's call is a call of its kernel
    if seen not in _SEEN:
        if len(_SEEN) < _MAX_PLANS:
            _SEEN.add(seen)
        return unwrap(launch())
    _RECORDER = recording = Recording(args)
    recording.replayable = grid == (1,)  # an SPMD launch's programs share outputs: replayed as operations only
    try:
        with tracing.Trace() as recorded, op_replay.Recorder(args) as operations:
            result = launch()
            out = unwrap(result)
    finally:
        _RECORDER = None
    if len(_PLANS) < _MAX_PLANS:
        plan = plan_for(recording, result, recorded.instructions)
        if plan is None:
            plan = op_replay.plan_for(operations, out, recorded.instructions)
        if plan is not None and plan.written_args and _shares_memory(key[1]):
            plan = None  # the plans take a write through one argument for no change to another
        _PLANS[key] = plan
        if seen[0] is not func and seen not in _PLANS:  # recorded by a twin: the kernel's own calls replay it too
            _PLANS[seen] = None if plan is None else _renamed(plan, seen[0])
    return out


def plans(func=None) -> list:
    """The plans recorded for kernel `func` (every kernel's when None), one per signature; None where
    the kernel cannot be replayed."""
    return [plan for (f, _), plan in _PLANS.items() if func is None or f is func]


def _shares_memory(key: tuple) -> bool:
    """Whether two arguments of a call with signature `key` are on one storage."""
    storages = [part[4] for part in key[0]]
    return len(set(storages)) < len(storages)

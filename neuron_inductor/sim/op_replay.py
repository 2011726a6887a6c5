"""Record and replay of compute kernels as the torch operations their instructions ran.

A kernel's control flow, rule checks and trace depend on its arguments' shapes only, so what its
instructions do to torch storage is one fixed sequence of ATen operations per call signature. A
call runs normally under a TorchDispatchMode that records that sequence (a signature's second call,
replay.py: most are called once, and recording costs about what the run does); later calls run it
as one generated straight-line Python function: the same operations on the same layouts in the
same order, hence the same bits, without the NKI objects, index checks and rule checks (whose
verdicts the recorded run took).

What the generated function leaves out, and why that changes no bit:
- operations whose results nothing reads: the interpreter's bookkeeping (PSUM written masks, the
  NaN fill of a recycled tile that is then overwritten whole) and views nothing uses;
- data-independent Python reads (`bool(mask.all())` on bookkeeping derived from constants only):
  their value is the same on every call. A read of values derived from the data (the activation
  range check) stays as a guard: if it reads another value, the replay stops and the kernel runs
  normally. A plan whose guards come after a write to an argument is not made (the slow path could
  not start over).

Default-deny: an operation outside ATen / prims, a seeded random one, a non-tensor argument it does
not know, or a tensor from outside the kernel (other than a 0-d number) keeps the kernel on the
slow path for that signature.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.weak import WeakIdKeyDictionary

from . import (op_replay_bindings, op_replay_casts, op_replay_fills, op_replay_folding, op_replay_forwarding,
               op_replay_transposes, tracing)
from .op_replay_refs import Ref, map_refs, ref_names, renamed

MAX_OPS = 200_000  # recorded operations per kernel: bounds the generated function's size (larger: slow path)


class Unsupported(Exception):
    """The recorded kernel does something the replay does not reproduce."""


class Mismatch(Exception):
    """A guard read another value than on the recorded run: the call runs on the slow path."""


class _Op:
    __slots__ = ("func", "args", "kwargs", "outs", "reads", "new_slots", "in_keys", "out_keys", "writes",
                 "whole_write", "view", "guard", "live", "runtime_guard", "fold")

    def __init__(self, func, args, kwargs, outs, reads, new_slots, in_keys, out_keys, writes, whole_write, view,
                 guard):
        self.func = func
        self.args, self.kwargs, self.outs = args, kwargs, outs  # templates: Ref for tensors, values otherwise
        self.reads = reads            # names of the tensor inputs
        self.new_slots = new_slots    # names of the tensors it creates
        self.in_keys = in_keys        # storage keys of its tensor inputs
        self.out_keys = out_keys      # storage keys of the tensors it creates
        self.writes = writes          # storage keys it writes in place
        self.whole_write = whole_write  # the storage key it overwrites whole (copy_ / fill_ / zero_), or None
        self.view = view
        self.guard = guard            # (value,) for operations returning Python values, else None
        self.live = self.runtime_guard = False
        self.fold = None  # a view: (root name, sizes, strides, offset), made by one as_strided of its root


_OVERWRITES = {"aten::copy_", "aten::fill_", "aten::zero_"}
_CONSTANT_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layout(root: str, t: torch.Tensor) -> tuple:
    return root, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype


def _is_whole(t: torch.Tensor) -> bool:
    storage = t.untyped_storage()
    return (storage.nbytes() > 0 and t.storage_offset() == 0 and t.is_contiguous()
            and t.numel() * t.element_size() == storage.nbytes())


class Recorder(TorchDispatchMode):
    """Records the ATen operations of one kernel run on `args` (the caller's tensors)."""

    def __init__(self, args: tuple) -> None:
        super().__init__()
        self.args = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        self.arg_tensors = args
        self.arg_keys = {_key(a) for a in args if isinstance(a, torch.Tensor)}
        self.names = WeakIdKeyDictionary()  # tensor -> its variable name
        self.layouts = {f"a{i}": _layout(f"a{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        self.slots = 0
        self.constants: list = []
        self.ops: list[_Op] = []
        self.denied: str | None = None

    # -- naming
    def ref(self, t: torch.Tensor, func=None, position=None) -> str:
        index = self.args.get(id(t))
        if index is not None and self.arg_tensors[index] is t:
            return f"a{index}"
        name = self.names.get(t)
        if name is not None:
            return name
        if position == 0 and func is not None and func._schema.name in ("aten::fill_", "aten::zero_") and _is_whole(t):
            # a recycled tile (its storage comes from an earlier kernel) filled whole: a fresh tile
            name = self._new(t)
            self.ops.append(_Op(torch.ops.aten.empty.memory_format, (list(t.shape),),
                                {"dtype": self.constant(t.dtype), "device": self.constant(t.device)}, Ref(name), (), (name,), (), (_key(t),), (), None,
                                False, None))
            return name
        if t.dim() == 0 and not t.requires_grad:
            self.constants.append(t)  # a Python number torch wrapped as a tensor
            return f"c{len(self.constants) - 1}"
        raise Unsupported(f"{func}: reads a tensor of shape {list(t.shape)} from outside the kernel")

    def _new(self, t: torch.Tensor) -> str:
        name = f"v{self.slots}"
        self.slots += 1
        self.names[t] = name
        self.layouts[name] = _layout(name, t)
        return name

    def template(self, value, func, reads: list, keys: list, position=None):
        if isinstance(value, torch.Tensor):
            name = self.ref(value, func, position)
            if name[0] != "c":
                reads.append(name)
                keys.append(_key(value))
            return Ref(name)
        if isinstance(value, (list, tuple)):
            return type(value)(self.template(v, func, reads, keys) for v in value)
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
        elif not isinstance(value, _CONSTANT_TYPES):
            raise Unsupported(f"{func}: an argument of type {type(value).__name__}")
        return self.constant(value)

    def constant(self, value) -> Ref:
        self.constants.append(value)
        return Ref(f"c{len(self.constants) - 1}")

    # -- recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.denied is None:
            try:
                self._note(func, args, kwargs, out)
            except Unsupported as reason:
                self.denied = str(reason)
        return out

    def _note(self, func, args, kwargs, out) -> None:
        if func.namespace not in ("aten", "prims") or torch.Tag.nondeterministic_seeded in func.tags:
            raise Unsupported(f"{func}: not replayed (not ATen, or random)")
        schema = func._schema
        reads, keys = [], []
        targs = tuple(self.template(a, func, reads, keys, position=i) for i, a in enumerate(args))
        tkwargs = {k: self.template(v, func, reads, keys) for k, v in kwargs.items()}
        writes = []
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
                for t in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(t, torch.Tensor):
                        writes.append(_key(t))
        whole = _key(args[0]) if schema.name in _OVERWRITES and _is_whole(args[0]) else None
        new_slots, guard = [], None
        if isinstance(out, torch.Tensor) or (isinstance(out, (tuple, list)) and out
                                             and all(isinstance(o, torch.Tensor) for o in out)):
            touts = self._outputs(out, new_slots)
        elif out is None or (isinstance(out, (tuple, list)) and not out):
            touts = None
        elif isinstance(out, (bool, int, float)):
            touts, guard = None, (out,)
        else:
            raise Unsupported(f"{func}: returns {type(out).__name__}")
        out_keys = tuple(_key(t) for t in _tensors(out)) if new_slots else ()
        op = _Op(func, targs, tkwargs, touts, tuple(reads), tuple(new_slots), tuple(keys), out_keys,
                 tuple(writes), whole, func.is_view and _aliases(out, args), guard)
        if op.view and len(new_slots) == 1 and isinstance(touts, Ref) and reads and reads[0] in self.layouts:
            root = self.layouts[reads[0]][0]
            if self.layouts[root][4] is out.dtype:  # (a dtype view is no as_strided of its root)
                name = new_slots[0]
                self.layouts[name] = layout = (root,) + self.layouts[name][1:]
                op.fold = layout[:4]
        self.ops.append(op)

    def _outputs(self, out, new_slots: list):
        if isinstance(out, (tuple, list)):
            return type(out)(self._outputs(o, new_slots) for o in out)
        index = self.args.get(id(out))
        if index is not None and self.arg_tensors[index] is out:
            return Ref(f"a{index}")
        name = self.names.get(out)
        if name is None:
            name = self._new(out)
            new_slots.append(name)
        return Ref(name)


class _Forward(TorchDispatchMode):
    """Records into a Recorder of another thread: the programs of an SPMD launch run on threads of
    their own, one at a time (cores.py), so their operations form one sequence in the order they ran."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recorder.__torch_dispatch__(func, types, args, kwargs)


def active() -> Recorder | None:
    """The Recorder recording on this thread, if any."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, Recorder):
            return mode
        if isinstance(mode, _Forward):
            return mode.recorder
    return None


def recording_into(recorder: Recorder | None):
    """A context recording this thread's operations into `recorder` (None: records nothing)."""
    return contextlib.nullcontext() if recorder is None else _Forward(recorder)


def _aliases(out, args) -> bool:
    """Whether a view operation's result is a view of its input. Under inference mode composite
    operations reach the recorder undecomposed, and `reshape` / `flatten` are declared views that
    copy when the layout cannot be viewed: those are operations reading their input."""
    base = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return base is not None and all(_key(t) == _key(base) for t in _tensors(out))


def deny(reason: str) -> None:
    """Keep the kernel being recorded (if any) on the slow path: for instructions whose Python reads
    values the recorder does not see as guards (indirect DMA rows out of bounds)."""
    recorder = active()
    if recorder is not None and recorder.denied is None:
        recorder.denied = reason


class Plan:
    """A recorded kernel as a generated function of the caller's tensors -> the kernel's torch result."""

    def __init__(self, function, instructions: list, counts: dict, written_args: tuple = ()) -> None:
        self.function = function
        self.instructions = instructions  # the first run's trace
        self.counts = counts              # {"recorded": ops, "replayed": calls made, "guards": running guards}
        self.written_args = written_args  # positions of the arguments the kernel writes

    def run(self, args: tuple):
        """The result, or raises Mismatch (then nothing the caller sees was written). Called inside
        launch.kernel_threads, as the slow path runs: the thread count can change a matmul's sums."""
        with below_autograd():
            result = self.function(*args)
        bump_versions(args, self.written_args)
        for trace in tracing.ACTIVE:
            trace.instructions.extend(self.instructions)
        return result


def below_autograd():
    """A context dispatching torch operations straight to their CPU kernels, past the autograd and
    ADInplaceOrView layers: a replay's tensors never require grad (replays.signature), so those layers
    only cost time (about 0.6-1 us of a small op's 1-2 us), and the same kernels run, on the same bits.
    What the skipped layer did that the caller can see, `bump_versions` does: in-place writes there
    advance the written tensors' version counters (autograd's check on saved tensors)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def bump_versions(args: tuple, positions: tuple) -> None:
    """Advance the version counter of the arguments at `positions` (written by a replay below autograd)."""
    if positions:
        torch.autograd.graph.increment_version([args[i] for i in positions])


PERSISTENT_BYTES = 64 << 20  # per plan: on-chip tiles kept between calls instead of allocated per call
# over every plan of the process (plans live as long as it does): past it, plans allocate their tiles per call
PERSISTENT_TOTAL_BYTES = 1 << 30
_persistent_total = 0


def release() -> None:
    """Forget the kept tiles' byte count (the plans holding them are being dropped)."""
    global _persistent_total
    _persistent_total = 0


def plan_for(recorder: Recorder, result, instructions: list) -> Plan | None:
    """The replay of a recorded run whose kernel returned `result` (torch tensors), or None."""
    if recorder.denied is not None or len(recorder.ops) > MAX_OPS:
        return None
    try:
        result_template = _result_template(recorder, result)
    except Unsupported:
        return None
    result_names, result_keys = set(ref_names(result_template)), {_key(t) for t in _tensors(result)}
    ops = recorder.ops
    persistent = _persistent(recorder, ops, result_keys)
    _mark_guards(ops, recorder.arg_keys)
    _mark_live(ops, recorder.arg_keys | result_keys, result_names, persistent)
    live = [op for op in ops if op.live]
    guards = [i for i, op in enumerate(live) if op.runtime_guard]
    writes_arg = [i for i, op in enumerate(live) if any(k in recorder.arg_keys for k in op.writes)]
    if guards and writes_arg and writes_arg[0] < guards[-1]:
        return None  # a guard after an argument was written: a failed replay could not fall back
    written = {k for op in ops for k in op.writes}
    skipped = op_replay_fills.skippable(live, recorder.layouts, recorder.arg_keys | result_keys)
    # a skipped fill goes; a skipped output's torch.full becomes torch.empty; a kept tile whose fill is
    # skipped is no longer re-initialised per call (nothing reads what the last call left in it)
    live = [op if i not in skipped else _as_empty(op) for i, op in enumerate(live)
            if i not in skipped or (op.func is _FULL and op.new_slots[0] not in persistent)]
    calls, namespace = _calls(live, recorder, result_names, persistent, written)
    calls = op_replay_casts.reused(calls, namespace, result_names)
    visible = result_names | {name for name in recorder.layouts if name[0] == "a"}
    # names made on an input's storage by operations that are no views (`_unsafe_view`): is it the first input's
    aliasing = {name: set(op.out_keys) & set(op.in_keys) <= set(op.in_keys[:1]) for op in live
                if not op.view and set(op.out_keys) & set(op.in_keys) for name in op.new_slots}
    calls = op_replay_forwarding.forwarded(calls, namespace, recorder.layouts, visible, aliasing,
                                           lambda call: _faithful(call, recorder, namespace))
    calls = op_replay_transposes.routed(op_replay_casts.hoisted(calls, namespace), namespace, recorder.layouts)
    calls = _folded(calls, namespace, result_names, set(aliasing))
    # views only the dropped copies or folded lines read, and the recorded views of arguments a routed load replaced
    calls = _without_unread_views(calls, result_names)
    # Python bindings where they dispatch exactly the recorded operation, else the operation object
    function = _generate(calls, recorder, result_template, result_names, namespace,
                         _unfaithful_bindings(calls, recorder, namespace))
    written_args = tuple(i for i, a in enumerate(recorder.arg_tensors)
                         if isinstance(a, torch.Tensor) and _key(a) in written)
    return Plan(function, instructions, {"recorded": len(ops), "replayed": len(calls), "guards": len(guards)},
                written_args)


_FULL = torch.ops.aten.full.default


def _as_empty(op: _Op) -> _Op:
    """`op`, a torch.full whose every element is overwritten before it is read, as torch.empty."""
    empty = _Op(torch.ops.aten.empty.memory_format, op.args[:1], op.kwargs, op.outs, op.reads, op.new_slots,
                op.in_keys, op.out_keys, op.writes, op.whole_write, op.view, op.guard)
    empty.live, empty.runtime_guard, empty.fold = op.live, op.runtime_guard, op.fold
    return empty


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _result_template(recorder: Recorder, value):
    if isinstance(value, torch.Tensor):
        return Ref(recorder.ref(value))
    if isinstance(value, (tuple, list)):
        return type(value)(_result_template(recorder, v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise Unsupported(f"the kernel returns {type(value).__name__}")


def _persistent(recorder: Recorder, ops: list, result_keys: set) -> dict:
    """{name: buffer} of the tensors made from constants alone (tiles, immediates) that the caller
    never sees: made once, here, and kept (re-initialised on each call where their first value is read)."""
    global _persistent_total
    budget = min(PERSISTENT_BYTES, PERSISTENT_TOTAL_BYTES - _persistent_total)
    found, total = {}, 0
    for op in ops:
        if op.reads or op.view or op.guard is not None or len(op.new_slots) != 1 or not isinstance(op.outs, Ref) \
                or op.out_keys[0] in result_keys:
            continue
        buffer = op.func(*_constants(op.args, recorder), **_constants(op.kwargs, recorder))
        size = buffer.untyped_storage().nbytes()
        if total + size > budget:
            break
        total += size
        found[op.new_slots[0]] = buffer
    _persistent_total += total
    return found


def _folded(calls: list, namespace: dict, result_names: set, aliased: set) -> list:
    """op_replay_folding.folded within what the plans may keep; its results count against it."""
    global _persistent_total
    calls, held = op_replay_folding.folded(calls, namespace, result_names, aliased,
                                           PERSISTENT_TOTAL_BYTES - _persistent_total)
    _persistent_total += held
    return calls


def _constants(template, recorder: Recorder):
    return map_refs(template, lambda ref: recorder.constants[int(ref.name[1:])])


def _mark_guards(ops: list, arg_keys: set) -> None:
    """Forward: which storages hold values derived from the arguments; guards reading them run."""
    tainted = set(arg_keys)
    for op in ops:
        derived = any(k in tainted for k in op.in_keys)
        if derived:
            tainted.update(op.writes)
            tainted.update(op.out_keys)
        elif op.new_slots and not op.view:  # new storage (at an address freed before, maybe)
            tainted.difference_update(k for k in op.out_keys if k not in op.in_keys)
        op.runtime_guard = op.guard is not None and derived


def _mark_live(ops: list, needed: set, used: set, persistent: dict) -> None:
    """Backward: an operation is kept if it is a running guard, creates a tensor a kept operation
    uses, or writes storage read later (or seen by the caller). A whole overwrite ends the need for
    what the storage held before; a view reads no values; a kept buffer's making is needed only
    where its first value is read."""
    needed, used = set(needed), set(used)
    for op in reversed(ops):
        if op.new_slots and op.new_slots[0] in persistent:
            op.live = op.out_keys[0] in needed
            needed.discard(op.out_keys[0])
            continue
        live = op.runtime_guard or any(s in used for s in op.new_slots) or any(k in needed for k in op.writes)
        if not live:
            continue
        op.live = True
        if op.whole_write is not None:
            needed.discard(op.whole_write)
            used.add(op.reads[0])
            for name, key in zip(op.reads[1:], op.in_keys[1:]):
                used.add(name)
                needed.add(key)
            continue
        used.update(op.reads)
        if not op.view:
            needed.update(op.in_keys)


class _Call:
    """One line of the generated function: `outs = func(args)`, or a guard."""

    __slots__ = ("func", "args", "kwargs", "outs", "new", "guard")

    def __init__(self, func, args, kwargs, outs, new, guard=None):
        self.func, self.args, self.kwargs, self.outs, self.new, self.guard = func, args, kwargs, outs, new, guard


_AS_STRIDED = torch.ops.aten.as_strided.default
_COPY = torch.ops.aten.copy_.default


def _calls(live: list, recorder: Recorder, result_names: set, persistent: dict, written: set):
    """The kept operations with views folded into one as_strided of their root (none for a view of a
    kept buffer: made here once) and kept buffers re-initialised by a copy of their first value."""
    namespace = {"Mismatch": Mismatch, "_same": _same}
    for i, c in enumerate(recorder.constants):
        namespace[f"c{i}"] = c
    rename: dict = {}
    calls = []

    for name, buffer in persistent.items():
        namespace[f"p{name}"] = buffer
        rename[name] = f"p{name}"
    for index, op in enumerate(live):
        name = op.new_slots[0] if op.new_slots else None
        if name in persistent:
            if op.out_keys[0] in written:  # its first value is read, and it was changed since
                namespace[f"i{name}"] = persistent[name].clone()
                calls.append(_Call(_COPY, (Ref(f"p{name}"), Ref(f"i{name}")), {}, None, ()))
            continue
        if op.fold is not None and name not in result_names:
            root, sizes, strides, offset = op.fold
            if root in persistent:
                view = persistent[root].as_strided(sizes, strides, offset)
                namespace[f"p{name}"] = view
                rename[name] = f"p{name}"
                continue
            if recorder.layouts[root][1:4] == (sizes, strides, offset):
                rename[name] = rename.get(root, root)
                continue
        if op.fold is not None:
            root, sizes, strides, offset = op.fold
            calls.append(_Call(_AS_STRIDED, (Ref(rename.get(root, root)), sizes, strides, offset), {}, Ref(name),
                               (name,)))
            continue
        if op.guard is not None:
            namespace[f"g{index}"] = op.guard[0]
            calls.append(_Call(op.func, renamed(op.args, rename), renamed(op.kwargs, rename), None, (), guard=f"g{index}"))
            continue
        calls.append(_Call(op.func, renamed(op.args, rename), renamed(op.kwargs, rename), op.outs if op.new_slots else None, op.new_slots))
    return _without_unread_views(calls, result_names), namespace


def _without_unread_views(calls: list, result_names: set) -> list:
    """`calls` less the views nothing reads: a view of a view was kept for its own view, which folding
    made one as_strided of the root (a view computes nothing, so dropping it changes no bit)."""
    read, kept = set(result_names), []
    for call in reversed(calls):
        if call.new and call.guard is None and call.func.is_view and not any(n in read for n in call.new):
            continue
        read.update(ref_names((call.args, call.kwargs)))
        kept.append(call)
    kept.reverse()
    return kept


def _binding(func):
    """The Python binding of an ATen operation (parses arguments faster than the operation object)."""
    name = func._schema.name.split("::")[1]
    for owner in (torch, torch.Tensor):
        binding = getattr(owner, name, None)
        if binding is not None and type(binding).__name__ in ("builtin_function_or_method", "method_descriptor"):
            return binding
    return None


def _generate(calls: list, recorder: Recorder, result_template, result_names: set, namespace: dict, slow: set):
    """One Python function making `calls` in order, each variable deleted after its last use."""
    namespace = dict(namespace)
    funcs: dict = {}
    last_use: dict = {}
    for index, call in enumerate(calls):
        for name in ref_names((call.args, call.kwargs)):
            last_use[name] = index
    lines = [f"def replay({', '.join(f'a{i}' for i in range(len(recorder.arg_tensors)))}):"]
    for index, call in enumerate(calls):
        fname = funcs.get(call.func)
        if fname is None:
            fname = funcs[call.func] = f"f{len(funcs)}"
            binding = None if call.func in slow else _binding(call.func)
            namespace[fname] = binding if binding is not None else call.func._op
        source = f"{fname}({_args(call.args, call.kwargs)})"
        if call.guard is not None:
            lines.append(f"    if not _same({source}, {call.guard}): raise Mismatch")
        elif call.new:
            lines.append(f"    {_source(call.outs)} = {source}")
        else:
            lines.append(f"    {source}")
        reads = set(ref_names((call.args, call.kwargs)))
        dead = sorted({n for n in reads if n[0] == "v" and last_use[n] == index and n not in result_names})
        unused = [n for n in call.new if n not in last_use and n not in result_names]
        if dead or unused:
            lines.append(f"    del {', '.join(dead + unused)}")
    lines.append(f"    return {_source(result_template)}")
    exec(compile("\n".join(lines), f"<replay of {len(calls)} operations>", "exec"), namespace)
    return namespace["replay"]


def _unfaithful_bindings(calls: list, recorder: Recorder, namespace: dict) -> set:
    """The operations whose Python binding dispatches anything but them on one of their lines
    (probed on meta tensors of the lines' layouts, op_replay_bindings)."""
    slow: set = set()
    for call in calls:
        if call.func not in slow and not _faithful(call, recorder, namespace):
            slow.add(call.func)
    return slow


def _faithful(call: _Call, recorder: Recorder, namespace: dict) -> bool:
    """Whether the line may call a Python binding: one that dispatches exactly its operation."""
    binding = _binding(call.func)
    if binding is None:
        return False
    spec = lambda template: map_refs(template, lambda ref: _spec(ref.name, recorder, namespace))  # noqa: E731
    return op_replay_bindings.dispatches_exactly(call.func, binding, spec(call.args), spec(call.kwargs))


def _spec(name: str, recorder: Recorder, namespace: dict):
    """A line's argument as the binding probe takes it."""
    if name[0] in "pik":  # a kept buffer, a copy of its first value, or a folded result
        t = namespace[name]
        return op_replay_bindings.TensorSpec(tuple(t.shape), t.stride(), t.dtype)
    if name[0] == "c":
        return namespace[name]
    _, shape, stride, _, dtype = recorder.layouts[name]
    return op_replay_bindings.TensorSpec(shape, stride, dtype)


def _same(a, b) -> bool:
    return a == b or (a != a and b != b)  # NaN reads as NaN


def _args(args, kwargs) -> str:
    parts = [_source(a) for a in args] + [f"{k}={_source(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _source(template) -> str:
    if isinstance(template, Ref):
        return template.name
    if isinstance(template, tuple):
        return "(" + "".join(_source(t) + ", " for t in template) + ")"
    if isinstance(template, list):
        return "[" + ", ".join(_source(t) for t in template) + "]"
    return repr(template)

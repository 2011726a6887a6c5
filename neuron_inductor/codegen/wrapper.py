"""Render the host wrapper: plain Python that runs a lowered graph's steps in order.

The wrapper calls generated kernels (`kernels.<name>(...)`), runs host views, collectives and fallbacks as
ATen calls written out literally (`aten.view.default(buf3, [4, 32])`), and returns the graph's
outputs. It is self-contained source, so it is cached on disk and dumped as-is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..lowering.graph import LoweredGraph
from ..lowering.ir import HostStep, KernelStep
from .kernel_args import kernel_dtype
from .render import environment, literal


class WrapperError(RuntimeError):
    """A host step has an argument the wrapper cannot write as Python source."""


def _literal(value, names: dict[fx.Node, str], namespaces: set[str]) -> str:
    """Python source for an FX argument (op namespaces it refers to are added to `namespaces`)."""
    if isinstance(value, fx.Node):
        return names[value]
    if isinstance(value, (list, tuple)):
        items = ", ".join(_literal(v, names, namespaces) for v in value)
        return f"[{items}]" if isinstance(value, list) else f"({items}{',' if len(value) == 1 else ''})"
    if isinstance(value, (bool, int, float)):
        return literal(value)
    if value is None or isinstance(value, (str, complex)):
        return repr(value)
    if isinstance(value, torch._ops.OpOverload):
        namespaces.add(value.namespace)
        return f"{value.namespace}.{value.overloadpacket.__name__}.{value._overloadname}"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return repr(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    raise WrapperError(f"cannot write argument {value!r} of type {type(value).__name__} into the host wrapper")


def _call_source(node: fx.Node, names: dict[fx.Node, str], namespaces: set[str]) -> str:
    args = [_literal(a, names, namespaces) for a in node.args]
    args += [f"{k}={_literal(v, names, namespaces)}" for k, v in node.kwargs.items()]
    target = node.target
    if target is operator.getitem:
        return f"{args[0]}[{args[1]}]"
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return f"operator.{target.__name__}({', '.join(args)})"  # host arithmetic on sizes (SymInt checks)
    if isinstance(target, torch._ops.HigherOrderOperator):  # e.g. with_effects around a linalg check
        namespaces.add("higher_order")
        return f"higher_order.{target.__name__}({', '.join(args)})"
    if not isinstance(target, torch._ops.OpOverload):
        raise WrapperError(f"host step {node.format_node()} does not call an ATen op")
    namespace = target.namespace  # aten, prims, ...: each bound to torch.ops.<namespace> in the wrapper
    namespaces.add(namespace)
    return f"{namespace}.{target.overloadpacket.__name__}.{target._overloadname}({', '.join(args)})"


def _kernel_argument(node: fx.Node, name: str, is_int32: bool) -> str:
    """Source passing a graph value to a kernel (see kernel_args): int64 narrowed, 0-d as shape [1]."""
    val = node.meta["val"]
    if val.dtype == torch.int64 and not is_int32:
        name = f"int32_argument({name})"
    return f"{name}.reshape(1)" if val.dim() == 0 else name


def render_wrapper(gm: fx.GraphModule, lowered: LoweredGraph, name: str = "run") -> tuple[str, list[str]]:
    """Source of `run(args, kernels, constants)`, and the names of the get_attr constants it reads."""
    names: dict[fx.Node, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        names[node] = f"arg{i}"
    lines: list[str] = []
    step_lines: list[list[str]] = []
    constants: list[str] = []
    namespaces: set[str] = set()
    # int64 values computed by kernels are int32 tensors (NKI has no 64-bit integers): widen them
    # where they reach host fallbacks or the graph's outputs.
    narrowed = lowered.int32_values()

    def host_names() -> dict[fx.Node, str]:
        return {**names, **{node: f"{names[node]}.long()" for node in narrowed if node in names}}

    made: list[set[str]] = []  # per step: the graph values (names) its lines make
    read: list[set[str]] = []  # per step: the graph values its lines read

    def value_name(node: fx.Node) -> str:
        if node not in names:
            names[node] = f"buf{len(names) - len(placeholders)}"
            made[-1].add(names[node])
        return names[node]

    for step in lowered.steps:
        start = len(lines)
        made.append(set())
        if isinstance(step, KernelStep):
            spec = step.spec
            read.append({names[node] for node in spec.inputs})
            arguments, write_backs = [], []
            for position, node in enumerate(spec.inputs):
                argument = _kernel_argument(node, names[node], node in narrowed)
                if argument != names[node] and position in spec.inplace.values():
                    # The kernel writes into a converted copy: copy it back into the graph value.
                    copy = f"{names[node]}_arg"
                    lines.append(f"{copy} = {argument}")
                    write_backs.append(f"{names[node]}.copy_({copy}.reshape({names[node]}.shape))")
                    argument = copy
                arguments.append(argument)
            returned = [out for pos, out in enumerate(spec.outputs) if pos not in spec.inplace]
            if spec.output_argument:  # the kernel writes its first output into a buffer the host allocates
                out = returned.pop(0)
                val = out.meta["val"] if isinstance(out, fx.Node) else out
                buffer = value_name(out) if isinstance(out, fx.Node) else f"{spec.name}_out"
                lines.append(f"{buffer} = torch.empty({[int(s) for s in val.shape]}, "
                             f"dtype={kernel_dtype(val.dtype)})  # allocation: the kernel's output argument")
                # A 0-d output is written through a shape-[1] view, so that the value itself is no view.
                arguments.append(f"{buffer}.view(1)" if val.dim() == 0 else buffer)
            call = f"kernels.{spec.name}({', '.join(arguments)})"
            for pos, inp in spec.inplace.items():
                names[spec.outputs[pos]] = names[spec.inputs[inp]]
            targets = [value_name(o) if isinstance(o, fx.Node) else "_" for o in returned]
            if not targets:
                lines.append(call)
            elif len(targets) == 1:
                lines.append(f"{targets[0]} = {call}")
            else:
                lines.append(f"{', '.join(targets)} = {call}")
            lines.extend(write_backs)
            lines.extend(f"{target} = {target}.reshape(()).clone()  # kernels return 0-d values as shape [1];"
                         " a clone, not a view (a view output cannot be modified in place)"
                         for target, out in zip(targets, returned)
                         if isinstance(out, fx.Node) and out.meta["val"].dim() == 0)
        else:
            assert isinstance(step, HostStep)
            node = step.node
            read.append({names[n] for n in node.all_input_nodes})
            if step.kind == "constant":
                constants.append(node.target)
                lines.append(f"{value_name(node)} = constants[{node.target!r}]")
            elif step.kind == "scalar":
                lines.append(f"{value_name(node)} = {_call_source(node, names, namespaces)}  # host: size arithmetic")
            elif step.kind == "alloc":
                lines.append(f"{value_name(node)} = {_call_source(node, names, namespaces)}  # allocation: no data moves")
            elif step.kind == "collective":
                lines.append(f"{value_name(node)} = {_call_source(node, host_names(), namespaces)}"
                             "  # communication: through the process group")
            elif step.kind == "view":
                lines.append(f"{value_name(node)} = {_call_source(node, names, namespaces)}  # view: no data moves")
            else:
                reason = " ".join(step.reason.split())
                lines.append(f"{value_name(node)} = {_call_source(node, host_names(), namespaces)}  # fallback: {reason}")
        step_lines.append(lines[start:])

    output = next(n for n in gm.graph.nodes if n.op == "output")
    returns = _literal(list(output.args[0]), host_names(), namespaces)
    lines = _freeing(step_lines, made, read, {names[n] for n in placeholders},
                     {names[n] for n in output.all_input_nodes})
    source = environment().get_template("wrapper.py.j2").render(
        name=name, num_args=len(placeholders), lines=lines, returns=returns, namespaces=sorted(namespaces))
    return source, constants


def _freeing(step_lines: list[list[str]], made: list[set[str]], read: list[set[str]], arguments: set[str],
             returned: set[str]) -> list[str]:
    """The steps' lines with each graph value dropped (`del`) after the last step making or reading
    it, as Inductor's wrapper frees its buffers: the graph's peak memory is then what its live values
    need, and buffers go back to the allocator one by one while later steps allocate theirs. Kept to
    the return, they were freed all at once there, the C allocator handed the top of its heap back
    to the OS, and the next graph (the backward) page-faulted it all in again. Returned values live on."""
    last = dict.fromkeys(arguments, -1)
    for index, names in enumerate(made):
        last.update(dict.fromkeys(names | read[index], index))
    dropped: dict[int, list[str]] = {}
    for name, index in last.items():
        if name not in returned:
            dropped.setdefault(index, []).append(name)
    lines = [f"del {', '.join(sorted(dropped[-1]))}"] if -1 in dropped else []
    for index, step in enumerate(step_lines):
        lines.extend(step)
        if index in dropped:
            lines.append(f"del {', '.join(sorted(dropped[index]))}")
    return lines

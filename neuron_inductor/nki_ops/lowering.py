"""An nki_op's FX node as a kernel step of the compiled program.

The node (`mylib.op.default(...)`, or `auto_functionalized_v2(mylib.op.default, ...)` when the op
mutates its arguments) becomes a `KernelSpec` of the family `user`: its tensor arguments are the
kernel's inputs, everything else is constants recorded in the spec (JSON-able, so the compile cache
stores them). The toolchain does not render it: `build_steps` makes the step that runs the op's
function with its kernels built by the program's toolchain (`wrap.running_on`); its "source" is the
user's kernel source, written to the dump next to the generated kernels.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from ..lowering.common import result_values
from ..lowering.context import LoweringContext
from ..lowering.ir import KernelSpec, Unsupported
from ..lowering.registry import register_lowering
from .op import REGISTRY, UserOp, named, user_op_of
from .wrap import running_on, shape_instructions

FAMILY = "user"
auto_functionalized_v2 = torch.ops.higher_order.auto_functionalized_v2


def _encode(value: Any, inputs: list[fx.Node]) -> Any:
    """A node argument as JSON-able data: tensors become {"input": i}, constants stay plain."""
    if isinstance(value, fx.Node):
        if not isinstance(value.meta.get("val"), torch.Tensor):
            raise Unsupported(f"argument {value.name} is a value computed in the graph, not a tensor or a constant")
        inputs.append(value)
        return {"input": len(inputs) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode(v, inputs) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise Unsupported(f"argument {value!r} of type {type(value).__name__} is not a tensor or a plain constant")


def _decode(value: Any, tensors: tuple) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if "input" in value:
            return tensors[value["input"]]
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        return float(value["float"])
    return value


def _spec(node: fx.Node, user: UserOp, args: tuple, kwargs: dict, functionalized: bool) -> KernelSpec:
    inputs: list[fx.Node] = []
    encoded = {"args": _encode(list(args), inputs), "kwargs": {k: _encode(v, inputs) for k, v in kwargs.items()}}
    val = node.meta["val"]
    outputs = [node] if isinstance(val, torch.Tensor) else result_values(node)
    flops = _tensor_flops(user, functionalized, encoded, inputs)
    return KernelSpec(FAMILY, {"op": user.name, "functionalized": functionalized, **encoded},
                      inputs, outputs, flops=flops)


def _tensor_flops(user: UserOp, functionalized: bool, encoded: dict, inputs: list[fx.Node]) -> int:
    """FLOPs of the op's kernels' compute instructions (2KMN per matmul, elements otherwise, as the
    trace counts them), from a shape run on meta tensors (no math)."""
    metas = tuple(torch.empty_strided(n.meta["val"].shape, n.meta["val"].stride(), dtype=n.meta["val"].dtype,
                                      device="meta") for n in inputs)
    with shape_instructions() as recorded:
        _call(user, functionalized, encoded, metas)
    return sum(i.flops for i in recorded if i.engine != "dma")


def lower_user_op(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    """A user's kernel is theirs as written: the context's tile sizes do not apply."""
    return _spec(node, REGISTRY[node.target], node.args, node.kwargs, functionalized=False)


@register_lowering(auto_functionalized_v2)
def lower_functionalized_user_op(ctx: LoweringContext, node: fx.Node) -> KernelSpec:
    user = user_op_of(node)
    if user is None:
        raise Unsupported(f"auto_functionalized_v2 of {node.args[0]}: only nki_op custom ops run as kernels")
    return _spec(node, user, node.args[1:], node.kwargs, functionalized=True)


def _call(user: UserOp, functionalized: bool, encoded: dict, tensors: tuple) -> list[torch.Tensor]:
    """Run the op on the step's tensors; the step returns the tensors of the node's value, in order."""
    args, kwargs = _decode(encoded["args"], tensors), {k: _decode(v, tensors) for k, v in encoded["kwargs"].items()}
    if functionalized:  # clones the mutated bases, runs the op on them, returns (results, new bases)
        result = auto_functionalized_v2(user.overload, *args, **kwargs)
    else:
        result = user.run(tuple(args), kwargs)
    return [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


class UserKernelStep:
    """The callable the host wrapper calls for one nki_op node."""

    def __init__(self, user: UserOp, params: dict, toolchain) -> None:
        self.user, self.params, self.toolchain = user, params, toolchain

    def __call__(self, *tensors):
        with running_on(self.toolchain):
            results = _call(self.user, self.params["functionalized"], self.params, tensors)
        return results[0] if len(results) == 1 else tuple(results)


def build_steps(user_kernels: dict[str, dict], toolchain) -> dict[str, Callable]:
    """The steps of a program's nki_op kernels (by kernel name), for `toolchain`."""
    steps = {}
    for name, params in user_kernels.items():
        user = named(params["op"])
        if user is None:
            raise RuntimeError(f"compiled program needs the nki_op {params['op']!r}, which this process has not "
                               "registered: import the module that defines it before running the model")
        steps[name] = UserKernelStep(user, params, toolchain)
    return steps


def source(spec: KernelSpec) -> str:
    return named(spec.params["op"]).source()

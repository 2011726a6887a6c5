"""The kernel tests' shared harness: build an ATen graph, lower one node with its registered
lowering, render and load its kernel in the NKI interpreter, run it on the graph's own eager
values (views included, so kernels see strided inputs) and compare with eager.

Each test module keeps its own reference and tolerances; this module only runs things and offers
`assert_close`, the magnitude-scaled comparison most families state their tolerances in.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import config, sim
from neuron_inductor.codegen.kernel_args import kernel_argument, kernel_dtype, kernel_shape
from neuron_inductor.codegen.render import render_kernel
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.lowering.context import LoweringContext
from neuron_inductor.lowering.ir import KernelSpec
from neuron_inductor.lowering.registry import LOWERINGS, load_lowerings

load_lowerings()

# The context kernels are lowered, rendered and run for unless a test names another target.
CTX = LoweringContext.for_target("trn2")
TARGETS = ["trn1", "trn2", "trn3"]

# The float dtypes every family is tested in.
DTYPES = [torch.float32, torch.bfloat16]
# Inputs of the row-normalising kernels (lowering/norms.py): row and column counts that are and are
# not multiples of the 128 partitions / 512-column chunks, and a 3-d input whose row tiles straddle
# its leading dims.
ROW_SHAPES = [(1, 1), (3, 7), (128, 512), (200, 1000), (2, 65, 300)]


# --- graphs ------------------------------------------------------------------------------------

def aten_graph(fn, *args) -> fx.GraphModule:
    """fn's ATen graph as the backend sees it: make_fx with the Neuron decomposition table."""
    return make_fx(fn, decomposition_table=neuron_decompositions())(*args)


def op_graph(op, *args, meta=False) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A graph calling `op(*args)` directly (no decomposition), its tensor args as placeholders and
    a multi-output op's outputs read through getitems; and the tensors to run it with.
    meta=True takes the value metadata from meta tensors (for ops eager CPU does not run)."""
    graph = fx.Graph()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    nodes = {}
    for i, t in enumerate(tensors):
        nodes[id(t)] = graph.placeholder(f"arg{i}")
        nodes[id(t)].meta["val"] = t
    call = graph.call_function(op, tuple(nodes.get(id(a), a) for a in args))
    call.meta["val"] = op(*[a.to("meta") if meta and isinstance(a, torch.Tensor) else a for a in args])
    if isinstance(call.meta["val"], torch.Tensor):
        graph.output(call)
    else:
        items = []
        for i, value in enumerate(call.meta["val"]):
            items.append(graph.call_function(operator.getitem, (call, i)))
            items[-1].meta["val"] = value
        graph.output(tuple(items))
    return fx.GraphModule({}, graph), tensors


def graph_values(gm: fx.GraphModule, args) -> dict:
    """Every node's eager value: the kernels' inputs and the reference outputs."""
    env: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            env[node] = super().run_node(node)
            return env[node]

    Recorder(gm).run(*args)
    return env


def last_node(gm: fx.GraphModule, target) -> fx.Node:
    return [n for n in gm.graph.nodes if n.target is target][-1]


# --- kernels -----------------------------------------------------------------------------------

def lower(node: fx.Node, ctx: LoweringContext = CTX) -> KernelSpec:
    """The KernelSpec of `node` from its registered lowering, for the target of `ctx`."""
    return LOWERINGS[node.target](ctx, node)


def load_kernel(spec: KernelSpec, source_check=None, ctx: LoweringContext = CTX):
    """Name, render and load the kernel of `spec` for the target of `ctx` (the interpreter runs it
    with that chip's rules and capacities); `source_check(source)` sees the rendered source."""
    spec.name = f"k0_{spec.family}"
    source = render_kernel(spec, ctx)
    if source_check is not None:
        source_check(source)
    kernel = sim.load_kernels(source, f"<{spec.name}>")[spec.name]
    return sim.Kernel(kernel.func, kernel.grid, ctx.target.name)


def kernel_for(gm: fx.GraphModule, target, source_check=None, ctx: LoweringContext = CTX):
    """(node, spec, kernel) for the last `target` node of `gm`: lowered, rendered and loaded for `ctx`."""
    node = last_node(gm, target)
    spec = lower(node, ctx)
    return node, spec, load_kernel(spec, source_check, ctx)


def as_tuple(returned) -> tuple:
    """A kernel's results as a tuple (kernels return a tensor, a tuple, or nothing)."""
    if returned is None:
        return ()
    return returned if isinstance(returned, tuple) else (returned,)


def call_kernel(kernel, spec: KernelSpec, inputs):
    """Call a kernel as the host wrapper does (kernel_args): int64 arguments narrowed to int32, 0-d
    ones as shape [1], and 0-d results viewed as 0-d again. Returns the results as a tuple."""
    arguments = [kernel_argument(t) for t in inputs]
    results = [out for pos, out in enumerate(spec.outputs) if pos not in spec.inplace]
    if spec.output_argument:  # the host allocates the output of a kernel without inputs
        val = results[0].meta["val"] if isinstance(results[0], fx.Node) else results[0]
        arguments.append(torch.empty(kernel_shape(val.shape), dtype=kernel_dtype(val.dtype)))
    returned = as_tuple(kernel(*arguments))
    if spec.output_argument:
        returned = (arguments[-1], *returned)
    return tuple(r.reshape(()) if isinstance(o, fx.Node) and o.meta["val"].dim() == 0 and r.shape == (1,) else r
                 for r, o in zip(returned, results)) + returned[len(results):]


def widen_int64(returned: torch.Tensor, expected: torch.Tensor | None) -> torch.Tensor:
    """Kernels return int64 graph values as int32 tensors (NKI has no 64-bit integers; the host
    wrapper widens them where they leave the kernels): check that, then compare as the graph's dtype."""
    if expected is not None and expected.dtype == torch.int64:
        assert returned.dtype == torch.int32, returned.dtype
        return returned.to(torch.int64)
    return returned


def run_node(gm: fx.GraphModule, args, target, source_check=None, ctx: LoweringContext = CTX):
    """Lower the last `target` node of `gm` for `ctx` and run its kernel on the graph's eager values.

    Returns (kernel results, eager outputs of the node, kernel inputs). The eager outputs are the
    ones the op produces, in order (a multi-output op's None outputs left out); int64 results come
    back through `widen_int64`. Results beyond the node's outputs are kept, for the callers'
    count checks to see.
    """
    node, spec, kernel = kernel_for(gm, target, source_check, ctx)
    env = graph_values(gm, args)
    inputs = [env[n] for n in spec.inputs]
    returned = call_kernel(kernel, spec, inputs)
    value = env[node]
    expected = [v for v in value if v is not None] if isinstance(value, tuple) else [value]
    widened = [widen_int64(r, e) for r, e in zip(returned, expected)]
    return widened + list(returned[len(widened):]), expected, inputs


def run_lowered(fn, args, target, ctx: LoweringContext = CTX):
    """`run_node` on fn's ATen graph."""
    return run_node(aten_graph(fn, *args), args, target, ctx=ctx)


# --- comparison --------------------------------------------------------------------------------

def magnitude(t: torch.Tensor) -> float:
    """The largest finite |value| of `t`, at least 1 (1 for an empty tensor)."""
    if not t.numel():
        return 1.0
    finite = t.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return max(finite.abs().max().item(), 1.0)


def assert_close(actual, expected, *, fp32_rtol=1e-5, bf16_rtol=2e-2, atol_floor=0.0):
    """Same shape and dtype; integers and bools equal; floats within rtol (`fp32_rtol` for fp32,
    `bf16_rtol` for 2-byte floats) and an atol of rtol times `magnitude(expected)` (or
    `atol_floor` if larger). NaN matches NaN."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    if not expected.dtype.is_floating_point:
        assert torch.equal(actual, expected)
        return
    tol = fp32_rtol if expected.dtype == torch.float32 else bf16_rtol
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol,
                               atol=max(tol * magnitude(expected), atol_floor), equal_nan=True)


def assert_all_close(actual: list, expected: list, atol_floors=None, **tols):
    """`assert_close` per output; `atol_floors[i]` (doubled) is output i's atol floor."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close(a, e, atol_floor=2 * atol_floors[i] if atol_floors else 0.0, **tols)


def check_node(gm: fx.GraphModule, args, target, source_check=None, ctx: LoweringContext = CTX) -> None:
    """Run the last `target` node's kernel (for `ctx`) and `assert_all_close` every output with eager."""
    actual, expected, _ = run_node(gm, args, target, source_check, ctx)
    assert_all_close(actual, expected)


def compiled_forward_backward(fn, x: torch.Tensor, grad: torch.Tensor, cache_dir) -> tuple[torch.Tensor, torch.Tensor]:
    """`fn(x)` and the gradient of x through torch.compile(backend="neuron") with every op in a
    kernel (fallback="error"), from a fresh Dynamo state and compile cache."""
    x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    try:
        with config.patch(fallback="error", cache_dir=str(cache_dir)):
            out = torch.compile(fn, backend="neuron")(x)
            out.backward(grad)
    finally:
        torch._dynamo.reset()
    return out.detach(), x.grad

"""Matmul family: lowerings of mm / bmm / addmm rendered to NKI and run in the interpreter.

Each case traces a function with the Neuron decomposition table, lowers its matmul node, renders
the kernel, runs it on the real values of the kernel's inputs and compares with the same graph
evaluated in float64 on the same (possibly bf16-rounded) inputs.
Tolerances: fp32 rtol 1e-4 (atol 1e-5 x max|ref|); bf16 rtol 8e-3 (one bf16 rounding of the
fp32-accumulated result is 2^-9 relative; atol 2e-3 x max|ref| for cancellation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from neuron_inductor.lowering import matmul, pointwise
from neuron_inductor.lowering.context import KIB
from neuron_inductor.lowering.ir import Unsupported
from neuron_inductor.lowering.registry import LOWERINGS

from .harness import CTX, DTYPES, aten_graph, as_tuple, graph_values, load_kernel

aten = torch.ops.aten
MATMUL_OPS = (aten.mm.default, aten.bmm.default, aten.addmm.default)
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (8e-3, 2e-3)}
SHAPES = [(1, 1, 1), (7, 13, 5), (128, 128, 128), (130, 257, 515), (256, 384, 640)]  # (M, K, N)
# A target whose SBUF leaves the operand panels 8 KiB: K is too long for a resident panel.
SMALL_SBUF = dataclasses.replace(CTX, tile=dataclasses.replace(CTX.tile, sbuf_bytes=matmul.SBUF_RESERVE + 8 * KIB))


def trace(fn, *args) -> tuple[fx.GraphModule, fx.Node]:
    gm = aten_graph(fn, *args)
    nodes = [n for n in gm.graph.nodes if n.target in MATMUL_OPS]
    assert len(nodes) == 1, gm.graph
    return gm, nodes[0]


def float64_values(gm: fx.GraphModule, args) -> dict:
    """The graph evaluated in float64 on the same (possibly bf16-rounded) inputs: the reference."""
    return graph_values(gm, [a.double() if a.is_floating_point() else a for a in args])


def assert_matches(out: torch.Tensor, reference: torch.Tensor) -> None:
    """Within the dtype's rtol, and its atol scaled by the largest |reference| (1 if all zero)."""
    rtol, atol = TOLERANCES[out.dtype]
    scale = reference.abs().max().item() or 1.0
    torch.testing.assert_close(out.double(), reference.double(), rtol=rtol, atol=atol * scale)


def run_case(fn, *args, ctx=CTX):
    """(kernel output, float64 reference, spec) for the single matmul of fn(*args), lowered for `ctx`."""
    gm, node = trace(fn, *args)
    spec = LOWERINGS[node.target](ctx, node)
    kernel = load_kernel(spec)
    values = graph_values(gm, args)
    reference = float64_values(gm, args)[node]
    out = kernel(*(values[n] for n in spec.inputs))
    return out, reference, spec


def check(fn, *args, ctx=CTX):
    out, reference, spec = run_case(fn, *args, ctx=ctx)
    assert out.dtype == args[0].dtype and out.shape == reference.shape
    assert_matches(out, reference)
    return spec


def randn(*shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=generator).to(dtype)


# Each layout is (fn, operand shapes): A is [M, K] or its transpose, B is [K, N] or its transpose.
def _layouts(m, k, n):
    return {
        "mk,kn": (lambda a, b: a @ b, (m, k), (k, n)),
        "km,kn": (lambda at, b: at.t() @ b, (k, m), (k, n)),
        "mk,nk": (lambda a, bt: a @ bt.t(), (m, k), (n, k)),
        "km,nk": (lambda at, bt: at.transpose(0, 1) @ bt.permute(1, 0), (k, m), (n, k)),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("layout", ["mk,kn", "km,kn", "mk,nk", "km,nk"])
def test_mm_layouts(layout, shape, dtype):
    fn, a_shape, b_shape = _layouts(*shape)[layout]
    spec = check(fn, randn(*a_shape, dtype=dtype), randn(*b_shape, dtype=dtype, seed=1))
    assert (spec.params["a"]["layout"], spec.params["b"]["layout"]) == tuple(layout.split(","))
    flipped = [name for name, major in (("a", "km"), ("b", "kn")) if spec.params[name]["layout"] != major]
    expected = "dma_transpose" if dtype == torch.bfloat16 else "pe_transpose"
    assert all(spec.params[name]["load"] == expected for name in flipped)
    m, k, n = shape
    assert spec.flops == 2 * m * n * k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, group", [((1024, 64, 64), 8), ((1000, 176, 64), 8), ((1300, 32, 176), 2),
                                          ((512, 64, 256), 2), ((384, 130, 100), 3)],
                         ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s))
@pytest.mark.parametrize("layout", ["mk,kn", "mk,nk", "km,kn"])
def test_row_tile_groups(layout, shape, group, dtype):
    """`group` row tiles share one PSUM bank and one store; fp32 A flipped on TensorE ("mk") also one
    load (a group's partition p holds rows p * group + t), otherwise (a DMA transpose, "km") row tile
    t is rows t * 128 + p. Full groups, a ragged one (1000 = 7 x 128 + 104 rows), a second row block
    ending in one (1300 = 1024 + 276), K on and off the tile."""
    fn, a_shape, b_shape = _layouts(*shape)[layout]
    spec = check(fn, randn(*a_shape, dtype=dtype), randn(*b_shape, dtype=dtype, seed=1))
    assert spec.params["blocking"]["group"] == group


def test_row_tile_groups_of_a_bmm_and_none_with_a_bias():
    for dtype in DTYPES:
        spec = check(lambda a, b: torch.bmm(a, b), randn(3, 512, 48, dtype=dtype), randn(3, 48, 64, dtype=dtype, seed=1))
        assert spec.params["blocking"]["group"] == 4
    spec = check(lambda c, a, b: torch.addmm(c, a, b), randn(64), randn(512, 48), randn(48, 64, seed=1))
    assert spec.params["blocking"]["group"] == 1  # the bias is applied tile by tile


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", [1024, 1000, 130, 300])
def test_k_major_tiles_load_together(k, dtype):
    """Weight-gradient operands (X^T @ dY, both K-major): a panel's whole K tiles arrive in one DMA
    through an access pattern over the base, K row kt * 128 + p on partition p of tile kt (the K
    tiling and sums of the per-tile loads), the ragged tile on its own; with 1 whole tile, per tile."""
    x, dy = randn(k, 64, dtype=dtype), randn(k, 176, dtype=dtype, seed=1)
    spec = check(lambda x, dy: x.t() @ dy, x, dy)
    assert (spec.params["a"]["load"], spec.params["b"]["load"]) == ("direct", "direct")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_major_tiles_load_together_per_batch(dtype):
    """The same over batched bases (each batch's access pattern starts at its first element): a 4-d
    [2, 3, K, M]^T @ [2, 3, K, N], and [1, K, M]^T broadcast over [4, K, N] (always batch 0)."""
    a, b = randn(2, 3, 300, 40, dtype=dtype), randn(2, 3, 300, 24, dtype=dtype, seed=1)
    spec = check(lambda a, b: torch.matmul(a.transpose(-1, -2), b), a, b)
    assert spec.params["a"]["load"] == "direct" and spec.params["b"]["batch_index"] == [(3, 2), (1, 3)]
    a, b = randn(1, 300, 40, dtype=dtype), randn(4, 300, 24, dtype=dtype, seed=1)
    spec = check(lambda a, b: torch.matmul(a.transpose(-1, -2), b), a, b)
    assert spec.params["a"]["load"] == "direct" and spec.params["a"]["batch_index"] == [(1, 1)]


def test_linear_weight_is_read_in_place():
    """linear's permute(W) is looked through: the kernel reads W itself as an "nk" operand."""
    gm, node = trace(lambda x, w: torch.nn.functional.linear(x, w), randn(4, 8), randn(6, 8))
    spec = LOWERINGS[node.target](CTX, node)
    assert [n.op for n in spec.inputs] == ["placeholder", "placeholder"]
    assert spec.params["b"]["layout"] == "nk"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias_shape", [(515,), (1, 515), (130, 1), (130, 515), (1,), (1, 1)])
def test_addmm_bias(bias_shape, dtype):
    a, b = randn(130, 257, dtype=dtype), randn(257, 515, dtype=dtype, seed=1)
    bias = randn(*bias_shape, dtype=dtype, seed=2)
    spec = check(lambda bias, a, b: torch.addmm(bias, a, b), bias, a, b)
    assert len(spec.inputs) == 3


@pytest.mark.parametrize("bias_shape", [(515,), (130, 1), (130, 515), (1,)])
def test_addmm_alpha_beta(bias_shape):
    a, b, bias = randn(130, 257), randn(257, 515, seed=1), randn(*bias_shape, seed=2)
    check(lambda bias, a, b: torch.addmm(bias, a, b, beta=0.3, alpha=-1.7), bias, a, b)


def test_addmm_beta_zero_ignores_bias():
    a, b = randn(7, 13), randn(13, 5, seed=1)
    bias = torch.full((5,), float("nan"))
    out, reference, spec = run_case(lambda bias, a, b: torch.addmm(bias, a, b, beta=0, alpha=2), bias, a, b)
    assert len(spec.inputs) == 2
    torch.testing.assert_close(out.double(), 2 * (a.double() @ b.double()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_with_bias(dtype):
    x, w, bias = randn(2, 65, 200, dtype=dtype), randn(300, 200, dtype=dtype, seed=1), randn(300, dtype=dtype, seed=2)
    spec = check(lambda x, w, bias: torch.nn.functional.linear(x, w, bias), x, w, bias)
    assert spec.params["b"]["layout"] == "nk" and spec.params["bias"]["kind"] == "row"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 7, 13, 5), (2, 130, 257, 515)], ids=lambda s: "x".join(map(str, s)))
def test_bmm(shape, dtype):
    batch, m, k, n = shape
    check(lambda a, b: torch.bmm(a, b), randn(batch, m, k, dtype=dtype), randn(batch, k, n, dtype=dtype, seed=1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bmm_transposed_operands(dtype):
    """Attention-style q @ k^T over [B, H, S, D] tensors: both operands resolve to 4-d bases."""
    q, k = randn(2, 3, 40, 24, dtype=dtype), randn(2, 3, 50, 24, dtype=dtype, seed=1)
    spec = check(lambda q, k: torch.matmul(q, k.transpose(-1, -2)), q, k)
    assert spec.params["b"]["layout"] == "nk" and spec.params["b"]["batch_index"] == [(3, 2), (1, 3)]


def test_bmm_broadcast_batch():
    """matmul of [1, M, K] with [B, K, N] expands A over the batch: read with a constant index."""
    a, b = randn(1, 9, 20), randn(4, 20, 11, seed=1)
    spec = check(lambda a, b: torch.matmul(a, b), a, b)
    assert spec.inputs[0].op == "placeholder" and spec.params["a"]["batch_index"] == [(1, 1)]  # always a[0]


def test_bmm_broadcast_inner_batch():
    """[2, 1, M, K] @ [2, 3, K, N]: matmul materialises the expanded A (clone); the kernel reads that
    4-d clone and B's 4-d base through the (b // 3, b % 3) batch index."""
    a, b = randn(2, 1, 9, 20), randn(2, 3, 20, 11, seed=1)
    spec = check(lambda a, b: torch.matmul(a, b), a, b)
    assert spec.params["a"]["batch_index"] == spec.params["b"]["batch_index"] == [(3, 2), (1, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["mk,kn", "km,nk"])
def test_stream_mode(layout, dtype):
    """K too long for a resident panel: K walked in chunks accumulating in PSUM."""
    fn, a_shape, b_shape = _layouts(200, 700, 600)[layout]
    spec = check(fn, randn(*a_shape, dtype=dtype), randn(*b_shape, dtype=dtype, seed=1), ctx=SMALL_SBUF)
    blocking = spec.params["blocking"]
    assert blocking["mode"] == "stream" and blocking["k_chunk"] < 6


def test_stream_mode_with_bias():
    a, b, bias = randn(200, 700), randn(700, 600, seed=1), randn(600, seed=2)
    spec = check(lambda bias, a, b: torch.addmm(bias, a, b, alpha=0.5), bias, a, b, ctx=SMALL_SBUF)
    assert spec.params["blocking"]["mode"] == "stream"


def test_multiple_m_blocks(monkeypatch):
    """A smaller panel budget splits M into several resident blocks."""
    monkeypatch.setattr(matmul, "MAX_BLOCK_M", 128)
    spec = check(lambda a, b: a @ b, randn(300, 200), randn(200, 700, seed=1))
    assert spec.params["blocking"]["block_m"] == 128


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64], ids=str)
def test_unsupported_dtypes(dtype):
    gm, node = trace(lambda a, b: a @ b, torch.ones(4, 4, dtype=dtype), torch.ones(4, 4, dtype=dtype))
    with pytest.raises(Unsupported, match="TensorE"):
        LOWERINGS[node.target](CTX, node)


# --- Fused epilogues -----------------------------------------------------------------------------


def run_epilogue_case(fn, *args, ctx=CTX):
    """Lower fn's matmul (for `ctx`) with every pointwise node after it as the epilogue; check each output."""
    gm = aten_graph(fn, *args)
    node = next(n for n in gm.graph.nodes if n.target in MATMUL_OPS)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target not in MATMUL_OPS
             and n.meta["val"].shape == node.meta["val"].shape and pointwise.is_pointwise(n)]
    returned = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    outputs = [n for n in [node, *nodes] if n in returned]
    spec = matmul.lower_matmul_with_epilogue(ctx, node, nodes, outputs)
    kernel = load_kernel(spec)
    values = graph_values(gm, args)
    references = float64_values(gm, args)
    results = as_tuple(kernel(*(values[n] for n in spec.inputs)))
    assert len(results) == len(spec.outputs)
    for out, value in zip(results, spec.outputs):
        reference = references[value]
        assert out.dtype == values[value].dtype and out.shape == reference.shape
        assert_matches(out, reference)
    return spec


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_activation(dtype):
    spec = run_epilogue_case(lambda a, b: torch.relu(a @ b), randn(130, 257, dtype=dtype),
                             randn(257, 515, dtype=dtype, seed=1))
    assert spec.params["epilogue"]["instrs"] and len(spec.outputs) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_linear_gelu(dtype):
    x, w, bias = randn(130, 200, dtype=dtype), randn(300, 200, dtype=dtype, seed=1), randn(300, dtype=dtype, seed=2)
    run_epilogue_case(lambda x, w, bias: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias)), x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_residual_and_column_scale(dtype):
    a, b = randn(130, 257, dtype=dtype), randn(257, 515, dtype=dtype, seed=1)
    residual, scale = randn(130, 515, dtype=dtype, seed=2), randn(130, 1, dtype=dtype, seed=3)
    spec = run_epilogue_case(lambda a, b, r, s: (a @ b) * s * 0.5 + r, a, b, residual, scale)
    assert [load["kind"] for load in spec.params["epilogue"]["loads"]] in (["col", "tile"], ["tile", "col"])


def test_epilogue_keeps_matmul_output_and_casts():
    """The matmul result is an output too (in its own dtype) next to a bf16 cast of a scaled copy."""
    a, b = randn(70, 300), randn(300, 90, seed=1)
    spec = run_epilogue_case(lambda a, b: (lambda y: (y, (y * 3.0).to(torch.bfloat16)))(a @ b), a, b)
    assert len(spec.outputs) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_baddbmm(dtype):
    """baddbmm decomposes into bmm + mul + add: fused back as a bmm epilogue over the batch."""
    c, a, b = randn(3, 40, 60, dtype=dtype), randn(3, 40, 70, dtype=dtype, seed=1), randn(3, 70, 60, dtype=dtype, seed=2)
    run_epilogue_case(lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0), c, a, b)


def test_epilogue_stream_mode():
    spec = run_epilogue_case(lambda a, b, r: torch.sigmoid(a @ b) + r, randn(200, 700), randn(700, 600, seed=1),
                             randn(200, 600, seed=2), ctx=SMALL_SBUF)
    assert spec.params["blocking"]["mode"] == "stream"


def test_epilogue_rejects_row_broadcast_inputs():
    gm = aten_graph(lambda a, b, v: (a @ b) + v, randn(8, 16), randn(16, 32), randn(32))
    node = next(n for n in gm.graph.nodes if n.target in MATMUL_OPS)
    add = next(iter(node.users))
    with pytest.raises(Unsupported, match="does not tile"):
        matmul.lower_matmul_with_epilogue(CTX, node, [add], [add])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_epilogue_of_an_unrelated_op_of_the_matmul_shape(dtype):
    """The graph lowering offers every following pointwise node of the matmul's shape (svd_lowrank's
    backward: a permuted other tensor divided, next to a returned mm); the kernel stores the matmul
    result as it is and computes the unrelated node beside it."""
    a, b, c = randn(130, 64, dtype=dtype), randn(64, 200, dtype=dtype, seed=1), randn(200, 130, dtype=dtype, seed=2)
    spec = run_epilogue_case(lambda a, b, c: (a @ b, c.t() / 3), a, b, c)
    assert len(spec.outputs) == 2



def test_epilogue_reading_the_returned_matmul_through_a_unit_view():
    """gpt_oss's MoE: bmm [128, 1, 256] is returned and its squeeze is added to a gathered bias. The
    program reads the matmul through the view and stores it as it is, from that one input (a second
    input of the same value left the view's name undefined in the kernel: NameError)."""
    a, b, c = randn(128, 1, 64), randn(128, 64, 256, seed=1), randn(128, 256, seed=2)
    gm = aten_graph(lambda a, b, c: (lambda m: (m, m.squeeze(1) + c))(torch.bmm(a, b)), a, b, c)
    nodes = {n.name: n for n in gm.graph.nodes}
    spec = matmul.lower_matmul_with_epilogue(CTX, nodes["bmm"], [nodes["add"]], [nodes["bmm"], nodes["add"]],
                                             {nodes["squeeze"]: nodes["bmm"]})
    assert [n.name for n in spec.inputs].count("bmm") == 0  # the accumulator, not a load of the kernel's own output
    results = as_tuple(load_kernel(spec)(*(graph_values(gm, [a, b, c])[n] for n in spec.inputs)))
    references = float64_values(gm, [a, b, c])
    for out, node in zip(results, spec.outputs):
        assert_matches(out, references[node])

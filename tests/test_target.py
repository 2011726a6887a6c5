"""The `target` option reaches the kernels: the interpreter toolchain builds them for that chip, so
its capacities and rules (not the interpreter's environment default) decide what runs."""

from __future__ import annotations

import pytest
import torch

from neuron_inductor import config as config_module
from neuron_inductor import sim
from neuron_inductor.toolchain import select_toolchain
from neuron_inductor.toolchain.simulator import SimulatorToolchain

# Usable SBUF per partition: trn1 176 KiB, trn2 208 KiB, trn3 240 KiB (sim/targets.py).
SBUF_TILES_SOURCE = '''
import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def held_tiles(x):
    out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = [nl.ndarray((128, 8192), dtype=nl.float32, buffer=nl.sbuf) for _ in range({count})]
    for tile in tiles:
        nisa.memset(dst=tile, value=1.0)
    nisa.dma_copy(dst=out, src=tiles[-1][:, 0:8])
    return out
'''


def _run(target: str, count: int) -> torch.Tensor:
    kernel = SimulatorToolchain(target).build({"held_tiles": SBUF_TILES_SOURCE.format(count=count)})["held_tiles"]
    return kernel(torch.zeros(128, 8))


# count x 32 KiB tiles held at once: 6 (192 KiB) fit trn2 and trn3 only, 7 (224 KiB) trn3 only.
@pytest.mark.parametrize("target, fits", [("trn1", 5), ("trn2", 6), ("trn3", 7)])
def test_kernels_are_built_for_the_target_capacity(target, fits):
    assert torch.equal(_run(target, fits), torch.ones(128, 8))
    with pytest.raises(sim.NkiError, match="(?i)sbuf"):
        _run(target, fits + 1)


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_the_target_option_picks_the_toolchain_target(target):
    config = config_module.resolve({"target": target, "toolchain": "simulator"})
    toolchain = select_toolchain(config.toolchain, config.target)
    assert toolchain.target is sim.get_target(target)


def test_the_environment_target_does_not_override_the_option(monkeypatch):
    monkeypatch.setenv(sim.targets.TARGET_ENV, "trn3")
    with pytest.raises(sim.NkiError, match="(?i)sbuf"):
        _run("trn2", 7)


def test_an_unknown_target_lists_the_valid_ones():
    with pytest.raises(config_module.ConfigError, match="trn1, trn2, trn3"):
        config_module.resolve({"target": "trn9"})


# --- the target through lowering and rendering (lowering/context.py) ------------------------------

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from neuron_inductor.decompositions import neuron_decompositions  # noqa: E402
from neuron_inductor.lowering import matmul, norms  # noqa: E402
from neuron_inductor.lowering.context import KIB, LoweringContext  # noqa: E402
from neuron_inductor.lowering.ir import Unsupported  # noqa: E402

from .kernels.harness import TARGETS, aten_graph, assert_all_close, kernel_for, last_node, lower, run_node  # noqa: E402

aten = torch.ops.aten


@pytest.mark.parametrize("target", TARGETS)
def test_the_context_carries_the_targets_sizes(target):
    ctx = LoweringContext.for_target(target)
    chip = sim.get_target(target)
    assert ctx.target is chip
    assert ctx.tile.sbuf_bytes == chip.sbuf_usable_bytes
    assert ctx.tile.psum_fmax * 4 == chip.psum_bank_bytes and ctx.tile.psum_banks == 8
    assert ctx.tile.partitions == sim.language.tile_size.pmax == 128
    assert ctx.sbuf_budget(48 * KIB) == chip.sbuf_usable_bytes - 48 * KIB


# A node per family whose plan depends on the target, with inputs off the tile sizes.
FAMILY_CASES = {
    "matmul": (lambda a, b: a @ b, lambda: (torch.randn(130, 300), torch.randn(300, 515)), aten.mm.default),
    "layer_norm": (lambda x, w, b: torch.nn.functional.layer_norm(x, (700,), w, b),
                   lambda: (torch.randn(200, 700), torch.randn(700), torch.randn(700)), aten.native_layer_norm.default),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: (torch.randn(3, 130, 257),), aten._softmax.default),
    "pointwise": (lambda x, y: torch.sigmoid(x) * y + 1.0, lambda: (torch.randn(129, 1000), torch.randn(1000)),
                  aten.add.Tensor),
    "reduction": (lambda x: x.sum(0), lambda: (torch.randn(300, 70),), aten.sum.dim_IntList),
    "attention": (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                  lambda: tuple(torch.randn(1, 2, 200, 64) for _ in range(3)),
                  aten._scaled_dot_product_flash_attention_for_cpu.default),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_kernels_lowered_for_a_target_run_on_it(family, target):
    """Each family lowered and rendered for the target runs in the interpreter with that chip's
    rules and capacities, and matches eager."""
    fn, make_args, op = FAMILY_CASES[family]
    torch.manual_seed(0)
    args = make_args()
    gm = aten_graph(fn, *args)
    actual, expected, _ = run_node(gm, args, op, ctx=LoweringContext.for_target(target))
    assert_all_close(actual, expected, fp32_rtol=1e-4)


def test_sbuf_budgets_follow_the_target():
    """A larger SBUF gives larger resident blocks; trn2's plans keep their trn2 numbers."""
    trn1, trn2, trn3 = (LoweringContext.for_target(t) for t in TARGETS)
    blocks = [matmul.plan_blocking(ctx, 2048, 2048, 5120, 2, staged=False) for ctx in (trn1, trn2, trn3)]
    assert all(b["mode"] == "panel" for b in blocks)
    assert [b["block_m"] for b in blocks] == [128, 512, 1024]
    assert trn2.sbuf_budget(matmul.SBUF_RESERVE) == 128 * KIB
    assert trn2.sbuf_budget(norms.SBUF_RESERVE) == 160 * KIB
    chunks = [len(norms.row_layout(ctx, (4, 60000), 1, 40)["col_chunks"]) for ctx in (trn1, trn2, trn3)]
    assert chunks[0] > chunks[1] > chunks[2]


def test_attention_refuses_what_does_not_fit_the_target():
    """The same sequence fits trn3's SBUF and not trn1's; the reason names the target."""
    # resident per partition: 6 bytes per position (K^T, Q^T and V's chunks): 144 KiB, over trn1's budget
    q = torch.empty(1, 1, 24576, 128, dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gm = make_fx(sdpa, decomposition_table=neuron_decompositions(), tracing_mode="fake")(q, q, q)
    node = last_node(gm, aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert lower(node, LoweringContext.for_target("trn3")).family == "attention_fwd"
    with pytest.raises(Unsupported, match="on trn1"):
        lower(node, LoweringContext.for_target("trn1"))


def test_a_trn3_kernel_on_trn1_is_held_to_trn1s_capacity_at_its_live_peak():
    """A kernel planned for trn3's SBUF, run on trn1, is checked against trn1's capacity. This layer
    norm keeps whole 7000-column rows, but its broadcast rows of w and b die at their last read,
    where the compiler frees them: its live peak fits trn1, and it matches there too."""
    x, w, b = torch.randn(4, 7000), torch.randn(7000), torch.randn(7000)
    gm = aten_graph(lambda x, w, b: torch.nn.functional.layer_norm(x, (7000,), w, b), x, w, b)
    op = aten.native_layer_norm.default
    trn1, trn3 = LoweringContext.for_target("trn1"), LoweringContext.for_target("trn3")
    _, spec, _ = kernel_for(gm, op, ctx=trn3)
    assert len(spec.params["col_chunks"]) == 1
    from neuron_inductor.codegen.render import render_kernel

    kernel = sim.load_kernels(render_kernel(spec, trn3), "<trn3 layer norm>")[spec.name]
    on_trn1 = sim.Kernel(kernel.func, kernel.grid, "trn1")(x, w, b)
    actual, expected, _ = run_node(gm, (x, w, b), op, ctx=trn1)
    assert_all_close(actual, expected, fp32_rtol=1e-4)
    assert_all_close(list(on_trn1), expected, fp32_rtol=1e-4)


@pytest.mark.parametrize("target", ["trn1", "trn3"])
def test_the_target_option_reaches_the_lowering(target, fresh_compile_state):
    """Through torch.compile: a model compiled for a target gets that target's plans and results."""
    from neuron_inductor import config

    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.LayerNorm(700), torch.nn.Softmax(-1))
    x = torch.randn(130, 300)
    with config.patch(target=target, fallback="error"):
        out = torch.compile(model, backend="neuron")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-6)

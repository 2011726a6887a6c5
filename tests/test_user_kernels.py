"""Users' own NKI kernels: wrap_nki / nki_op in eager, on fake / meta tensors and as kernels of a
program compiled with backend="neuron" (fallback="error": the op must be a kernel, not a fallback)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import neuron_inductor
from neuron_inductor import nki_op, sim, wrap_nki
from neuron_inductor.nki_ops import NkiOpError
from neuron_inductor.observe import session

with sim.as_nki():  # a kernel file written for the real NKI, imported as a user would on a CPU host
    fused = importlib.import_module("tests.user_kernels.fused_tanh")

# Tolerances: fp32 kernels compute in fp32 like eager (tanh and the backward polynomial differ by a
# few ulps); bf16 stores round to 8 bits of mantissa (2^-8 relative), eager rounds differently.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@nki_op("uk_test::scaled_tanh_bwd", mutates_args=())
def scaled_tanh_bwd(y: torch.Tensor, dy: torch.Tensor, scale: float) -> torch.Tensor:
    return wrap_nki(fused.scaled_tanh_bwd)(y, dy, scale)


@nki_op("uk_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return wrap_nki(fused.scaled_tanh_fwd)(x, scale)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return scaled_tanh_bwd(y, grad, ctx.scale), None


scaled_tanh.register_autograd(_backward, setup_context=_setup_context)


@nki_op("uk_test::affine_rows", mutates_args=())
def affine_rows(x: torch.Tensor, mul: float, add: float) -> torch.Tensor:
    return wrap_nki(fused.affine_rows_grid)[x.shape[0] // 128](x, mul, add)


@nki_op("uk_test::accumulate", mutates_args={"acc"})
def accumulate(acc: torch.Tensor, x: torch.Tensor) -> None:
    wrap_nki(fused.accumulate_into)(acc, x)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    session.clear()
    yield
    torch._dynamo.reset()


def _compile(fn, tmp_path, **options):
    return torch.compile(fn, backend="neuron",
                         options={"fallback": "error", "cache_dir": str(tmp_path / "cache"), **options})


class TanhMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 48)
        self.fc2 = torch.nn.Linear(48, 8)

    def forward(self, x):
        return self.fc2(scaled_tanh(self.fc1(x), 0.7))


def test_eager_call_runs_the_kernel_in_the_interpreter():
    x = torch.randn(200, 64)
    with sim.trace() as recorded:
        out = scaled_tanh(x, 0.5)
    torch.testing.assert_close(out, torch.tanh(0.5 * x), **TOL[torch.float32])
    assert {i.kernel for i in recorded.instructions} == {"scaled_tanh_fwd"}


def test_fake_and_meta_runs_take_shapes_from_the_kernel_without_math():
    with sim.trace() as recorded:
        meta = scaled_tanh(torch.empty(300, 16, device="meta", dtype=torch.bfloat16), 0.5)
        with FakeTensorMode() as mode:
            fake = scaled_tanh(mode.from_tensor(torch.empty(130, 8)), 0.5)
    assert meta.is_meta and meta.shape == (300, 16) and meta.dtype == torch.bfloat16
    assert fake.shape == (130, 8) and fake.dtype == torch.float32
    assert not recorded.instructions  # shape runs are no work: nothing reaches a user's trace


def test_opcheck_accepts_schema_fake_and_autograd_registration():
    torch.library.opcheck(scaled_tanh, (torch.randn(130, 8, requires_grad=True), 0.5))
    torch.library.opcheck(accumulate, (torch.randn(128, 8), torch.randn(128, 8)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_training_step_matches_eager_and_runs_the_user_kernels(tmp_path, dtype):
    torch.manual_seed(0)
    model = TanhMLP().to(dtype)
    reference = TanhMLP().to(dtype)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(150, 32, dtype=dtype)  # 150 rows: one full 128-row tile and a partial one

    compiled = _compile(model, tmp_path)
    with sim.trace() as recorded:
        loss = compiled(x).float().square().mean()
        loss.backward()
    expected = reference(x).float().square().mean()
    expected.backward()

    torch.testing.assert_close(loss, expected, **TOL[dtype])
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL[dtype])
    ran = {i.kernel for i in recorded.instructions}
    assert {"scaled_tanh_fwd", "scaled_tanh_bwd"} <= ran
    report = neuron_inductor.report()
    user = [k for k in report.kernels if k["family"] == "user"]
    assert sorted(op for k in user for op in k["ops"]) == ["uk_test.scaled_tanh.default",
                                                         "uk_test.scaled_tanh_bwd.default"]
    assert not report.fallbacks
    assert all(k["estimated_seconds"] > 0 and k["flops"] > 0 for k in user)


def test_grid_launch_runs_every_program(tmp_path):
    x = torch.randn(384, 24)
    out = _compile(lambda t: affine_rows(t, 3.0, -1.0) + 1, tmp_path, verify="raise")(x)
    torch.testing.assert_close(out, x * 3.0 - 1.0 + 1, **TOL[torch.float32])
    with pytest.raises(ValueError, match="positive Python ints"):
        wrap_nki(fused.affine_rows_grid)[0]


def test_declared_mutation_updates_the_argument_eager_and_compiled(tmp_path):
    acc, x = torch.randn(128, 16), torch.randn(128, 16)
    expected = acc + x
    eager_acc = acc.clone()
    accumulate(eager_acc, x)
    torch.testing.assert_close(eager_acc, expected)

    def step(a, t):
        accumulate(a, t * 2)
        return a.sum()

    compiled_acc = acc.clone()
    total = _compile(step, tmp_path)(compiled_acc, x)
    torch.testing.assert_close(compiled_acc, acc + 2 * x, **TOL[torch.float32])
    torch.testing.assert_close(total, (acc + 2 * x).sum(), atol=1e-4, rtol=1e-5)
    assert any(k["family"] == "user" for k in neuron_inductor.report().kernels)


def test_undeclared_mutation_and_returned_inputs_are_errors_naming_the_fix():
    @nki_op("uk_test::sneaky_accumulate", mutates_args=())
    def sneaky(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        wrap_nki(fused.accumulate_into)(acc, x)
        return x.clone()

    with pytest.raises(NkiOpError, match=r"mutates_args=\{'acc'\}"):
        sneaky(torch.zeros(128, 4), torch.ones(128, 4))
    with pytest.raises(NkiOpError, match=r"mutates_args=\{'acc'\}"):  # the fake run checks it too
        sneaky(torch.zeros(128, 4, device="meta"), torch.ones(128, 4, device="meta"))

    @nki_op("uk_test::returns_input", mutates_args=())
    def returns_input(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(NkiOpError, match="must return new tensors"):
        returns_input(torch.ones(2))


def test_bad_wrap_nki_uses_name_the_fix():
    with pytest.raises(TypeError, match="decorated with @nki.jit"):
        wrap_nki(lambda x: x)
    with pytest.raises(TypeError, match=r"signature is scaled_tanh_fwd\(x, scale\)"):
        wrap_nki(fused.scaled_tanh_fwd)(torch.ones(4, 4))
    with pytest.raises(TypeError, match="mutates_args=\\{'acc'\\}"):
        nki_op("uk_test::bad_declaration", mutates_args="acc")


def test_kernels_from_load_kernels_and_inline_definitions_compile(tmp_path):
    source = NEGATE_KERNEL  # defined below, also written to a file there
    negate = sim.load_kernels(source, "<user negate kernels>")["negate"]
    with sim.as_nki():
        import nki
        import nki.isa as nisa
        import nki.language as nl

        @nki.jit
        def double(x):
            out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add)
            nisa.dma_copy(dst=out, src=t)
            return out

    @nki_op("uk_test::negate_double", mutates_args=())
    def negate_double(x: torch.Tensor) -> torch.Tensor:
        return wrap_nki(double)(wrap_nki(negate)(x))

    x = torch.randn(64, 32)
    dump = tmp_path / "dump"
    out = _compile(lambda t: negate_double(t) * 0.5, tmp_path, dump_dir=str(dump))(x)
    torch.testing.assert_close(out, -x, **TOL[torch.float32])
    kernel_files = {p.name: p.read_text() for p in dump.rglob("kernels/k*_user.py")}
    assert len(kernel_files) == 1
    (text,) = kernel_files.values()
    assert "def negate(x):" in text and "def double(x):" in text  # both kernels' source, next to generated ones
    assert any(dump.rglob("kernels/k*_pointwise.py"))
    (report,) = [json.loads(p.read_text()) for p in dump.rglob("report.json")]
    assert [k["family"] for k in report["kernels"]].count("user") == 1 and not report["fallbacks"]


def test_autograd_function_around_the_ops(tmp_path):
    class ScaledTanh(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            y = torch.ops.uk_test.scaled_tanh(x, 2.0)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return torch.ops.uk_test.scaled_tanh_bwd(y, grad, 2.0)

    x = torch.randn(40, 8, requires_grad=True)
    _compile(lambda t: ScaledTanh.apply(t).sum(), tmp_path)(x).backward()
    reference = x.detach().clone().requires_grad_()
    torch.tanh(2.0 * reference).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad, **TOL[torch.float32])


def test_dynamic_lengths_run_the_kernel_on_exact_shapes(tmp_path):
    """A kernel's shape logic is Python on ints, so its sizes are specialised: no padded bucket feeds it."""
    compiled = _compile(lambda t: scaled_tanh(t * 1.0, 0.5), tmp_path)
    for rows in (100, 131, 170):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), torch.tanh(0.5 * x), **TOL[torch.float32])
    buckets = neuron_inductor.report().buckets
    assert len(buckets) == 3 and all(b["padding"] is None for b in buckets)


def test_a_cached_program_rebuilds_the_user_kernel_step(tmp_path):
    x = torch.randn(64, 8)
    first = _compile(lambda t: scaled_tanh(t + 1, 0.5), tmp_path)(x)
    torch._dynamo.reset()
    session.clear()
    with sim.trace() as recorded:
        again = _compile(lambda t: scaled_tanh(t + 1, 0.5), tmp_path)(x)
    torch.testing.assert_close(again, first)
    assert "scaled_tanh_fwd" in {i.kernel for i in recorded.instructions}
    events = {b["cache"]["event"] for b in neuron_inductor.report().buckets}
    assert events and events <= {"memory hit", "disk hit"}


@nki_op("uk_test::scaled_tanh_pad_safe", mutates_args=(), pad_safe=True)
def scaled_tanh_pad_safe(x: torch.Tensor, scale: float) -> torch.Tensor:
    return wrap_nki(fused.scaled_tanh_fwd)(x, scale)


def test_a_pad_safe_op_runs_padded_to_its_bucket(tmp_path):
    """Declared pad-safe (rows are independent), the op keeps its sizes symbolic: lengths 131..200 share
    the 256-row bucket, and the sum over the padded rows after it is masked by the pad-safety pass."""
    compiled = _compile(lambda t: scaled_tanh_pad_safe(t * 1.0, 0.5).sum(0), tmp_path)
    for rows in (100, 131, 170, 200):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(compiled(x), torch.tanh(0.5 * x).sum(0), atol=1e-4, rtol=1e-5)
    padded = [b for b in neuron_inductor.report().buckets if b["padding"]]
    assert len(padded) == 1 and padded[0]["padding"]["padded_elements"] == 256 * 16
    assert any(k["family"] == "user" for k in padded[0]["kernels"])


def test_a_kernel_called_outside_an_op_is_a_graph_break_naming_nki_op():
    def f(x):
        return wrap_nki(fused.scaled_tanh_fwd)(x * 2, 0.5) + 1

    x = torch.randn(16, 8)
    torch.testing.assert_close(torch.compile(f, backend="neuron")(x), torch.tanh(x) + 1, **TOL[torch.float32])
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"inside a function registered with @neuron_inductor.nki_op"):
        torch.compile(f, backend="neuron", fullgraph=True)(x)


@torch.library.custom_op("uk_test::add_column_sums_", mutates_args={"acc"})
def add_column_sums_(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x.sum(0))


@add_column_sums_.register_fake
def _(acc, x):
    return None


def test_a_mutating_custom_op_that_reads_padded_rows_runs_unpadded(tmp_path):
    """auto_functionalized_v2 is judged by the op it wraps: this op sums over the padded rows (of exp(x),
    nonzero there), so the graph must run at exact shapes to match eager."""
    def f(t):
        acc = torch.zeros(t.shape[1])
        add_column_sums_(acc, t.exp())
        return acc

    compiled = _compile(f, tmp_path, fallback="allow")
    for rows in (100, 131, 170):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(compiled(x), x.exp().sum(0), atol=1e-4, rtol=1e-5)


STAND_IN_NKI = '''
class _Kernel:  # the real nki.jit's kernel object, as far as wrap_nki sees it: .func, [grid], call
    def __init__(self, func):
        self.func = func

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        raise RuntimeError("the stand-in nki has no Neuron device")


def jit(func=None, **options):
    return _Kernel(func) if func is not None else _Kernel
'''

NEGATE_KERNEL = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def negate(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=-1.0)
    nisa.dma_copy(dst=out, src=t)
    return out
'''


def test_a_kernel_written_for_the_real_nki_is_rebuilt_for_the_interpreter(tmp_path):
    """On a host without a Neuron device, a kernel made by the real nki.jit (here a stand-in package)
    runs in the interpreter, rebuilt from its file, in eager, shape and compiled runs."""
    import sys

    (tmp_path / "nki").mkdir()
    (tmp_path / "nki" / "__init__.py").write_text(STAND_IN_NKI)
    (tmp_path / "nki" / "language.py").write_text("")
    (tmp_path / "nki" / "isa.py").write_text("")
    (tmp_path / "uk_real_nki_kernel.py").write_text(NEGATE_KERNEL)
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "nki" or name.startswith("nki.")}
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("uk_real_nki_kernel")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "nki" or n.startswith("nki.")]:
            del sys.modules[name]
        sys.modules.update(saved)
        sys.modules.pop("uk_real_nki_kernel", None)
    assert type(module.negate).__module__ == "nki"

    @nki_op("uk_test::negate_real_nki", mutates_args=())
    def negate(x: torch.Tensor) -> torch.Tensor:
        return wrap_nki(module.negate)(x)

    x = torch.randn(32, 8)
    with sim.trace() as recorded:
        torch.testing.assert_close(negate(x), -x)
    assert {i.kernel for i in recorded.instructions} == {"negate"}
    assert negate(x.to("meta")).shape == (32, 8)
    torch.testing.assert_close(_compile(lambda t: negate(t) + 1, tmp_path)(x), 1 - x)


@pytest.mark.slow
def test_custom_kernel_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "custom_kernel.py"
    run = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "user kernels in the last step's trace: swiglu_bwd, swiglu_fwd" in run.stdout
    losses = [line.split()[1:] for line in run.stdout.splitlines() if line[:4].strip().isdigit()]
    assert len(losses) == 5 and all(abs(float(a) - float(b)) < 1e-4 for a, b in losses)
    assert "backend's generated kernels" in run.stdout

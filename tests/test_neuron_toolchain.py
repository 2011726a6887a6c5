"""The `neuron` toolchain calls kernels the way nki.jit documents it under TorchNeuron, checked against a
fake `nki` that records every call: device-resident contiguous tensors, at least one tensor per kernel,
the host's LNC, kernel source readable through inspect.getsource, and the interpreter's rule check
before first use."""

from __future__ import annotations

import importlib.machinery
import inspect
import os
import sys
import types

import pytest
import torch

from neuron_inductor import compiler, sim
from neuron_inductor.compiler import Program, compile_and_build
from neuron_inductor.toolchain.neuron import LNC_ENV, NeuronToolchain, ToolchainUnavailable

from .kernels.harness import aten_graph


class FakeNki(types.ModuleType):
    """`nki` whose jit records each launch and checks nki.jit's calling convention, then runs the kernel
    in the interpreter (on CPU copies when the arguments are on the stand-in device `meta`)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__("nki")
        self.__spec__ = importlib.machinery.ModuleSpec("nki", None)
        self.language, self.isa = sim.language, sim.isa
        self.device = device
        self.sources: dict[str, str] = {}
        self.launches: list[dict] = []

    def jit(self, fn):
        self.sources[fn.__name__] = inspect.getsource(fn)  # nki parses the kernel's source
        return FakeKernel(self, fn, 1)


class FakeKernel:
    def __init__(self, nki: FakeNki, fn, lnc: int) -> None:
        self.nki, self.fn, self.lnc = nki, fn, lnc

    def __getitem__(self, lnc):
        return FakeKernel(self.nki, self.fn, lnc)

    def __call__(self, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.nki.launches.append({"kernel": self.fn.__name__, "lnc": self.lnc, "tensors": len(tensors),
                                  "devices": {t.device for t in tensors},
                                  "contiguous": all(t.is_contiguous() for t in tensors)})
        if not tensors:
            raise RuntimeError("nki.jit: no tensor argument, cannot detect the framework")
        if self.lnc != int(os.environ.get(LNC_ENV, "2")):  # "Mismatching the two will cause a runtime error"
            raise RuntimeError(f"launched with LNC={self.lnc}, the runtime has {os.environ.get(LNC_ENV)}")
        on_meta = self.nki.device.type == "meta"
        cpu = [torch.zeros(a.shape, dtype=a.dtype) if on_meta and isinstance(a, torch.Tensor) else a for a in args]
        result = sim.jit(self.fn)[self.lnc](*cpu)
        if not on_meta:
            return result
        return tuple(r.to("meta") for r in result) if isinstance(result, tuple) else result.to("meta")


@pytest.fixture
def fake_nki(monkeypatch):
    def install(device):
        fake = FakeNki(torch.device(device))
        for name, module in {"nki": fake, "nki.language": sim.language, "nki.isa": sim.isa}.items():
            monkeypatch.setitem(sys.modules, name, module)
        return fake
    return install


SOURCE = '''
import nki
import nki.language as nl
import nki.isa as nisa


@nki.jit
def k0_scale(in0):
    out0 = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((64, 32), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=in0)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out0, src=t)
    return out0
'''


def test_tensors_move_to_the_device_contiguous_with_the_host_lnc(fake_nki, monkeypatch):
    monkeypatch.delenv(LNC_ENV, raising=False)
    fake = fake_nki("meta")  # the stand-in for the neuron device
    kernel = NeuronToolchain(fake, torch.device("meta")).build({"k0_scale": SOURCE})["k0_scale"]
    out = kernel(torch.randn(32, 64).t())  # a CPU, transposed (non-contiguous) view
    assert out.device.type == "meta" and out.shape == (64, 32)
    assert fake.launches == [{"kernel": "k0_scale", "lnc": 2, "tensors": 1, "devices": {torch.device("meta")},
                              "contiguous": True}]
    assert "def k0_scale(in0):" in fake.sources["k0_scale"]


def test_lnc_follows_the_environment(fake_nki, monkeypatch):
    monkeypatch.setenv(LNC_ENV, "1")
    fake = fake_nki("cpu")
    kernel = NeuronToolchain(fake, torch.device("cpu")).build({"k0_scale": SOURCE})["k0_scale"]
    x = torch.randn(64, 32)
    torch.testing.assert_close(kernel(x), 2 * x)
    assert fake.launches[0]["lnc"] == 1
    monkeypatch.setenv(LNC_ENV, "4")
    with pytest.raises(ToolchainUnavailable, match="NEURON_LOGICAL_NC_CONFIG='4'"):
        NeuronToolchain(fake, torch.device("cpu"))


def test_without_a_neuron_device_the_error_says_what_to_install(fake_nki, monkeypatch):
    fake = fake_nki("cpu")
    with pytest.raises(ToolchainUnavailable, match="torch-neuronx"):
        NeuronToolchain(fake)  # torch.device('neuron') does not exist on this host


def test_generated_graph_runs_under_the_calling_convention(fake_nki, monkeypatch):
    """Zero-input kernels (arange), int64 and 0-d arguments, strided views, a copy_ into a graph input:
    every launch gets >= 1 contiguous device tensor at the host's LNC, results match eager, and the
    interpreter checked every kernel first (its cost estimates are in the artifact)."""
    monkeypatch.setenv(LNC_ENV, "2")
    fake = fake_nki("cpu")

    def fn(x, ids, scale, buf):
        positions = torch.arange(x.shape[0], dtype=torch.float32)
        y = (x.t() * scale + positions).sum(0)
        picked = torch.nn.functional.embedding(ids, x)
        buf[:, 0].copy_(y[: buf.shape[0]])
        return y, picked, ids.sum()

    args = (torch.randn(16, 8), torch.tensor([[1, 5], [3, 0]]), torch.tensor(1.5), torch.zeros(8, 3))
    expected_buf = args[3].clone()
    expected = fn(args[0], args[1], args[2], expected_buf)
    gm = aten_graph(fn, *[a.clone() for a in args])
    toolchain = NeuronToolchain(fake, torch.device("cpu"))
    artifact, lowered, kernels = compile_and_build(gm, "error", toolchain, "trn2")
    assert set(artifact.meta["estimates"]) == set(artifact.kernel_sources)  # the rule check ran on each
    assert any(spec.output_argument for spec in lowered.kernels)
    buf = args[3].clone()
    got = Program.load(artifact, toolchain, {}, kernels)([args[0], args[1], args[2], buf])
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    torch.testing.assert_close(buf, expected_buf)
    assert fake.launches and all(launch["tensors"] >= 1 and launch["contiguous"] and launch["lnc"] == 2
                                 and launch["devices"] == {torch.device("cpu")} for launch in fake.launches)
    assert set(fake.sources) == set(artifact.kernel_sources)


def test_the_rule_check_runs_for_the_kernels_target(fake_nki, monkeypatch):
    """Under the neuron toolchain the interpreter still checks every kernel first, with the rules
    and capacities of the target the kernels were planned for."""
    fake = fake_nki("cpu")
    built, interpreter = [], compiler.SimulatorToolchain
    monkeypatch.setattr(compiler, "SimulatorToolchain", lambda target: built.append(target) or interpreter(target))
    gm = aten_graph(lambda x: (torch.softmax(x, -1) * 2,), torch.randn(4, 8))
    artifact, _, _ = compile_and_build(gm, "error", NeuronToolchain(fake, torch.device("cpu")), "trn3")
    assert built == ["trn3"] and set(artifact.meta["estimates"]) == set(artifact.kernel_sources)

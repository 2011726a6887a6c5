"""Running NKI source unchanged: as_nki(), load_kernels(), `python -m neuron_inductor.sim`."""

import importlib.util
import pathlib
import subprocess
import sys
import traceback
import types

import pytest
import torch

from neuron_inductor import sim

TUTORIAL = pathlib.Path(__file__).parent / "nki_kernels" / "tutorial_matmul.py"

GENERATED = '''
import nki
import nki.language as nl
import nki.isa as nisa

@nki.jit
def k0_pointwise(in0, in1):
    out0 = nl.ndarray((256, 64), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in nl.affine_range(2):
        a = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=in0[i * 128:(i + 1) * 128, 0:64])
        b = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=in1[i * 128:(i + 1) * 128, 0:64])
        r = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=r, data1=a, data2=b, op=nl.multiply)
        nisa.activation(dst=r, op=nl.tanh, data=r)
        nisa.dma_copy(dst=out0[i * 128:(i + 1) * 128, 0:64], src=r)
    return out0

@nki.jit
def k1_two_outputs(in0):
    out0 = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    out1 = nl.ndarray((128, 8), dtype=nl.int32, buffer=nl.shared_hbm)
    t = nl.ndarray((128, 8), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=in0)
    nisa.dma_copy(dst=out1, src=t)
    nisa.dma_copy(dst=out0, src=t)
    return (out0, out1)

@nki.jit
def k2_broken(in0):
    t = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=in0[0:128, 0:4])
'''


def test_load_kernels_runs_generated_source_on_strided_views():
    kernels = sim.load_kernels(GENERATED, "<kernels test>")
    assert set(kernels) == {"k0_pointwise", "k1_two_outputs", "k2_broken"}
    in0 = torch.randn(300, 512).t()[:256, 100:164]  # [256, 64] transposed and sliced: non-contiguous
    in1 = torch.randn(1, 64).expand(256, 64)       # stride-0 broadcast
    out = kernels["k0_pointwise"](in0, in1)
    torch.testing.assert_close(out, torch.tanh(in0 * in1))
    ids = torch.randint(0, 1000, (128, 8), dtype=torch.int32)
    floats, ints = kernels["k1_two_outputs"](ids)
    assert ints.dtype == torch.int32 and torch.equal(ints, ids.int())
    assert floats.dtype == torch.float32 and torch.equal(floats, ids.float())


def test_errors_point_at_the_kernel_source_line():
    kernels = sim.load_kernels(GENERATED, "<kernels test>")
    with pytest.raises(sim.NkiRuleError) as info:
        kernels["k2_broken"](torch.zeros(128, 8))
    frames = traceback.extract_tb(info.value.__traceback__)
    kernel_frame = [f for f in frames if f.filename == "<kernels test>"][-1]
    assert "nisa.dma_copy(dst=t, src=in0[0:128, 0:4])" in kernel_frame.line


def nki_modules() -> dict:
    return {name: module for name, module in sys.modules.items() if name == "nki" or name.startswith("nki.")}


def test_as_nki_restores_sys_modules():
    before = nki_modules()
    with sim.as_nki():
        import nki
        import nki.isa as nisa
        import nki.language as nl
        assert nl is sim.language and nisa is sim.isa and nki.jit is sim.jit
    assert nki_modules() == before


def test_as_nki_never_shadows_a_real_nki_outside_the_block(monkeypatch):
    real = types.ModuleType("nki")
    real_language = types.ModuleType("nki.language")
    real.language = real_language
    monkeypatch.setitem(sys.modules, "nki", real)
    monkeypatch.setitem(sys.modules, "nki.language", real_language)
    with sim.as_nki():
        import nki.language as nl
        assert nl is sim.language
        with sim.as_nki():  # nesting is harmless
            import nki
            assert nki.simulate is sim.simulate
    assert sys.modules["nki"] is real and sys.modules["nki.language"] is real_language
    assert "nki.isa" not in sys.modules



def test_as_nki_removes_modules_added_inside_and_puts_a_real_nki_back(monkeypatch):
    """On exit as_nki scans sys.modules only when modules were added or replaced inside (the backend
    enters it for each kernel it loads, and a scan is slow with thousands of modules loaded): each such
    case is cleaned up all the same."""
    before = nki_modules()
    with sim.as_nki():
        sys.modules["nki.extra"] = types.ModuleType("nki.extra")  # as an import under nki would add
    assert nki_modules() == before
    real = {name: types.ModuleType(name) for name in ("nki", "nki.language", "nki.kernels")}
    for name, module in real.items():
        monkeypatch.setitem(sys.modules, name, module)
    with sim.as_nki():
        import nki
        assert nki.jit is sim.jit and "nki.kernels" not in sys.modules  # the real one's modules set aside
        sys.modules["nki.extra"] = types.ModuleType("nki.extra")
    assert nki_modules() == real
    with sim.as_nki():
        sys.modules["nki.isa"] = types.ModuleType("nki.isa")  # a facade module replaced inside
    assert nki_modules() == real

def test_tutorial_kernel_runs_unmodified_under_as_nki():
    spec = importlib.util.spec_from_file_location("tutorial_matmul", TUTORIAL)
    module = importlib.util.module_from_spec(spec)
    with sim.as_nki():
        spec.loader.exec_module(module)
    lhsT, rhs = torch.randn(256, 128).bfloat16(), torch.randn(256, 1024).bfloat16()
    out = module.nki_matmul_tiled_(lhsT, rhs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (lhsT.float().t() @ rhs.float()).bfloat16().float(), rtol=1e-2, atol=0.1)


def test_python_m_runs_a_script_written_for_real_nki():
    result = subprocess.run([sys.executable, "-m", "neuron_inductor.sim", str(TUTORIAL), "128", "256", "512"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "tutorial matmul 128x256x512: OK" in result.stdout

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

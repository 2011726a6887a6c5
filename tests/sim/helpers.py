"""Helpers for the interpreter tests: run one instruction on SBUF tiles loaded from torch tensors."""

from __future__ import annotations

import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

# Tolerances against torch references computed in fp32 and cast like the hardware.
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=0, atol=0)}


def on_tiles(body, out_shape, out_dtype, *inputs, out_buffer=None):
    """Load each input into an SBUF tile of its dtype, run body(dst, *tiles), return dst as torch.

    out_buffer=nl.psum routes the result through a PSUM tile and a tensor_copy.
    """
    @sim.jit
    def kernel(*hbm_inputs):
        tiles = []
        for x in hbm_inputs:
            t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            tiles.append(t)
        dst = nl.ndarray(out_shape, out_dtype, buffer=out_buffer or nl.sbuf)
        body(dst, *tiles)
        if out_buffer is nl.psum:
            staged = nl.ndarray(out_shape, out_dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=staged, src=dst)
            dst = staged
        out = nl.ndarray(out_shape, out_dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst)
        return out

    return kernel(*inputs)


def nl_dtype(torch_dtype):
    return sim.dtypes.of_torch(torch_dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: NaNs compare equal when their bits do."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])

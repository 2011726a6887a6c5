"""The programs of an LNC=2 launch as two cores (sim/cores.py), against kernels built to break the scheduler:
barriers in loops of different trip counts, mismatched sendrecv pairs, a core failing mid-launch,
a kernel that catches exceptions, and the order the two cores' HBM accesses interleave in."""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

DTYPES = [torch.float32, torch.bfloat16]


def nki_dtype(dtype):
    return nl.float32 if dtype is torch.float32 else nl.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_barrier_in_a_loop_releases_both_cores_each_round(dtype):
    """Each round core k writes its slot, meets the other at the barrier, then reads the other's slot:
    after round r both have seen r+1 writes of each other."""
    x = torch.randn(2, 8, 16).to(dtype)

    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        shared = nl.ndarray((2, 8, 16), data.dtype, buffer=nl.shared_hbm)
        seen = nl.ndarray((3, 2, 8, 16), data.dtype, buffer=nl.shared_hbm)
        tile = nl.ndarray((8, 16), data.dtype)
        nisa.dma_copy(dst=tile, src=data[me])
        for r in range(3):
            nisa.tensor_scalar(tile, tile, nl.add, 1.0)
            nisa.dma_copy(dst=shared[me], src=tile)
            nisa.core_barrier(shared, cores=(0, 1))
            theirs = nl.ndarray((8, 16), data.dtype)
            nisa.dma_copy(dst=theirs, src=shared[1 - me])
            nisa.dma_copy(dst=seen[r, me], src=theirs)
            nisa.core_barrier(shared, cores=(0, 1))  # nobody overwrites a slot the other still reads
        return seen

    seen = kernel[2](x)
    written = x.clone()
    for r in range(3):
        written = (written.float() + 1.0).to(dtype)  # each round's add rounds to the tile's dtype
        for me in range(2):
            assert torch.equal(seen[r, me], written[1 - me])


def test_a_barrier_in_loops_of_different_trip_counts_deadlocks_naming_both_cores():
    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        for _ in range(3 if me == 0 else 2):
            nisa.core_barrier(shared, cores=(0, 1))
        return shared

    with pytest.raises(sim.NkiRuleError, match="deadlocked") as error:
        kernel[2](torch.zeros(1))
    message = str(error.value)
    assert "program 0 waits at nisa.core_barrier #2 with programs [0, 1], which programs [0] reached" in message
    assert "program 1 has finished" in message


@pytest.mark.parametrize("dtype", DTYPES)
def test_sendrecv_rounds_pair_by_pipe_and_order(dtype):
    """Two pipes used in alternation, three rounds each: each receive gets the other core's send of
    the same pipe and round."""
    x = torch.randn(2, 4, 8).to(dtype)

    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        other = 1 - me
        out = nl.ndarray((3, 2, 2, 4, 8), data.dtype, buffer=nl.shared_hbm)
        mine = nl.ndarray((4, 8), data.dtype)
        nisa.dma_copy(dst=mine, src=data[me])
        for r in range(3):
            for pipe in (0, 1):
                nisa.tensor_scalar(mine, mine, nl.multiply, 2.0)
                got = nl.ndarray((4, 8), data.dtype)
                nisa.sendrecv(src=mine, dst=got, send_to_rank=other, recv_from_rank=other, pipe_id=pipe)
                nisa.dma_copy(dst=out[r, pipe, me], src=got)
        return out

    out = kernel[2](x)
    for r in range(3):
        for pipe in (0, 1):
            for me in range(2):
                factor = 2.0 ** (2 * r + pipe + 1)
                assert torch.equal(out[r, pipe, me], (x[1 - me].float() * factor).to(dtype))


def test_sendrecv_to_itself_while_the_other_core_expects_it_is_refused():
    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        tile = nl.ndarray((4, 8), nl.float32)
        nisa.dma_copy(dst=tile, src=data)
        got = nl.ndarray((4, 8), nl.float32)
        # core 0 receives from core 1, but core 1 sends to itself
        nisa.sendrecv(src=tile, dst=got, send_to_rank=me, recv_from_rank=1 - me, pipe_id=0)
        return data

    with pytest.raises(sim.NkiRuleError, match="sends to core 1") as error:
        kernel[2](torch.zeros(4, 8))
    assert error.value.op == "nisa.sendrecv"


def test_sendrecv_on_different_pipes_deadlocks():
    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        tile = nl.ndarray((4, 8), nl.float32)
        nisa.dma_copy(dst=tile, src=data)
        nisa.sendrecv(src=tile, dst=tile, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=me)
        return data

    with pytest.raises(sim.NkiRuleError, match="deadlocked") as error:
        kernel[2](torch.zeros(4, 8))
    assert "sendrecv(pipe_id=0)" in str(error.value) and "sendrecv(pipe_id=1)" in str(error.value)


def test_a_core_failing_mid_launch_stops_the_other_and_names_itself():
    """Core 1 fails after some DMAs while core 0 is still copying (not at a sync point): core 0 stops at
    its next HBM access, and the error says which program raised it."""
    progress = []

    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        tile = nl.ndarray((4, 8), nl.float32)
        for i in range(50):
            nisa.dma_copy(dst=tile, src=data)
            progress.append((me, i))
            if me == 1 and i == 5:
                raise ValueError("core 1 failed")
        return data

    with pytest.raises(ValueError, match="core 1 failed") as error:
        kernel[2](torch.zeros(4, 8))
    assert any("in program 1 of the 2-program launch" in note for note in error.value.__notes__)
    assert max(i for me, i in progress if me == 0) <= 6  # core 0 stopped within a step of the failure


def test_a_kernel_catching_exceptions_cannot_swallow_the_other_cores_failure():
    ran_on = []

    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        shared = nl.ndarray((2, 4), nl.float32, buffer=nl.shared_hbm)
        if me == 1:
            raise ValueError("core 1 failed")
        try:
            nisa.core_barrier(shared, cores=(0, 1))
        except Exception:  # noqa: BLE001 -- a kernel's fallback path
            pass
        ran_on.append(me)  # core 0 must not get here: the launch already failed
        return shared

    with pytest.raises(ValueError, match="core 1 failed"):
        kernel[2](torch.zeros(1))
    assert ran_on == []


def test_a_rule_error_in_one_core_names_the_program():
    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        tile = nl.ndarray((4, 8), nl.float32)
        nisa.dma_copy(dst=tile, src=data[0:4 if me == 0 else 3])  # core 1 copies 3 rows into 4
        return data

    with pytest.raises(sim.NkiRuleError, match="same number of elements") as error:
        kernel[2](torch.zeros(4, 8))
    assert any("in program 1 " in note for note in error.value.__notes__)


def test_the_cores_hbm_accesses_interleave_one_each_and_each_trace_keeps_its_order():
    """Same code on both cores: their DMAs alternate 0, 1, 0, 1 (the lower program first); each
    program's instructions, taken alone, are what a one-core run of it records."""
    @sim.jit
    def kernel(data):
        me = nl.program_id(0)
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((4, 8), nl.float32)
        for _ in range(3):
            nisa.dma_copy(dst=tile, src=data)
            nisa.tensor_scalar(tile, tile, nl.add, 1.0)
            nisa.dma_copy(dst=out[me], src=tile)
        return out

    with sim.trace() as both:
        kernel[2](torch.zeros(4, 8))
    dmas = [i.program_id[0] for i in both.instructions if i.op == "dma_copy"]
    assert dmas == [0, 1] * 6
    with sim.trace() as alone:
        kernel(torch.zeros(4, 8))
    for program in (0, 1):
        mine = [(i.engine, i.op, i.shapes) for i in both.instructions if i.program_id[0] == program]
        assert mine == [(i.engine, i.op, i.shapes) for i in alone.instructions]

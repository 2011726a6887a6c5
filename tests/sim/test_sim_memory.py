"""Fresh memory reads as NaN / 4; live SBUF and PSUM bytes are held against the target's capacity."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl
from neuron_inductor.sim import tensor as sim_tensor


@sim.jit
def store_unwritten(x):
    t = nl.ndarray((128, 64), nl.float32)
    nisa.dma_copy(dst=t[:, 0:32], src=x)
    out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_unwritten_sbuf_reads_as_nan():
    x = torch.randn(128, 32)
    out = store_unwritten(x)
    assert torch.equal(out[:, :32], x)
    assert torch.isnan(out[:, 32:]).all()


def test_unwritten_memory_flows_into_results_as_nan():
    @sim.jit
    def kernel(x):
        t = nl.ndarray((128, 64), nl.float32)
        nisa.dma_copy(dst=t[:, 0:63], src=x)  # last column forgotten
        total = nl.ndarray((128, 1), nl.float32)
        nisa.tensor_reduce(dst=total, op=nl.add, data=t, axis=1)
        out = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=total)
        return out

    assert torch.isnan(kernel(torch.randn(128, 63))).all()


def test_unwritten_integers_read_as_4_and_outputs_as_nan():
    @sim.jit
    def kernel():
        t = nl.ndarray((8, 8), nl.int32)
        ints = nl.ndarray((8, 8), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=ints, src=t)
        never_written = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.shared_hbm)
        return ints, never_written

    ints, never_written = kernel()
    assert torch.equal(ints, torch.full((8, 8), 4, dtype=torch.int32))
    assert never_written.dtype == torch.bfloat16 and torch.isnan(never_written.float()).all()


def keep_tiles(count, free, buffer=nl.sbuf):
    @sim.jit
    def kernel():
        kept = []
        for _ in nl.affine_range(count):
            kept.append(nl.ndarray((128, free), nl.float32, buffer=buffer))
            nisa.memset(kept[-1], 0.0)  # a tile takes its bytes at its first write
        return None

    return kernel


def test_sbuf_capacity_overflow():
    usable = sim.get_target("trn2").sbuf_usable_bytes  # 208 KiB per partition
    keep_tiles(usable // 4096, 1024)()                  # exactly full: fine
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(usable // 4096 + 1, 1024)()
    error = info.value
    assert error.op == "nl.ndarray" and "SBUF" in error.rule and error.value == usable + 4096
    assert f"over the {usable} B/partition available on trn2" in str(error)


def test_psum_capacity_overflow():
    keep_tiles(8, 512, nl.psum)()  # 8 banks of 2 KiB
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(9, 512, nl.psum)()
    assert "PSUM" in info.value.rule and info.value.value == 18 * 1024


def test_capacity_depends_on_target(monkeypatch):
    too_big_for_trn2 = keep_tiles(216 // 4, 1024)  # 216 KiB
    with pytest.raises(sim.NkiCapacityError):
        too_big_for_trn2()
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    too_big_for_trn2()


def test_tiles_are_released_when_garbage_collected():
    @sim.jit
    def kernel(x):
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        for _ in nl.affine_range(50):  # 50 x 16 KiB would not fit if tiles leaked
            t = nl.ndarray((128, 4096), nl.float32)
            nisa.memset(t, 0.0)
            nisa.dma_copy(dst=out, src=t[:, 0:64])
        return out

    assert torch.equal(kernel(torch.zeros(1)), torch.zeros(128, 64))


def test_each_program_and_call_has_its_own_memory():
    usable = sim.get_target("trn2").sbuf_usable_bytes
    kernel = keep_tiles(usable // 4096, 1024)
    kernel()
    kernel()           # nothing leaked from the first call
    kernel[2, 2]()     # four programs, each a full NeuronCore


def test_fp32_storage_flag(monkeypatch):
    x = torch.randn(128, 64)

    @sim.jit
    def kernel(src):
        t = nl.ndarray((128, 64), nl.bfloat16)
        nisa.dma_copy(dst=t, src=src)
        sq = nl.ndarray((128, 64), nl.bfloat16)
        nisa.activation(dst=sq, op=nl.square, data=t)
        out = nl.ndarray((128, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sq)
        return out

    rounded = kernel(x)
    assert torch.equal(rounded, (x.bfloat16().float() ** 2).bfloat16().float())
    monkeypatch.setenv(sim.dtypes.FP32_STORAGE_ENV, "1")
    unrounded = kernel(x)
    assert torch.equal(unrounded, x * x)


def test_psum_tiles_take_whole_banks():
    keep_tiles(8, 128, nl.psum)()  # eight 512 B tiles: one bank each
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_tiles(9, 128, nl.psum)()
    assert info.value.value == 9 * 2048


# ---------------------------------------------------------------------------- tiles freed at their last use

BANK_F32 = 512  # fp32 elements of one 2 KiB PSUM bank


def _transpose_blocks(x, out, block):
    """Eight 128-row tiles of x transposed through eight PSUM banks into out; -> the banks."""
    banks = [nl.ndarray((128, 128), nl.float32, buffer=nl.psum) for _ in range(8)]
    for i in range(8):
        start = (block * 8 + i) * 128
        tile = nl.ndarray((128, 128), nl.float32)
        nisa.dma_copy(dst=tile, src=x[start:start + 128, :])
        nisa.nc_transpose(dst=banks[i], data=tile)
        staged = nl.ndarray((128, 128), nl.float32)
        nisa.tensor_copy(dst=staged, src=banks[i])
        nisa.dma_copy(dst=out[:, start:start + 128], src=staged)
    return banks


@sim.jit
def transpose_in_banks(x):
    """x.T through PSUM, eight banks per 1024 rows (a name rebound on every iteration, as production
    kernels write it), then one more PSUM tile after the loop."""
    out = nl.ndarray((128, x.shape[0]), nl.float32, buffer=nl.shared_hbm)
    for block in range(x.shape[0] // (8 * 128)):
        banks = _transpose_blocks(x, out, block)
        nisa.memset(banks[0], 0.0)
    extra = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)
    nisa.memset(extra, 0.0)
    return out


@sim.jit
def transpose_in_banks_read_after(x):
    """transpose_in_banks, but the last banks are read after the loop: all eight stay live."""
    out = nl.ndarray((128, x.shape[0]), nl.float32, buffer=nl.shared_hbm)
    for block in range(x.shape[0] // (8 * 128)):
        banks = _transpose_blocks(x, out, block)
    extra = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)
    nisa.memset(extra, 0.0)
    nisa.tensor_copy(dst=extra[:, 0:128], src=banks[0])
    return out


def test_a_tile_list_rebound_in_a_loop_is_freed_at_its_last_read():
    """Each iteration's eight banks are dead once it ends (the next iteration rebinds the name before
    reading it, nothing reads it after the loop): the compiler frees them, so the next eight and the
    tile after the loop fit. Freed only at reference drop, the second iteration needs 16 banks."""
    x = torch.randn(2 * 8 * 128, 128)
    assert torch.equal(transpose_in_banks(x), x.T)


def test_tiles_read_later_stay_live_and_overflow():
    with pytest.raises(sim.NkiCapacityError, match="live PSUM to 18432"):
        transpose_in_banks_read_after(torch.randn(8 * 128, 128))


def test_a_name_rebound_each_iteration_frees_its_big_tile():
    usable = sim.get_target("trn2").sbuf_usable_bytes
    free = usable // 4 * 3 // 4  # three quarters of SBUF: two never fit at once

    @sim.jit
    def kernel(x):
        out = nl.ndarray((128, 4), nl.float32, buffer=nl.shared_hbm)
        for i in range(3):
            big = nl.ndarray((128, free), nl.float32)
            nisa.memset(big, float(i))
            nisa.dma_copy(dst=out[:, i:i + 1], src=big[:, 0:1])
        last = nl.ndarray((128, 1), nl.float32)
        nisa.tensor_copy(dst=last, src=big[:, 0:1])  # read after the loop: the last big tile stays
        nisa.dma_copy(dst=out[:, 3:4], src=last)
        return out

    assert torch.equal(kernel(torch.zeros(1)), torch.tensor([0.0, 1.0, 2.0, 2.0]).expand(128, 4))


def _written_bank():
    bank = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)
    nisa.memset(bank, 0.0)
    return bank


def test_tiles_held_by_an_expression_being_evaluated_count_as_live():
    @sim.jit
    def kernel():
        kept = [_written_bank() for _ in range(7)]
        pair = (_written_bank(), _written_bank())  # the first waits on the stack
        nisa.memset(kept[0], 0.0)
        return pair

    with pytest.raises(sim.NkiCapacityError, match="live PSUM to 18432"):
        kernel()


_STASH = []


def test_tiles_referenced_from_outside_the_kernel_variables_stay_live():
    @sim.jit
    def kernel():
        for _ in range(9):
            bank = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)
            _STASH.append(bank)  # a module global: the kernel may read it anywhere
            nisa.memset(bank, 0.0)
        return None

    try:
        with pytest.raises(sim.NkiCapacityError, match="live PSUM to 18432"):
            kernel()
    finally:
        _STASH.clear()


def test_a_tile_a_closure_reads_later_stays_live():
    @sim.jit
    def kernel():
        first = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)
        nisa.memset(first, 1.0)

        def captured():
            return first

        others = [nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum) for _ in range(7)]
        extra = nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum)  # `first` is read below, through captured()
        for bank in others + [extra]:
            nisa.tensor_copy(dst=bank, src=captured())
        return None

    with pytest.raises(sim.NkiCapacityError, match="live PSUM to 18432"):
        kernel()


def _declared_early_written_late(dtype, read_early_after):
    """Two tiles of 60% of SBUF each: `late` is declared first but written only after `early`'s last read
    (or, with read_early_after, before it)."""
    free = sim.get_target("trn2").sbuf_usable_bytes // dtype.itemsize * 3 // 5

    def body(late, early, staged):
        nisa.memset(early, 2.0)
        nisa.tensor_copy(dst=staged, src=early[:, 0:1])
        nisa.memset(late, 3.0)

    def body_reading_early_after(late, early, staged):
        nisa.memset(early, 2.0)
        nisa.tensor_copy(dst=staged, src=early[:, 0:1])
        nisa.memset(late, 3.0)
        nisa.tensor_copy(dst=staged, src=early[:, 1:2])

    steps = body_reading_early_after if read_early_after else body

    @sim.jit
    def kernel():
        late = nl.ndarray((128, free), dtype)
        early = nl.ndarray((128, free), dtype)
        staged = nl.ndarray((128, 1), dtype)
        steps(late, early, staged)
        total = nl.ndarray((128, 1), dtype)
        nisa.tensor_tensor(dst=total, data1=late[:, 0:1], data2=staged, op=nl.add)
        out = nl.ndarray((128, 1), dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=total)
        return out

    return kernel


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16])
def test_a_tile_takes_its_bytes_at_its_first_write_not_at_its_declaration(dtype):
    """The allocator assigns an address at a tile's first write and frees it after its last read
    (nki.compiler.Allocation): `late` and `early` are never live together, so they fit."""
    out = _declared_early_written_late(dtype, read_early_after=False)()
    assert torch.equal(out.float(), torch.full((128, 1), 5.0))


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16])
def test_a_tile_written_while_another_is_still_read_overflows_at_its_first_write(dtype):
    with pytest.raises(sim.NkiCapacityError, match="at its first write"):
        _declared_early_written_late(dtype, read_early_after=True)()


_FIRST_WRITES = {
    "memset": lambda dst, src, hbm: nisa.memset(dst, 0.0),
    "iota": lambda dst, src, hbm: nisa.iota(dst=dst, pattern=[[1, 128]], offset=0, channel_multiplier=0),
    "tensor_copy": lambda dst, src, hbm: nisa.tensor_copy(dst=dst, src=src),
    "activation": lambda dst, src, hbm: nisa.activation(dst=dst, op=nl.exp, data=src),
    "tensor_tensor": lambda dst, src, hbm: nisa.tensor_tensor(dst, src, src, nl.add),
    "tensor_scalar": lambda dst, src, hbm: nisa.tensor_scalar(dst, src, nl.add, 1.0),
    "tensor_reduce": lambda dst, src, hbm: nisa.tensor_reduce(dst=dst[:, 0:1], op=nl.add, data=src, axis=1),
    "dma_copy": lambda dst, src, hbm: nisa.dma_copy(dst=dst, src=hbm),
    "register_store": lambda dst, src, hbm: nisa.register_store(dst[0:1, 0:1], nisa.register_alloc(3)),
    "nc_transpose": lambda dst, src, hbm: nisa.nc_transpose(dst=dst, data=src),
    "nc_matmul": lambda dst, src, hbm: nisa.nc_matmul(dst, src, src),
}


@pytest.mark.parametrize("instruction", sorted(_FIRST_WRITES))
def test_every_kind_of_write_takes_the_tiles_bytes(instruction):
    """With the buffer full of live tiles, a fresh tile's first write overflows, whatever instruction
    writes it (a write path that skipped tensor.place would let the kernel use bytes it has not got)."""
    into_psum = instruction in ("nc_transpose", "nc_matmul")
    usable = sim.get_target("trn2").sbuf_usable_bytes

    @sim.jit
    def kernel(x):
        src = nl.ndarray((128, 128), nl.float32)
        nisa.dma_copy(dst=src, src=x)
        if into_psum:
            kept = [nl.ndarray((128, BANK_F32), nl.float32, buffer=nl.psum) for _ in range(8)]
            dst = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        else:
            kept = [nl.ndarray((128, (usable - 512 - 256) // 4), nl.float32)]  # 256 B per partition left
            dst = nl.ndarray((128, 128), nl.float32)
        for t in kept:
            nisa.memset(t, 0.0)
        _FIRST_WRITES[instruction](dst, src, x)
        nisa.memset(kept[0][:, 0:1], 1.0)  # `kept` is used after dst's first write: all of it stays live
        return x

    with pytest.raises(sim.NkiCapacityError, match="at its first write"):
        kernel(torch.randn(128, 128))


def test_an_indirect_view_held_in_a_variable_does_not_stop_the_freeing():
    """The dataflow pass walks every variable's attributes; an indirect view has no `data` (reading
    it is an error), which the walk must see as an attribute that is not there."""
    usable = sim.get_target("trn2").sbuf_usable_bytes
    free = usable // 4 * 3 // 4

    @sim.jit
    def kernel(table, ids):
        out = nl.ndarray((128, 4), nl.float32, buffer=nl.shared_hbm)
        idx = nl.ndarray((128, 1), nl.int32)
        nisa.dma_copy(dst=idx, src=ids)
        for i in range(2):
            rows = table.ap(pattern=[[4, 128], [1, 4]], offset=0, vector_offset=idx, indirect_dim=0)
            big = nl.ndarray((128, free), nl.float32)
            nisa.memset(big, float(i))
            nisa.dma_copy(dst=out, src=rows)
        return out

    table = torch.randn(300, 4)
    ids = torch.randint(0, 300, (128, 1), dtype=torch.int32)
    assert torch.equal(kernel(table, ids), table[ids[:, 0]])


# ---------------------------------------------------------------------------- tiles of fewer partitions side by side

USABLE = sim.get_target("trn2").sbuf_usable_bytes  # 208 KiB per partition


def keep_partition_tiles(shapes, dtype=nl.float32, buffer=nl.sbuf):
    """A kernel that writes and keeps one [partitions, 16, free / 16] tile per (partitions, free), in order
    (16 rows per partition keep every access-pattern size under 65536)."""
    @sim.jit
    def kernel():
        kept = []
        for partitions, free in shapes:
            kept.append(nl.ndarray((partitions, 16, free // 16), dtype, buffer=buffer, name=f"t{len(kept)}"))
            nisa.memset(kept[-1], 0.0)
        return None

    return kernel


@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16], ids=["fp32", "bf16"])
def test_four_quadrant_tiles_of_full_size_fit_side_by_side(dtype):
    full = USABLE // dtype.itemsize
    keep_partition_tiles([(32, full)] * 4, dtype)()
    keep_partition_tiles([(20, full)] * 4, dtype)()  # a tile of < 32 partitions still takes its quadrant
    with pytest.raises(sim.NkiCapacityError) as info:
        keep_partition_tiles([(32, full)] * 5, dtype)()
    error = info.value
    assert error.value == 2 * USABLE
    assert f"t4 [32, 16, {full // 16}] {dtype.name} ({USABLE} B/partition on 32 partitions" in str(error)
    assert f"at partitions 0-31: {USABLE} B held" in str(error)
    assert f"at partitions 96-127: {USABLE} B held" in str(error)


def test_half_tiles_share_partitions_but_a_full_height_tile_needs_every_quadrant():
    full, half = USABLE // 4, USABLE // 8
    keep_partition_tiles([(64, full), (64, full)])()            # at partitions 0 and 64
    keep_partition_tiles([(64, half), (64, half), (128, half)])()
    keep_partition_tiles([(48, half)] * 4)()                    # 33-64 partitions start at 0 or 64 only
    with pytest.raises(sim.NkiCapacityError, match=r"t2 \[64, 16, \d+\] .*at partitions 0-63: .*at partitions 64-127"):
        keep_partition_tiles([(64, full), (64, full), (64, half)])()
    with pytest.raises(sim.NkiCapacityError, match=r"t3 \[128, 16, \d+\] .* on 128 partitions.*at partitions 0-127"):
        keep_partition_tiles([(64, half), (64, half), (64, half), (128, half)])()
    with pytest.raises(sim.NkiCapacityError):  # 65 partitions start at 0 only: the 32 left over cannot take it
        keep_partition_tiles([(96, full), (65, 16)])()
    keep_partition_tiles([(96, full), (32, full)])()          # but a 32-partition tile fits at partition 96


def test_a_freed_quadrant_tile_makes_room_for_another_but_not_for_a_full_height_one():
    full = USABLE // 4

    def refill(partitions):
        @sim.jit
        def kernel():
            kept = [nl.ndarray((32, full), nl.float32) for _ in range(4)]
            for t in kept:
                nisa.memset(t, 0.0)
            kept[2] = None  # its quadrant is free again
            again = nl.ndarray((partitions, 1), nl.float32, name="again")
            nisa.memset(again, 0.0)
            nisa.memset(kept[3], 1.0)  # the other three stay live until here
            return None

        return kernel

    refill(32)()
    with pytest.raises(sim.NkiCapacityError, match=r"again \[64, 1\]"):
        refill(64)()


def test_psum_quadrants_hold_eight_banks_each():
    keep_partition_tiles([(32, BANK_F32)] * 32, buffer=nl.psum)()  # 8 banks x 4 quadrants
    with pytest.raises(sim.NkiCapacityError, match=r"t32 \[32, 16, 32\] float32 \(2048 B/partition on 32 partitions"):
        keep_partition_tiles([(32, BANK_F32)] * 33, buffer=nl.psum)()
    with pytest.raises(sim.NkiCapacityError, match="live PSUM to 18432"):
        keep_partition_tiles([(32, 16)] * 4 + [(128, 16)] * 8, buffer=nl.psum)()


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_tile_collected_inside_a_trace_adds_nothing_to_its_graph(requires_grad, monkeypatch):
    """An on-chip allocation gives its storage back from __del__, so from whatever garbage collection
    runs, make_fx's included: it must dispatch no torch op there (a `detach` once became a stray
    `_tensor_constant0` node and broke make_fx). Storage in an autograd graph is not kept at all."""
    monkeypatch.setattr(sim_tensor, "_RECYCLED", {})
    storage = torch.zeros(3, 5)
    if requires_grad:
        storage = storage + torch.zeros(3, 5, requires_grad=True)
    held = [sim_tensor.Allocation(storage, pool=object())]  # has a pool, never placed: only recycled
    del storage

    def fn(x):
        held.clear()
        return x + 1

    gm = make_fx(fn)(torch.ones(2))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert len(sim_tensor._RECYCLED.get(((3, 5), torch.float32), [])) == (0 if requires_grad else 1)

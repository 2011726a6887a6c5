"""Last-use freeing (sim/liveness.py) against kernels built to break it.

Each kernel fills PSUM (8 banks of 2 KiB) with dead banks plus a bank it still reads, then writes
new banks: the allocator must free the dead ones and keep the read one. A bank freed too early
is poisoned with NaN, so a wrong free shows in the result; a bank kept too long overflows PSUM.
"""

import pytest
import torch

from neuron_inductor import sim
from neuron_inductor.sim import isa as nisa
from neuron_inductor.sim import language as nl

BANK = 512  # fp32 elements of one PSUM bank


def bank(value, dtype=nl.float32):
    t = nl.ndarray((128, BANK), dtype, buffer=nl.psum)
    nisa.memset(t, value)
    return t


def banks(count, value=0.0, dtype=nl.float32):
    return [bank(value, dtype) for _ in range(count)]


def column(t, dtype=nl.float32):
    """t[:, 0] through SBUF into a new [128, 1] HBM tensor."""
    staged = nl.ndarray((128, 1), dtype)
    nisa.tensor_copy(dst=staged, src=t[:, 0:1])
    out = nl.ndarray((128, 1), dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=staged)
    return out


def keep_in(holder, t):
    holder.append(t)


def run(kernel, dtype):
    torch_dtype = torch.float32 if dtype is nl.float32 else torch.bfloat16
    out = sim.jit(kernel)(dtype)
    return (out if isinstance(out, torch.Tensor) else torch.cat(out, 1)).to(torch_dtype).float()


DTYPES = [nl.float32, nl.bfloat16]


class Box(nl.NKIObject):
    tile: object = None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_made_before_a_loop_and_read_in_later_iterations_stays(dtype):
    def kernel(dtype):
        kept = bank(1.0, dtype)
        outs = []
        for i in range(3):
            scratch = banks(7, float(i), dtype)  # the previous iteration's seven are dead: freed
            nisa.tensor_copy(dst=scratch[0][:, 0:1], src=kept[:, 0:1])
            outs.append(column(scratch[0], dtype))
        return tuple(outs)

    assert torch.equal(run(kernel, dtype), torch.ones(128, 3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("holder", ["list", "dict", "tuple", "nkiobject", "nested"])
def test_a_tile_a_live_container_holds_stays(holder, dtype):
    def kernel(dtype):
        t = bank(1.0, dtype)
        box = {"list": lambda: [t], "dict": lambda: {"k": t}, "tuple": lambda: (0, t),
               "nkiobject": lambda: Box(tile=t), "nested": lambda: {"k": [(t,)]}}[holder]()
        t = None  # only the container holds it now
        junk = banks(7, 0.0, dtype)
        junk = banks(7, 2.0, dtype)  # the first seven are dead: freed, the held bank is not
        held = {"list": lambda: box[0], "dict": lambda: box["k"], "tuple": lambda: box[1],
                "nkiobject": lambda: box.tile, "nested": lambda: box["k"][0][0]}[holder]()
        return column(held, dtype), column(junk[6], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 2.0]).expand(128, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_view_keeps_its_tile_after_the_base_name_is_rebound(dtype):
    def kernel(dtype):
        base = bank(1.0, dtype)
        view = base[:, 0:128]
        base = bank(3.0, dtype)  # the name now holds another bank
        junk = banks(6, 0.0, dtype)
        junk = banks(6, 2.0, dtype)
        return column(view, dtype), column(base, dtype), column(junk[0], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 3.0, 2.0]).expand(128, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_returned_or_stored_through_helpers_stay(dtype):
    def kernel(dtype):
        made = bank(1.0, dtype)     # returned by a helper
        stored = []
        keep_in(stored, bank(4.0, dtype))  # stored by a helper
        junk = banks(6, 0.0, dtype)
        junk = banks(6, 2.0, dtype)
        return column(made, dtype), column(stored[0], dtype), column(junk[0], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 4.0, 2.0]).expand(128, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_del_frees_a_tile_and_an_alias_keeps_it(dtype):
    def kernel(dtype):
        gone = banks(4, 0.0, dtype)
        alias = gone[0]
        del gone        # three banks become dead; alias keeps the fourth
        more = banks(4, 2.0, dtype)  # fits only if the three are freed
        return column(alias, dtype), column(more[3], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([0.0, 2.0]).expand(128, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_comprehension_variables_and_generators_keep_their_tiles(dtype):
    def made_lazily(dtype):
        for value in (5.0, 6.0):
            yield bank(value, dtype)

    def kernel(dtype):
        junk = banks(6, 0.0, dtype)  # dead from here (never read), but still bound: only reclaim frees it
        src = banks(2, 1.0, dtype)
        # each iteration writes a new bank (reclaim runs) before it reads its own element
        copies = [nisa.tensor_copy(dst=bank(0.0, dtype)[:, 0:1], src=b[:, 0:1]) or column(b, dtype) for b in src]
        more_junk = banks(7, 0.0, dtype)
        outs = list(copies)
        for t in made_lazily(dtype): outs.append(column(bank(7.0, dtype), dtype)); outs.append(column(t, dtype))  # noqa: E702
        return tuple(outs)

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 1.0, 7.0, 5.0, 7.0, 6.0]).expand(128, 6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_statements_sharing_a_line_keep_what_the_later_one_reads(dtype):
    def combine(fresh, kept, dtype):
        return column(kept, dtype)

    def kernel(dtype):
        junk = banks(7, 0.0, dtype)  # dead from here (never read), but still bound: only reclaim frees it
        kept = bank(1.0, dtype); out = combine(bank(2.0, dtype), kept, dtype)  # noqa: E702
        return out

    assert torch.equal(run(kernel, dtype), torch.ones(128, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_call_frees_what_its_statement_passed_and_keeps_what_it_reads_after_the_call(dtype):
    def consume(t, dtype):
        """Reads t, then writes seven banks: t is dead from here on, in this frame and the caller's."""
        out = column(t, dtype)
        rest = banks(7, 3.0, dtype)
        return out, column(rest[6], dtype)

    def kernel(dtype):
        passed = bank(1.0, dtype)
        read_after = bank(4.0, dtype)
        # 1 + 7 banks fit, 2 + 7 do not: `passed` must be freed, `read_after` (read once consume returns) kept
        first, second = consume(passed, dtype), column(read_after, dtype)
        return first[0], first[1], second

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 3.0, 4.0]).expand(128, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_only_an_inner_function_or_default_argument_reads_stays(dtype):
    def kernel(dtype):
        captured = bank(1.0, dtype)
        defaulted = bank(2.0, dtype)
        read_captured = lambda: captured  # noqa: E731
        read_default = lambda t=defaulted: t  # noqa: E731
        defaulted = None
        junk = banks(5, 0.0, dtype)
        junk = banks(5, 3.0, dtype)
        return column(read_captured(), dtype), column(read_default(), dtype), column(junk[0], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([1.0, 2.0, 3.0]).expand(128, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_kept_across_break_continue_and_with_stays_and_the_dead_ones_go(dtype):
    def kernel(dtype):
        i = 0
        last = None
        with nl.no_reorder():
            while True:
                t = bank(float(i), dtype)
                junk = banks(6, 0.0, dtype)  # dead once the next iteration rebinds it, and after the loop
                if i == 2:
                    last = t
                    break
                i += 1
                continue
        more = banks(7, 3.0, dtype)  # fits only if the last junk goes and `last` stays
        return column(last, dtype), column(more[6], dtype)

    assert torch.equal(run(kernel, dtype), torch.tensor([2.0, 3.0]).expand(128, 2))


def _read_again_only_if(dtype, read_again, rounds):
    kept = bank(1.0, dtype)
    first = column(kept, dtype)
    more = banks(8, 2.0, dtype)  # all of PSUM: fits only if `kept` is dead here
    if read_again and rounds % 2 == 1:
        first = column(kept, dtype)
    return first, column(more[7], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_only_an_untaken_python_branch_reads_is_freed(dtype):
    """The traced kernel has only the branch its Python values take: with read_again False the later
    read does not exist, so `kept` is dead after its first read (a parameter, decided from the frame)."""
    out = sim.jit(_read_again_only_if)(dtype, False, 3)
    assert torch.equal(out[0].float(), torch.ones(128, 1)) and torch.equal(out[1].float(), torch.full((128, 1), 2.0))
    with pytest.raises(sim.NkiCapacityError):  # taken: `kept` is read after the eight banks, which cannot fit
        sim.jit(_read_again_only_if)(dtype, True, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_branch_on_a_value_rebound_in_a_loop_is_not_decided_early(dtype):
    def kernel(dtype):
        kept = bank(1.0, dtype)
        filler = bank(0.0, dtype)  # dead: the first reclaim frees it
        outs = []
        for i in range(2):
            late = i == 1  # bound in the loop: False now, True next round
            junk = banks(6, 0.0, dtype)
            extra = bank(0.0, dtype)  # reclaim runs here in round 0, while `late` is False
            if late:
                outs.append(column(kept, dtype))
        return outs[0]

    assert torch.equal(run(kernel, dtype), torch.ones(128, 1))

"""nki.isa instructions between the two NeuronCores of an LNC=2 kernel: core_barrier, sendrecv (see cores.py)."""

from __future__ import annotations

from . import cores as programs
from . import isa, rules

_GPSIMD_DMA_BYTES = {4: 1024, 2: 512, 1: 256}  # per partition, by element size


def _lnc_target(api):
    target = isa.context.current().target
    if target.nc_version < 3:
        rules.fail(api, "needs NeuronCore-v3+ with LNC=2", target.name, f"not available on {target.name}")


def core_barrier(data, cores, engine=isa.engine.gpsimd, name=None):
    """Every core in `cores` waits here until all of them arrive (their earlier writes to `data` are then visible)."""
    api = "nisa.core_barrier"
    participants = cores
    _lnc_target(api)
    rules.on_chip(api, "data", data, ("shared_hbm",))
    if tuple(participants) != (0, 1):
        rules.fail(api, "cores=(0, 1)", tuple(participants), f"cores={tuple(participants)}; only (0, 1) is supported")
    programs.sync(api, ("core_barrier",), participants, None)
    if isa.ACTIVE:
        isa.record(isa._engine(api, engine) or "gpsimd", "core_barrier", 0, 0, 1, 1, ())


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=isa.dma_engine.dma, name=None):
    """Send src to core `send_to_rank`'s dst while receiving core `recv_from_rank`'s src into dst."""
    api = "nisa.sendrecv"
    _lnc_target(api)
    p, n = rules.operand(api, "src", src, isa._SBUF)
    isa._check_elementwise(api, dst, ("src", src))
    rules.operand(api, "dst", dst, isa._SBUF)
    rules.same_dtype(api, "dst", dst, "src", src)
    if list(src.data.shape) != list(dst.data.shape):
        rules.fail(api, "src and dst have the same shape", (list(src.data.shape), list(dst.data.shape)),
                   f"src is {list(src.data.shape)}, dst is {list(dst.data.shape)}")
    for role, rank in (("send_to_rank", send_to_rank), ("recv_from_rank", recv_from_rank)):
        if rank not in (0, 1):
            rules.fail(api, f"{role} is 0 or 1", rank, f"{role}={rank}")
    if dma_engine is isa.dma_engine.gpsimd_dma:
        limit = _GPSIMD_DMA_BYTES[src.dtype.itemsize]
        if n * src.dtype.itemsize > limit:
            rules.fail(api, f"gpsimd_dma moves <= {limit} B per partition", n * src.dtype.itemsize,
                       f"src has {n * src.dtype.itemsize} B per partition")
    me = isa.context.current().program_id[0]
    # Both directions are one sync point: this core's payload is (what it sends, where it sends it).
    sent = programs.sync(api, ("sendrecv", pipe_id), {me, send_to_rank, recv_from_rank},
                      (src.data.clone(), send_to_rank))
    payload, target = sent[recv_from_rank]
    if target != me:
        rules.fail(api, "the sender's send_to_rank is this core", target,
                   f"core {me} receives from core {recv_from_rank}, which sends to core {target}")
    isa._copy_exact(dst, _Staged(payload, dst))
    if isa.ACTIVE:
        isa.record("dma", "sendrecv", 0, n * p * src.dtype.itemsize, n, p, (("dst", dst), ("src", src)))


class _Staged:
    """The received bytes, shaped like dst, for isa._copy_exact."""

    __slots__ = ("data", "alloc")

    def __init__(self, data, dst):
        self.data = data
        self.alloc = None

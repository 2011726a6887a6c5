"""nki.isa names the interpreter declares but does not execute, and the instruction handle.

nc_matmul_mx and quantize_mx are NeuronCore-v4 (trn3) MX instructions: MXFP8 / MXFP4 data with
32-element block scales. The interpreter has no MX arithmetic, so both raise NkiNotModelledError
naming themselves; on targets before v4 they are a rule error, as on the hardware.
"""

from __future__ import annotations

from . import rules
from .errors import NkiError, NkiNotModelledError
from .objects import NKIObject


def _mx(api):
    rules.target_version(api, api.split(".")[-1], 4)
    raise NkiNotModelledError(f"{api}: MX (microscaling) instructions of NeuronCore-v4 are not modelled by the "
                              "interpreter; run MX kernels on trn3 hardware")


def nc_matmul_mx(dst, stationary, moving, stationary_scale, moving_scale, tile_position=None, tile_size=None,
                 accumulate=None, name=None):
    """MXFP8 / MXFP4 matmul with block-scale dequantization: not modelled."""
    _mx("nisa.nc_matmul_mx")


def quantize_mx(dst, src, dst_scale, name=None):
    """FP16 / BF16 -> MXFP8 data and block scales: not modelled."""
    _mx("nisa.quantize_mx")


def get_nc_sub_version() -> int:
    """The silicon revision within the nc_version generation: the interpreter's targets are revision 0."""
    return 0


class NkiInstruction(NKIObject):
    """An opaque handle to a traced instruction; depends_on(*producers) orders it after them.

    The interpreter executes instructions in program order, so every dependency already holds;
    its instructions return None rather than a handle (a kernel chaining .depends_on on a call's
    result is not supported).
    """

    def __init__(self, handle=None):
        self.handle = handle

    def depends_on(self, *producers) -> "NkiInstruction":
        for producer in producers:
            if not isinstance(producer, NkiInstruction):
                raise NkiError(f"NkiInstruction.depends_on: producers are NkiInstruction handles, "
                               f"got {type(producer).__name__}")
        return self

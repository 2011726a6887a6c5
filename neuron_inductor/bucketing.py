"""Bucket policies: map a real dynamic size to the static size a kernel set is compiled for.

Policy specs (config option `buckets`, env NEURON_INDUCTOR_BUCKETS):
- "128" (default), or any "N": the next multiple of N;
- "64,128,512,2048": an explicit sorted list; sizes above the last entry use exact shapes;
- "128:4096": multiples of 128 up to 4096, then powers of two;
- "off": exact shapes (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx


@dataclass(frozen=True)
class BucketPolicy:
    spec: str
    multiple: int | None = None
    sizes: tuple[int, ...] = ()
    pow2_after: int | None = None

    @classmethod
    def parse(cls, spec: str) -> "BucketPolicy":
        text = spec.strip().lower().replace(" ", "")
        if text in ("off", "exact", "none"):
            return cls(spec="off")
        try:
            if ":" in text:
                step, limit = (int(part) for part in text.split(":"))
                if step <= 0 or limit < step or limit % step:
                    raise ValueError
                return cls(spec=f"{step}:{limit}", multiple=step, pow2_after=limit)
            if "," in text:
                sizes = tuple(int(part) for part in text.split(",") if part)
                if not sizes or any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
                    raise ValueError
                return cls(spec=",".join(map(str, sizes)), sizes=sizes)
            multiple = int(text)
            if multiple <= 0:
                raise ValueError
            return cls(spec=str(multiple), multiple=multiple)
        except ValueError:
            raise ValueError(
                f"bad bucket policy {spec!r}; accepted: 'N' (next multiple of N, e.g. '128'), "
                "a strictly increasing list '128,256,512', 'STEP:LIMIT' (multiples of STEP up to LIMIT, "
                "then powers of two, e.g. '128:4096'), or 'off'") from None

    @property
    def enabled(self) -> bool:
        return self.spec != "off"

    def bucket(self, size: int) -> int:
        """The static size that a real size `size` (>= 0) is padded to."""
        if size <= 0 or not self.enabled:
            return size
        if self.sizes:
            return next((s for s in self.sizes if s >= size), size)
        assert self.multiple is not None
        if self.pow2_after is not None and size > self.pow2_after:
            return 1 << (size - 1).bit_length()
        return -(-size // self.multiple) * self.multiple


def has_symbolic_shapes(example_inputs) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def specialize(gm: fx.GraphModule, args: list) -> fx.GraphModule:
    """A static copy of a symbolic ATen graph for the concrete sizes of `args` (tensors or ints).

    Re-tracing the graph on fake tensors of those sizes evaluates every SymInt expression (view
    sizes, sym_size nodes, SymInt inputs) and leaves static shapes in every node's meta["val"].
    """
    return make_fx(fx.Interpreter(gm).run, tracing_mode="fake", pre_dispatch=False)(*args)

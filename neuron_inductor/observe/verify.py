"""NEURON_INDUCTOR_VERIFY: on a bucket's first run, compare the compiled results with eager.

The reference runs the AOTAutograd graph eagerly on clones of the real (unpadded) inputs, with the
RNG state the compiled run starts from, so host-RNG fallbacks draw the same numbers. Every output
and every input the graph mutates in place is compared; the first mismatch is named with the
kernel or host step that produced it and its error. Mode 'warn' logs it, 'raise' raises VerifyError.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

log = logging.getLogger("neuron_inductor.verify")

# (rtol, atol): atol is scaled by max(1, largest |eager| value of the output), since the rounding
# of long accumulations (matmul, reductions) grows with the magnitudes involved.
TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


class VerifyError(AssertionError):
    """A compiled graph's result differs from eager beyond the tolerance (NEURON_INDUCTOR_VERIFY=raise)."""


@dataclass
class Reference:
    """Eager results for one call, computed before the compiled run (which may mutate inputs)."""

    inputs_before: list[Any]
    outputs: list[Any]
    inputs_after: list[Any]


def _clone(values: list[Any]) -> list[Any]:
    return [v.clone() if isinstance(v, torch.Tensor) else v for v in values]


def eager_reference(gm: fx.GraphModule, args: list[Any]) -> Reference:
    before = _clone(args)
    inputs = _clone(args)
    rng = torch.random.get_rng_state()
    try:
        with torch.no_grad():
            outputs = gm(*inputs)
    finally:
        torch.random.set_rng_state(rng)  # the compiled run must start from the same RNG state
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    return Reference(before, outputs, inputs)


def difference(got: Any, want: Any) -> str | None:
    """Why `got` is not close enough to `want`, or None when it is."""
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"got {got!r}, eager gives {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, eager gives a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {_describe(got)}, eager gives {_describe(want)}"
    if want.dtype not in TOLERANCES:
        wrong = (got != want).nonzero()
        return None if len(wrong) == 0 else _at(got, want, tuple(wrong[0].tolist()), f"{len(wrong)} element(s) differ")
    rtol, atol = TOLERANCES[want.dtype]
    got64, want64 = got.detach().double(), want.detach().double()  # values only: no autograd
    nan_mismatch = got64.isnan() != want64.isnan()
    if nan_mismatch.any():
        index = tuple(nan_mismatch.nonzero()[0].tolist())
        return _at(got, want, index, f"{int(nan_mismatch.sum())} element(s) are NaN in one result only")
    finite = want64.isfinite() & got64.isfinite()
    inf_mismatch = ~finite & (got64 != want64) & ~want64.isnan()
    if inf_mismatch.any():
        return _at(got, want, tuple(inf_mismatch.nonzero()[0].tolist()), "infinities differ")
    scale = max(1.0, float(want64[finite].abs().max())) if finite.any() else 1.0
    error = torch.where(finite, (got64 - want64).abs(), 0.0)
    bound = atol * scale + rtol * want64.abs()
    excess = torch.where(finite, error / bound, 0.0)
    if not (excess > 1).any():
        return None
    worst = tuple(torch.unravel_index(excess.argmax(), excess.shape)) if excess.dim() else ()
    index = tuple(int(i) for i in worst)
    return _at(got, want, index, f"{int((excess > 1).sum())} of {want.numel()} element(s) exceed the tolerance, "
                                 f"max abs error {float(error.max()):.3g} (rtol={rtol:g}, atol={atol:g} x {scale:.3g})")


def _describe(value: torch.Tensor) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"


def _at(got: torch.Tensor, want: torch.Tensor, index: tuple, what: str) -> str:
    return f"{what}; at index {list(index)} compiled {got[index].item():.6g} vs eager {want[index].item():.6g}"


def compare(reference: Reference, outputs: list[Any], inputs_after: list[Any],
            producers: dict[int, str]) -> tuple[str, str | None]:
    """(what was checked, first mismatch or None). `producers` names what computed each output."""
    for position, (got, want) in enumerate(zip(outputs, reference.outputs)):
        problem = difference(got, want)
        if problem:
            source = f", computed by {producers[position]}" if position in producers else ""
            return _checked(reference), f"output {position} ({_kind(want)}{source}): {problem}"
    if len(outputs) != len(reference.outputs):
        return _checked(reference), f"compiled graph returned {len(outputs)} outputs, eager {len(reference.outputs)}"
    for position, (before, got, want) in enumerate(zip(reference.inputs_before, inputs_after, reference.inputs_after)):
        mutated = isinstance(want, torch.Tensor) and not torch.equal(before, want)
        changed = isinstance(got, torch.Tensor) and not torch.equal(before, got)
        if mutated or changed:
            problem = difference(got, want)
            if problem:
                return _checked(reference), f"input {position} (mutated in place, {_kind(want)}): {problem}"
    return _checked(reference), None


def _kind(value: Any) -> str:
    return _describe(value) if isinstance(value, torch.Tensor) else type(value).__name__


def _checked(reference: Reference) -> str:
    return f"{len(reference.outputs)} output(s) and the in-place-mutated inputs"


def output_producers(lowered: Any, static_gm: fx.GraphModule | None) -> dict[int, str]:
    """What computed each output of a lowered graph: 'kernel k3_matmul', 'host fallback aten.i0.default',
    'a graph input' (looking through host views); empty when the program came from the cache."""
    if lowered is None or static_gm is None:
        return {}
    made_by: dict[fx.Node, str] = {}
    for spec in lowered.kernels:
        for out in spec.outputs:
            if isinstance(out, fx.Node):
                made_by[out] = f"kernel {spec.name}"
    for step in lowered.fallbacks:
        made_by[step.node] = f"host fallback {step.node.target}"
    output = next(n for n in static_gm.graph.nodes if n.op == "output")
    producers = {}
    for position, node in enumerate(output.args[0]):
        while isinstance(node, fx.Node) and node not in made_by and node.op == "call_function" and node.args:
            node = node.args[0] if isinstance(node.args[0], fx.Node) else None  # through host views
        if isinstance(node, fx.Node):
            producers[position] = made_by.get(node, "a graph input" if node.op == "placeholder" else node.name)
    return producers


def report(label: str, mode: str, checked: str, mismatch: str | None) -> dict[str, Any]:
    """Log (or raise, in 'raise' mode) the result; returns it for the report."""
    if mismatch is None:
        message = f"matches eager ({checked})"
        log.info("neuron_inductor verify: %s %s", label, message)
        return {"ok": True, "message": message}
    message = f"differs from eager: {mismatch}"
    full = f"neuron_inductor verify: {label} {message}"
    if mode == "raise":
        raise VerifyError(full)
    log.warning("%s", full)
    return {"ok": False, "message": message}

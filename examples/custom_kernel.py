"""Your own NKI kernel inside a compiled model: a fused SwiGLU and its backward, trained under
torch.compile(backend="neuron"), with its cost estimate next to what the backend generates.

    python examples/custom_kernel.py

Offline on CPU: the kernels (examples/nki_kernels/swiglu.py, written for the real NKI) run in the
NKI interpreter, and every estimate is the interpreter's Trn2 cost model.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import neuron_inductor
from neuron_inductor import nki_op, sim, wrap_nki

sys.path.insert(0, str(Path(__file__).parent))
with sim.as_nki():  # `import nki` in the kernel file resolves to the interpreter
    from nki_kernels import swiglu


@nki_op("examples::swiglu_bwd", mutates_args=())
def swiglu_bwd(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return wrap_nki(swiglu.swiglu_bwd)(gate, up, grad)


@nki_op("examples::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return wrap_nki(swiglu.swiglu_fwd)(gate, up)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(gate, up, grad)


swiglu_op.register_autograd(_backward, setup_context=_save)


class SwiGLUMLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, fused: bool = True) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        hidden = swiglu_op(gate, up) if self.fused else F.silu(gate) * up
        return x + self.down(hidden)


def estimated_us(report, kind: str, family: str | None = None, exclude: str | None = None) -> float:
    """Summed cost-model time of one graph kind's kernels (optionally of one family / all but one)."""
    return 1e6 * sum(k["estimated_seconds"] for b in report.buckets if b["graph"]["kind"] == kind
                     for k in b["kernels"] if (family is None or k["family"] == family)
                     and (exclude is None or k["family"] != exclude))


def generated_for(shape: tuple[int, int], cache_dir: str) -> tuple[float, float]:
    """Estimated time of the backend's own kernels for silu(gate) * up, forward and backward."""
    torch._dynamo.reset()
    neuron_inductor.observe.session.clear()
    gate, up = (torch.randn(shape, requires_grad=True) for _ in range(2))
    step = torch.compile(lambda g, u: F.silu(g) * u, backend="neuron", options={"cache_dir": cache_dir})
    step(gate, up).sum().backward()
    report = neuron_inductor.report()
    return estimated_us(report, "forward"), estimated_us(report, "backward")


def main() -> None:
    torch.manual_seed(0)
    cache_dir = tempfile.mkdtemp(prefix="neuron_inductor_custom_kernel_")
    model = SwiGLUMLP()
    reference = SwiGLUMLP(fused=False)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="neuron", options={"fallback": "error", "cache_dir": cache_dir})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    x, target = torch.randn(200, 64), torch.randn(200, 64)

    print("step  loss (compiled, user kernels)  loss (eager, torch ops)")
    for step in range(5):
        with sim.trace() as recorded:
            loss = F.mse_loss(compiled(x), target)
            loss.backward()
        optimizer.step(), optimizer.zero_grad()
        expected = F.mse_loss(reference(x), target)
        expected.backward()
        reference_optimizer.step(), reference_optimizer.zero_grad()
        print(f"{step:>4}  {loss.item():>28.6f}  {expected.item():>23.6f}")
    ran = sorted({i.kernel for i in recorded.instructions if i.kernel.startswith("swiglu")})
    print(f"user kernels in the last step's trace: {', '.join(ran)}")

    report = neuron_inductor.report()
    assert not report.fallbacks, report.fallbacks
    user = {kind: estimated_us(report, kind, family="user") for kind in ("forward", "backward")}
    generated = generated_for((200, 256), cache_dir)
    print("\nsilu(gate) * up on [200, 256] fp32, estimated Trn2 time (cost model):")
    print(f"  forward:  user kernel swiglu_fwd {user['forward']:6.2f} us | backend's generated kernels "
          f"{generated[0]:6.2f} us")
    print(f"  backward: user kernel swiglu_bwd {user['backward']:6.2f} us | backend's generated kernels "
          f"{generated[1]:6.2f} us")


if __name__ == "__main__":
    main()

"""Per-kernel LNC=1 / LNC=2 estimates of one model step's kernels, without running the whole step.

    python bench/lnc_kernels.py [--config d2048] [--families pointwise,copy,reduction] [--json out.json]

The step's forward and backward ATen graphs are captured as the backend gets them (the same
Dynamo-graph passes, decompositions and partitioner as backend.py; the graphs run eagerly), lowered
by the backend's own `compile_static_graph` for a logical core of 1 and of 2 physical cores, and
every kernel of the chosen families runs in the NKI interpreter on the graph's real values at both
LNCs. The table lists each launch's cost-model estimate and the ratio LNC2 / LNC1 (the launch at
LNC=2 takes its slowest core, sim/cost_model.py), and the per-family sums.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import defaultdict

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from neuron_inductor import sim
from neuron_inductor.codegen.kernel_args import kernel_argument
from neuron_inductor.compiler import compile_static_graph
from neuron_inductor.decompositions import neuron_decompositions
from neuron_inductor.passes.gqa_attention import fuse_gqa_attention
from neuron_inductor.passes.lm_head_loss import fuse_lm_head_loss

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from step import CONFIGS, build  # noqa: E402

TARGET = "trn2"


def capture(config) -> list[tuple[str, fx.GraphModule, list]]:
    """(kind, graph, real inputs) of the step's forward and backward graphs."""
    graphs = []

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            captured = copy.deepcopy(gm)

            def run(*args):
                graphs.append((kind, captured, [a.detach().clone() if isinstance(a, torch.Tensor) else a
                                                for a in args]))
                return gm(*args)
            return make_boxed_func(run)
        return compile_graph

    def backend(gm, example_inputs):
        fuse_lm_head_loss(gm)
        fuse_gqa_attention(gm)
        return aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"),
                            decompositions=neuron_decompositions(),
                            partition_fn=min_cut_rematerialization_partition,
                            keep_inference_input_mutations=True)(gm, example_inputs)

    torch._dynamo.reset()
    model, args = build(config)
    torch.compile(model, backend=backend)(*args).backward()
    return graphs


def _as_kernels_write(value):
    """A value as a kernel (or host fallback) leaves it: contiguous (eager CPU ops may return other
    strides, e.g. SDPA's gradients); views of it then take their strides from that layout, as the
    host wrapper's do."""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(_as_kernels_write(v) for v in value)
    return value


def values_of(gm: fx.GraphModule, args: list) -> dict:
    env = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if node.op == "call_function" and not getattr(node.target, "is_view", False):
                value = _as_kernels_write(value)
            env[node] = value
            return value

    with torch.no_grad():
        Recorder(gm).run(*args)
    return env


def estimate(spec, source, values) -> float:
    kernel = sim.load_kernels(source, f"<{spec.name}>")[spec.name]
    kernel = sim.Kernel(kernel.func, (spec.grid,), TARGET)
    args = [kernel_argument(values[n]) for n in spec.inputs]
    if spec.output_argument:
        out = spec.outputs[0]
        args.append(torch.empty_like(kernel_argument(values[out])))
    with torch.no_grad(), sim.trace() as recorded:
        kernel(*args)
    return recorded.estimate(TARGET)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="d2048")
    parser.add_argument("--families", default="pointwise,copy,reduction")
    parser.add_argument("--only", help="comma-separated kernel names (e.g. backward:k15_pointwise)")
    parser.add_argument("--json")
    a = parser.parse_args(argv)
    families = set(a.families.split(","))
    only = set(a.only.split(",")) if a.only else None
    rows = []
    for kind, gm, args in capture(CONFIGS[a.config]):
        graphs = {lnc: copy.deepcopy(gm) for lnc in (1, 2)}  # each lowering rewrites its own copy
        lowered = {lnc: compile_static_graph(graphs[lnc], "allow", TARGET, lnc=lnc) for lnc in (1, 2)}
        specs = {lnc: lowered[lnc][1].kernels for lnc in (1, 2)}
        assert [s.family for s in specs[1]] == [s.family for s in specs[2]], kind
        chosen = [(f"{kind}:{one.name}", one, two) for one, two in zip(specs[1], specs[2])
                  if one.family in families and (only is None or f"{kind}:{one.name}" in only)]
        if not chosen:
            continue
        for lnc in (1, 2):
            env = values_of(graphs[lnc], args)
            sources = lowered[lnc][0].kernel_sources
            for name, one, two in chosen:
                spec = one if lnc == 1 else two
                est = estimate(spec, sources[spec.name], env)
                row = next((r for r in rows if r["name"] == name), None)
                if row is None:
                    row = {"name": name, "family": one.family,
                           "ops": sorted({str(o.target) for o in one.outputs if isinstance(o, fx.Node)}),
                           "outputs": [list(map(int, (o.meta["val"] if isinstance(o, fx.Node) else o).shape))
                                       for o in one.outputs]}
                    rows.append(row)
                row[f"lnc{lnc}"] = est.total_seconds
                row[f"grid{lnc}"] = spec.grid
                row[f"engines{lnc}"] = {k: v for k, v in est.engine_seconds.items() if v}
            del env
    by_family = defaultdict(lambda: [0, 0.0, 0.0])
    print(f"{'kernel':<28} {'ops':<40} {'output':<22} {'LNC1 us':>9} {'LNC2 us':>9} {'ratio':>6} grid")
    for r in rows:
        f = by_family[r["family"]]
        f[0] += 1
        f[1] += r["lnc1"]
        f[2] += r["lnc2"]
        print(f"{r['name']:<28} {','.join(o.replace('aten.', '') for o in r['ops'])[:40]:<40} "
              f"{str(r['outputs'][0]):<22} {r['lnc1'] * 1e6:>9.1f} {r['lnc2'] * 1e6:>9.1f} "
              f"{r['lnc2'] / r['lnc1']:>6.2f} {r['grid2']}")
    for family, (n, one, two) in sorted(by_family.items()):
        print(f"family {family}: {n} launches, LNC1 {one * 1e3:.3f} ms, LNC2 {two * 1e3:.3f} ms, ratio {two / one:.2f}")
    if a.json:
        with open(a.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

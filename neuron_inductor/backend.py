"""The Dynamo entry point: `torch.compile(model, backend="neuron")`.

`neuron_backend` is a module-level singleton (Dynamo guards on backend identity, so a fresh
object per call would recompile every frame). It validates `options=`, fuses LM heads with their
cross-entropy (passes/lm_head_loss.py, unless `fuse_lm_head_loss` is off) and turns repeated key / value
heads into SDPA's own GQA (passes/gqa_attention.py), then hands the graph to
AOTAutograd with the Neuron decomposition table, the min-cut partitioner and one `GraphRunner`
per forward / backward / inference graph.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from . import config as config_module
from . import observe
from .bucketing import pin_generator_states
from .decompositions import neuron_decompositions
from .passes.gqa_attention import fuse_gqa_attention
from .passes.lm_head_loss import fuse_lm_head_loss
from .runtime import GraphRunner

log = logging.getLogger("neuron_inductor")

# torch.compile modes; none changes what we generate yet, but an unknown one is an error.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _make_compiler(cfg: config_module.NeuronConfig, kind: str) -> Callable:
    def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Callable:
        runner = GraphRunner(gm, pin_generator_states(gm, example_inputs), cfg, kind)
        runner._boxed_call = True  # AOTAutograd calls boxed compilers with a list it lets us clear
        return runner

    return compile_graph


class NeuronBackend:
    """Callable Dynamo backend; accepts the `mode=` and `options=` torch.compile forwards."""

    __name__ = "neuron"

    def __call__(self, gm: fx.GraphModule, example_inputs: list, *, mode: str | None = None,
                 options: dict[str, Any] | None = None, **unknown: Any) -> Callable:
        if unknown:
            raise config_module.ConfigError(
                f"backend 'neuron' got unexpected argument(s) {sorted(unknown)}; it accepts mode= and options=")
        if mode is not None and mode not in MODES:
            raise config_module.ConfigError(f"mode={mode!r} is not valid; accepted values: {', '.join(MODES)}")
        cfg = config_module.resolve(options)
        observe.on_dynamo_graph(gm, example_inputs, cfg)
        if cfg.fuse_lm_head_loss:
            fuse_lm_head_loss(gm)
        fuse_gqa_attention(gm)
        return aot_autograd(
            fw_compiler=_make_compiler(cfg, "forward"),
            bw_compiler=_make_compiler(cfg, "backward"),
            inference_compiler=_make_compiler(cfg, "inference"),
            decompositions=neuron_decompositions(),
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)


neuron_backend = NeuronBackend()


def _warn_if_name_is_shared() -> None:
    """AWS torch-neuronx also registers `neuron`; Dynamo takes whichever entry point it finds first."""
    from importlib.metadata import entry_points

    others = sorted({ep.value for ep in entry_points(group="torch_dynamo_backends", name="neuron")
                     if not ep.value.startswith(__name__ + ":")})
    if others:
        warnings.warn(
            f"another installed package also provides the torch.compile backend 'neuron' ({', '.join(others)}); "
            "which one backend='neuron' runs depends on install order. Use backend='neuron_inductor' to always "
            "run neuron_inductor.", stacklevel=2)


_warn_if_name_is_shared()

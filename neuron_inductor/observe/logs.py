"""The `neuron_inductor` logger, registered with `torch._logging`.

`TORCH_LOGS="+neuron_inductor"` (DEBUG) or `TORCH_LOGS="neuron_inductor"` (INFO) turns it on, as does
`torch._logging.set_logs(modules={"neuron_inductor": logging.DEBUG})`; records then carry torch's
format (level, time, file, Dynamo compile id) and follow TORCH_LOGS_OUT. What goes where:
- DEBUG: per-stage timings of every compile (trace, decompose, bucket, lower, render, compile);
- INFO:  one line per compiled graph bucket, cache hits and misses with their reasons, a frame's
         first recompile (usually Dynamo switching to dynamic shapes);
- WARNING: fallbacks (see runtime), further recompiles of a frame, verify mismatches.
Every module of the package logs to this logger or a child of it.
"""

from __future__ import annotations

import logging

import torch._logging

LOGGER_NAME = "neuron_inductor"
log = logging.getLogger(LOGGER_NAME)

# Stages in pipeline order, so every timing line reads the same way.
STAGES = ("trace", "decompose", "bucket", "lower", "render", "compile", "first_run")


def register_with_torch_logging() -> None:
    """Make `neuron_inductor` a named log of torch._logging (idempotent).

    TORCH_LOGS is parsed when torch is imported, before this package is: it accepts the name then
    because torch takes any importable module name (and imports the package's subpackages to do so).
    Registering makes the name one of torch's logs for later `set_logs` calls.
    """
    registry = torch._logging._internal.log_registry
    if not registry.is_log(LOGGER_NAME):
        torch._logging._internal.register_log(LOGGER_NAME, LOGGER_NAME)


def format_timings(timings: dict[str, float]) -> str:
    """'trace 0.210s, lower 0.004s, ...' in pipeline order (unknown stages last, sorted)."""
    ordered = [s for s in STAGES if s in timings] + sorted(set(timings) - set(STAGES))
    return ", ".join(f"{stage} {timings[stage]:.3f}s" for stage in ordered)


def log_stage_timings(what: str, timings: dict[str, float]) -> None:
    if timings:
        log.debug("neuron_inductor: %s stage timings: %s", what, format_timings(timings))

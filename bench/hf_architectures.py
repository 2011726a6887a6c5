"""Architecture coverage: tiny random-initialised Hugging Face causal LMs, forward and backward under
`torch.compile(backend="neuron")`, compared with eager PyTorch.

    python bench/hf_architectures.py                  # every architecture; table to stdout and hf_architectures.md
    python bench/hf_architectures.py --arch llama     # one (repeatable: --arch llama --arch gpt2)

Each architecture gets a shrunk config (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512, 4 experts of
which 2 per token, sliding windows of 16, no dropout), fp32 weights from a fixed seed, SDPA attention where
the architecture has it (else its eager attention), mixture-of-experts layers as batched matmuls
(`experts_implementation="batched_mm"`), and one training step (batch 2 x 32 tokens, labels = inputs):
loss + logits (forward) and every parameter's gradient (backward). Each runs in its own process with a
time limit, so one crash or hang costs one row.

Columns:
- fwd / bwd: the compiled fp32 step against the same step run eagerly in float64, over the loss and logits
  (fwd) and every parameter's gradient (bwd). A tensor's error is its largest difference over its largest
  magnitude (at least 1e-6); it passes at most max(1e-4, 10 x the error of the eager fp32 step itself):
  fp32 gives tensors that are small differences of large terms (a cancelling gradient) errors far above
  1e-4 in eager too, and a kernel that sums in another order cannot do better. "max err" is the compiled
  step's largest error, "eager err" eager fp32's.
- NKI FLOPs: matmul-class FLOPs (torch.utils.flop_counter formulas: mm / bmm / addmm / SDPA / grouped_mm ...)
  of the compiled graphs' nodes minus those of host-fallback nodes, over the same count of the eager step
  (FlopCounterMode, forward + backward). Both sides count SDPA in full, so the flash kernels' skipping of
  causally masked tiles does not distort the share; FLOPs Dynamo leaves to eager at graph breaks are in the
  denominator only.
- fallbacks: ATen ops that ran eagerly on the host inside compiled graphs (count); graph breaks: Dynamo's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, conv_backward_flop, flop_registry, shape_wrapper  # noqa: E402

BATCH, SEQ_LEN, VOCAB = 2, 32, 512
REL_TOLERANCE = 1e-4
NOISE_FACTOR = 10
SCALE_FLOOR = 1e-6
TIME_LIMIT_SECONDS = 900
TABLE_FILE = Path(__file__).with_suffix(".md")
# Mixture-of-experts layers gather each token's expert weights and run one batched matmul: static shapes.
# (transformers' default on CPU, "grouped_mm", is an opaque custom op with data-dependent splits that can
# only run on the host.)
EXPERTS_IMPLEMENTATION = "batched_mm"

# The list: the coverage goal (>= 90% passing, median NKI FLOP share >= 95%) is over these.
LISTED = (
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neo", "gpt_neox", "gptj", "falcon", "bloom", "opt", "olmo", "olmo2", "starcoder2",
    "cohere", "granite", "stablelm", "deepseek_v3", "gpt_oss", "smollm3", "glm4", "mamba",
)
MORE = (
    "codegen", "gpt_bigcode", "mpt", "persimmon", "biogpt", "xglm", "helium", "glm", "nemotron", "ministral",
    "cohere2", "exaone4", "granitemoe", "olmoe", "phimoe", "dbrx", "mamba2", "falcon_mamba", "jamba",
    "recurrent_gemma", "qwen3_next", "internlm3",
)

# Common shrink, by the standard attribute names (configs map them through `attribute_map`).
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
    "sliding_window": 16,
    # mixture of experts
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "n_shared_experts": 1,
    # state-space models
    "state_size": 8, "time_step_rank": 8, "conv_kernel": 4, "expand": 2,
    # token ids inside the shrunk vocabulary
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
# Architecture-specific fields, on top of COMMON.
OVERRIDES: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gptj": {"rotary_dim": 8, "n_inner": 128},
    "gpt2": {"n_inner": 128},
    "gpt_bigcode": {"n_inner": 128},
    "codegen": {"rotary_dim": 8, "n_inner": 128},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2, "ffn_hidden_size": 128},
    "bloom": {"n_head": 4},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "phi": {"partial_rotary_factor": 0.5},
    "stablelm": {"partial_rotary_factor": 0.25},
    "persimmon": {"partial_rotary_factor": 0.5},
    "deepseek_v3": {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                    "num_key_value_heads": 4},  # multi-head latent attention: as many KV heads as heads
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 256},
    "xglm": {"ffn_dim": 128},
    "biogpt": {"intermediate_size": 128},
    "recurrent_gemma": {"lru_width": 64, "attention_window_size": 16, "block_types": ["recurrent", "attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_d_state": 8, "mamba_dt_rank": 8, "mamba_d_conv": 4, "mamba_expand": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1, "chunk_size": 16},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "layer_types": ["linear_attention", "full_attention"]},
}
# Layer patterns for configs with `layer_types`: one local and one global layer where the family has both.
LAYER_TYPES = {
    "gemma2": ["sliding_attention", "full_attention"],
    "gemma3_text": ["sliding_attention", "full_attention"],
    "cohere2": ["sliding_attention", "full_attention"],
    "exaone4": ["sliding_attention", "full_attention"],
    "gpt_oss": ["sliding_attention", "full_attention"],
}


def _fields(config_class) -> set[str]:
    return {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()


def tiny_config(model_type: str):
    """The shrunk config of one architecture: COMMON and OVERRIDES for the fields it has, dropout off."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    fields = _fields(config_class)
    mapped = dict(config_class.attribute_map)
    wanted = {**COMMON, **OVERRIDES.get(model_type, {})}
    if model_type in LAYER_TYPES:
        wanted["layer_types"] = LAYER_TYPES[model_type]
    kwargs = {}
    for name, value in wanted.items():
        field_name = name if name in fields else mapped.get(name, name)
        if field_name in fields and field_name not in kwargs:
            kwargs[field_name] = value
    for name in fields:
        if "dropout" in name or "pdrop" in name:
            default = getattr(config_class, name, None)
            if isinstance(default, float) or default is None:
                kwargs[name] = 0.0
    return AutoConfig.for_model(model_type, **kwargs)


def build_model(model_type: str):
    """The tiny model in training mode: SDPA attention where the architecture has it, else its eager one."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)

    def build(attention: str):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                experts_implementation=EXPERTS_IMPLEMENTATION)

    try:
        model = build("sdpa")
    except (ValueError, ImportError):  # "does not support an attention implementation through SDPA"
        model = build("eager")
    return model.float().train()


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference over the reference's largest magnitude, floored at SCALE_FLOOR: a gradient that
    is zero in exact arithmetic (e.g. a key bias, which softmax cancels) is rounding noise on both sides."""
    if not reference.numel():
        return 0.0
    diff = (value.double() - reference.double()).abs().max().item()
    return diff / max(reference.abs().max().item(), SCALE_FLOOR)


def _errors(compiled: dict, eager: dict, reference: dict) -> tuple[float, float, bool]:
    """Largest relative errors of the compiled step and of the eager fp32 step against `reference`, and
    whether every compiled tensor is within max(REL_TOLERANCE, NOISE_FACTOR x eager fp32's own error)."""
    worst_compiled = worst_eager = 0.0
    within = set(compiled) == set(reference)
    for name, exact in reference.items():
        if name not in compiled:
            continue
        compiled_err, eager_err = _relative_error(compiled[name], exact), _relative_error(eager[name], exact)
        worst_compiled, worst_eager = max(worst_compiled, compiled_err), max(worst_eager, eager_err)
        within &= compiled_err <= max(REL_TOLERANCE, NOISE_FACTOR * eager_err)
    return worst_compiled, worst_eager, within


def _float64_step(model, input_ids: torch.Tensor):
    """The eager step in float64 (the reference), or None where the architecture cannot run in float64."""
    try:
        return _step(copy.deepcopy(model).double(), input_ids)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _step(model, input_ids: torch.Tensor, call=None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One forward (through `call`, default the model itself) + backward: (forward outputs, gradients)."""
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(input_ids=input_ids, labels=input_ids, use_cache=False)
    out.loss.backward()
    forward = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return forward, grads


def _grouped_mm_flops(input_shape, weight_shape, offs_shape, *_, **__) -> int:
    return 2 * input_shape[0] * weight_shape[1] * weight_shape[2]


def _grouped_mm_backward_flops(input_shape, weight_shape, offs_shape, grad_shape, *_, **__) -> int:
    return 2 * _grouped_mm_flops(input_shape, weight_shape, offs_shape)


def _convolution_backward_flops(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                                output_padding, groups, output_mask, out_shape, **kwargs) -> int:
    """torch's formula, except that the weight gradient of a grouped convolution (Mamba's depthwise causal
    conv) counts 1/groups of a dense one: torch counts it dense, `groups` times too many FLOPs."""
    dense = conv_backward_flop.__wrapped__  # the formula on shapes, as registered by torch
    fixed = (grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed, output_padding, groups)
    grad_input = dense(*fixed, [output_mask[0], False], out_shape, **kwargs)
    grad_weight = dense(*fixed, [False, output_mask[1]], out_shape, **kwargs)
    return grad_input + grad_weight // groups


def custom_formulas() -> dict:
    """FLOP formulas (on shapes) FlopCounterMode lacks or gets wrong: transformers' grouped-matmul custom ops
    (opaque to it) and the grouped-convolution backward."""
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.*)

    ops = torch.ops.transformers
    return {ops.grouped_mm_fallback: _grouped_mm_flops, ops.grouped_mm_fallback_backward: _grouped_mm_backward_flops,
            torch.ops.aten.convolution_backward: _convolution_backward_flops}


def matmul_formulas() -> dict:
    """torch's FLOP formulas plus `custom_formulas()`, all taking tensors like FlopCounterMode's registry."""
    import neuron_inductor.lowering.lm_head_loss  # noqa: F401  (registers the fused loss's formulas)

    return {**flop_registry, **{packet: shape_wrapper(formula) for packet, formula in custom_formulas().items()}}


def _node_flops(node, formulas: dict) -> int:
    """Matmul-class FLOPs of one ATen node (0 for ops without a formula)."""
    formula = formulas.get(getattr(node.target, "overloadpacket", None))
    if formula is None:
        return 0
    value = lambda arg: arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg  # noqa: E731
    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    return int(formula(*args, out_val=node.meta.get("val"), **kwargs))


def _graph_flops(formulas: dict) -> tuple[int, int, list[tuple[str, str]]]:
    """Matmul-class FLOPs of the ATen graphs compiled so far, those of their host-fallback nodes, and the
    (op, reason) of every fallback node. Fallbacks are recorded by op name: an op's FLOPs count as
    host FLOPs in the proportion of its nodes that fell back (all or none in practice)."""
    from neuron_inductor.lowering.graph import op_name
    from neuron_inductor.observe import session

    graph_flops = fallback_flops = 0
    fallbacks: list[tuple[str, str]] = []
    for graph, aot in list(session.AOT_GRAPHS.items()):
        flops_by_op, nodes_by_op = Counter(), Counter()
        for node in graph.gm.graph.nodes:
            if node.op == "call_function":
                flops_by_op[op_name(node)] += _node_flops(node, formulas)
                nodes_by_op[op_name(node)] += 1
        graph_flops += sum(flops_by_op.values())
        for bucket in aot.buckets:
            fallbacks += [(f["op"], " ".join(f["reason"].split())) for f in bucket.artifact.meta["fallbacks"]]
            fell_back = Counter(f["op"] for f in bucket.artifact.meta["fallbacks"])
            fallback_flops += sum(flops_by_op[op] * n // nodes_by_op[op] for op, n in fell_back.items())
    return graph_flops, fallback_flops, fallbacks


def _graph_breaks() -> Counter:
    """Dynamo's graph-break reasons in this process (first line of each) with their counts."""
    from torch._dynamo.utils import counters

    breaks = Counter()
    for reason, count in counters["graph_break"].items():
        breaks[reason.strip().splitlines()[0]] += count
    return breaks


def run_architecture(model_type: str) -> dict:
    """Eager and compiled training step of one architecture: the row of the table, as a dict."""
    row = {"arch": model_type, "fwd": "fail", "bwd": "fail", "max_err": None, "nki_share": None,
           "fallbacks": {}, "graph_breaks": 0, "note": ""}
    model = build_model(model_type)
    row["params"] = sum(p.numel() for p in model.parameters())
    compiled_model = copy.deepcopy(model)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))

    formulas = matmul_formulas()
    exact = _float64_step(model, input_ids)
    with FlopCounterMode(display=False, custom_mapping=custom_formulas()) as counter:
        eager_forward, eager_grads = _step(model, input_ids)
    eager_flops = counter.get_total_flops()
    if exact is None:
        exact = (eager_forward, eager_grads)
        row["note"] = "no float64 reference: compared with eager fp32"

    torch._dynamo.reset()
    start = time.perf_counter()
    forward, grads = _step(compiled_model, input_ids, torch.compile(compiled_model, backend="neuron"))
    row["seconds"] = round(time.perf_counter() - start, 1)

    forward_err, eager_forward_err, forward_ok = _errors(forward, eager_forward, exact[0])
    backward_err, eager_backward_err, backward_ok = _errors(grads, eager_grads, exact[1])
    row["fwd"], row["bwd"] = ("pass" if forward_ok else "fail"), ("pass" if backward_ok else "fail")
    row["max_err"] = max(forward_err, backward_err)
    row["eager_err"] = max(eager_forward_err, eager_backward_err)
    missing = sorted(set(grads) ^ set(exact[1]))
    if missing:
        row["note"] = f"gradients missing or extra: {', '.join(missing[:3])}"

    graph_flops, fallback_flops, fallbacks = _graph_flops(formulas)
    row["eager_flops"], row["graph_flops"], row["fallback_flops"] = eager_flops, graph_flops, fallback_flops
    row["nki_share"] = (graph_flops - fallback_flops) / eager_flops if eager_flops else None
    row["fallbacks"] = dict(Counter(op for op, _ in fallbacks))
    row["fallback_reasons"] = sorted({f"{op}: {reason}" for op, reason in fallbacks})
    breaks = _graph_breaks()
    row["graph_breaks"] = sum(breaks.values())
    if breaks:
        row["note"] = "; ".join(filter(None, [row["note"], "graph breaks: " + "; ".join(sorted(breaks))]))
    return row


# -- the table ------------------------------------------------------------------------------------

def _run_in_subprocess(model_type: str) -> dict:
    command = [sys.executable, __file__, "--arch", model_type, "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIME_LIMIT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"arch": model_type, "fwd": "timeout", "bwd": "timeout", "note": f"over {TIME_LIMIT_SECONDS} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"arch": model_type, "fwd": "error", "bwd": "error", "note": error[:200]}


def _row_error(model_type: str, exc: BaseException) -> dict:
    message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line: it goes into a table cell
    return {"arch": model_type, "fwd": "error", "bwd": "error", "note": message[:300]}


def _format_share(share) -> str:
    return "" if share is None else f"{100 * share:.1f}%"


def _format_fallbacks(fallbacks: dict) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} x{n}" for op, n in sorted(fallbacks.items())) or "-"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| arch | listed | fwd | bwd | max err | eager err | NKI FLOPs | fallback ops (host, in compiled graphs) "
             "| graph breaks | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        err, eager_err = ("" if row.get(key) is None else f"{row[key]:.1e}" for key in ("max_err", "eager_err"))
        lines.append(
            f"| {row['arch']} | {'yes' if row['arch'] in LISTED else ''} | {row['fwd']} | {row['bwd']} | {err} | "
            f"{eager_err} | "
            f"{_format_share(row.get('nki_share'))} | {_format_fallbacks(row.get('fallbacks', {}))} | "
            f"{row.get('graph_breaks', '')} | {row.get('note', '').replace('|', '/')} |")
    return "\n".join(lines)


def fallback_reasons_table(rows: list[dict]) -> str:
    """Every distinct host-fallback reason and the architectures it occurs in."""
    archs_by_reason: dict[str, list[str]] = {}
    for row in rows:
        for reason in row.get("fallback_reasons", []):
            archs_by_reason.setdefault(reason, []).append(row["arch"])
    lines = ["| fallback (op: reason) | architectures |", "|---|---|"]
    for reason, archs in sorted(archs_by_reason.items()):
        lines.append(f"| {reason.replace('|', '/')} | {', '.join(archs)} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    listed = [r for r in rows if r["arch"] in LISTED]
    passing = [r for r in listed if r["fwd"] == "pass" and r["bwd"] == "pass"]
    shares = [r["nki_share"] for r in listed if r.get("nki_share") is not None]
    median = _format_share(statistics.median(shares)) if shares else "n/a"
    return (f"Listed architectures passing forward and backward: {len(passing)}/{len(listed)} "
            f"({100 * len(passing) / max(len(listed), 1):.0f}%); median NKI FLOP share over them: {median}. "
            f"All architectures: {sum(r['fwd'] == r['bwd'] == 'pass' for r in rows)}/{len(rows)} passing.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="model_type to run (repeatable); default: all")
    parser.add_argument("--json", action="store_true", help="run in this process and print the row as JSON")
    args = parser.parse_args(argv)
    if args.json:
        (model_type,) = args.arch
        try:
            row = run_architecture(model_type)
        except Exception as exc:  # the row says what broke; the table goes on
            row = _row_error(model_type, exc)
        print(json.dumps(row))
        return
    architectures = args.arch or [*LISTED, *MORE]
    rows = []
    for model_type in architectures:
        row = _run_in_subprocess(model_type)
        rows.append(row)
        print(f"{model_type}: fwd {row['fwd']}, bwd {row['bwd']}, NKI FLOPs {_format_share(row.get('nki_share'))}, "
              f"{row.get('seconds', '?')} s {row.get('note', '')}", flush=True)
    table = markdown_table(rows)
    print(table)
    print(summary(rows))
    if not args.arch:
        method = __doc__.split("\n\n", 1)[1].rstrip()  # keeps the usage lines' code-block indent
        TABLE_FILE.write_text(f"# Hugging Face architecture coverage\n\n{method}\n\n{table}\n\n{summary(rows)}\n\n"
                              f"## Host fallbacks by reason\n\n{fallback_reasons_table(rows)}\n")


if __name__ == "__main__":
    main()

"""Architecture coverage: tiny random-initialised Hugging Face causal LMs, forward and backward under
`torch.compile(backend="neuron")`, compared with eager PyTorch.

    python bench/hf_architectures.py                  # every architecture; table to stdout and hf_architectures.md
    python bench/hf_architectures.py --arch llama     # one (repeatable: --arch llama --arch gpt2)

Each architecture gets a shrunk config (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 512, 4 experts of
which 2 per token, sliding windows of 16, no dropout), fp32 weights from a fixed seed and one training step
(batch 2 x 32 tokens, labels = inputs): loss + logits (forward) and every parameter's gradient (backward).
Each runs in its own process with a time limit, so one crash or hang costs one row.

Columns:
- fwd / bwd: pass when the largest error, relative to the largest magnitude of the eager tensor, is at most
  REL_TOLERANCE (fp32 everywhere; kernels accumulate in fp32) -- checked over the loss and logits (fwd) and
  over every gradient (bwd). "max err" is the larger of the two.
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
import io
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
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper  # noqa: E402

BATCH, SEQ_LEN, VOCAB = 2, 32, 512
REL_TOLERANCE = 1e-4
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
                    "v_head_dim": 16, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
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
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    for attention in ("sdpa", "eager"):  # eager where the architecture has no SDPA path
        torch.manual_seed(0)
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                     experts_implementation=EXPERTS_IMPLEMENTATION)
            break
        except (ValueError, ImportError):
            continue
    return model.float().train()


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item() if reference.numel() else 0.0
    diff = (value.float() - reference.float()).abs().max().item() if reference.numel() else 0.0
    return diff / scale if scale > 0 else diff


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


def custom_formulas() -> dict:
    """FLOP formulas (on shapes) of transformers' grouped-matmul custom ops, which FlopCounterMode cannot see into."""
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.*)

    ops = torch.ops.transformers
    return {ops.grouped_mm_fallback: _grouped_mm_flops, ops.grouped_mm_fallback_backward: _grouped_mm_backward_flops}


def matmul_formulas() -> dict:
    """torch's FLOP formulas plus `custom_formulas()`, all taking tensors like FlopCounterMode's registry."""
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


def _graph_flops(formulas: dict) -> tuple[int, int, list[str]]:
    """Matmul-class FLOPs of the ATen graphs compiled so far, those of their host-fallback nodes, and the
    fallback op names (one per fallback node). Fallbacks are recorded by op name: an op's FLOPs count as
    host FLOPs in the proportion of its nodes that fell back (all or none in practice)."""
    from neuron_inductor.lowering.graph import op_name
    from neuron_inductor.observe import session

    graph_flops = fallback_flops = 0
    fallback_ops: list[str] = []
    for runner, aot in list(session.AOT_GRAPHS.items()):
        flops_by_op, nodes_by_op = Counter(), Counter()
        for node in runner.gm.graph.nodes:
            if node.op == "call_function":
                flops_by_op[op_name(node)] += _node_flops(node, formulas)
                nodes_by_op[op_name(node)] += 1
        graph_flops += sum(flops_by_op.values())
        for bucket in aot.buckets:
            fell_back = Counter(f["op"] for f in bucket.artifact.meta["fallbacks"])
            fallback_ops += fell_back.elements()
            fallback_flops += sum(flops_by_op[op] * n // nodes_by_op[op] for op, n in fell_back.items())
    return graph_flops, fallback_flops, fallback_ops


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def run_architecture(model_type: str) -> dict:
    """Eager and compiled training step of one architecture: the row of the table, as a dict."""
    import neuron_inductor  # noqa: F401  (registers the observe hooks the FLOP count reads)

    row = {"arch": model_type, "fwd": "fail", "bwd": "fail", "max_err": None, "nki_share": None,
           "fallbacks": {}, "graph_breaks": 0, "note": ""}
    model = build_model(model_type)
    row["params"] = sum(p.numel() for p in model.parameters())
    compiled_model = copy.deepcopy(model)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))

    formulas = matmul_formulas()
    with FlopCounterMode(display=False, custom_mapping=custom_formulas()) as counter:
        ref_forward, ref_grads = _step(model, input_ids)
    eager_flops = counter.get_total_flops()

    torch._dynamo.reset()
    start = time.perf_counter()
    forward, grads = _step(compiled_model, input_ids, torch.compile(compiled_model, backend="neuron"))
    row["seconds"] = round(time.perf_counter() - start, 1)

    forward_err = max(_relative_error(forward[k], ref_forward[k]) for k in ref_forward)
    missing = sorted(set(ref_grads) ^ set(grads))
    backward_err = max([_relative_error(grads[k], ref_grads[k]) for k in ref_grads if k in grads] or [0.0])
    row["fwd"] = "pass" if forward_err <= REL_TOLERANCE else "fail"
    row["bwd"] = "pass" if backward_err <= REL_TOLERANCE and not missing else "fail"
    row["max_err"] = max(forward_err, backward_err)
    if missing:
        row["note"] = f"gradients missing or extra: {', '.join(missing[:3])}"

    graph_flops, fallback_flops, fallback_ops = _graph_flops(formulas)
    row["eager_flops"], row["graph_flops"], row["fallback_flops"] = eager_flops, graph_flops, fallback_flops
    row["nki_share"] = (graph_flops - fallback_flops) / eager_flops if eager_flops else None
    row["fallbacks"] = dict(Counter(fallback_ops))
    row["graph_breaks"] = _graph_breaks()
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
    return {"arch": model_type, "fwd": "error", "bwd": "error", "note": f"{type(exc).__name__}: {exc}"[:200]}


def _format_share(share) -> str:
    return "" if share is None else f"{100 * share:.1f}%"


def _format_fallbacks(fallbacks: dict) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} x{n}" for op, n in sorted(fallbacks.items())) or "-"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| arch | listed | fwd | bwd | max err | NKI FLOPs | fallback ops (host, in compiled graphs) | graph breaks | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        err = "" if row.get("max_err") is None else f"{row['max_err']:.1e}"
        lines.append(
            f"| {row['arch']} | {'yes' if row['arch'] in LISTED else ''} | {row['fwd']} | {row['bwd']} | {err} | "
            f"{_format_share(row.get('nki_share'))} | {_format_fallbacks(row.get('fallbacks', {}))} | "
            f"{row.get('graph_breaks', '')} | {row.get('note', '')} |")
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
        TABLE_FILE.write_text(f"{__doc__.split(chr(10) * 2, 1)[1].strip()}\n\n{table}\n\n{summary(rows)}\n")


if __name__ == "__main__":
    main()

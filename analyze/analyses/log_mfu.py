"""MFU of a logs-only Megatron(-DeepSpeed) run, from the model shape in its arguments and the
iteration times of the one step-time definition (`step_time`, source `log`).

Numerator: Megatron-LM's model FLOPs per iteration (megatron/training/training.py
num_floating_point_operations, dense decoder; ../shared/reference/anchors-mfu-comms-peers.md §2),
forward + backward, no recompute:

    F = 6 · T · [ L · ( h·(d_q + 2·d_kv) + d_q·h + E·h·F_ffn ) + h·V ]  +  6 · T · L · d_q · s

with T = global batch × s tokens per iteration, L layers, h hidden size, d_q = kv_channels × heads,
d_kv = kv_channels × key-value groups (= heads without grouped-query attention), E = 3 with SwiGLU
else 2, F_ffn the FFN hidden size, V the padded vocabulary, s the sequence length. Tally per token:
a matmul of a weight with p parameters costs 2p FLOPs forward and 4p backward (6p), over the QKV
projection h·(d_q + 2 d_kv), the output projection d_q·h, the E FFN matrices h·F_ffn each and the
logits h·V; the attention scores and values, Q·Kᵀ and A·V, cost 2·2·s·d_q forward per token per
layer, halved for the causal mask, times 3 for forward + backward: 6·d_q·s.

MFU = F / (iteration time × world size × dense peak per GPU).
"""

from __future__ import annotations

import polars as pl

from steplens.analyze.analyses.mfu import Peak, utilization

MEGATRON_DEFINITION = ("Megatron-LM model FLOPs per iteration: 6 x tokens x [L(h(d_q + 2 d_kv) + d_q h + E h F_ffn) + h V] "
                       "+ 6 x tokens x L d_q s (causal attention halved; no recompute), from the model shape in the "
                       "log's Megatron arguments")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "global_batch_size")
DEFAULT_VOCAB_DIVISOR = 128  # Megatron's --make-vocab-size-divisible-by default


def _int(args: dict, name: str) -> int | None:
    value = args.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def padded_vocab(args: dict) -> int | None:
    """The padded vocabulary Megatron printed, else --vocab-size padded as Megatron pads it: up to a
    multiple of make_vocab_size_divisible_by x tensor-parallel size (tokenizer.py _vocab_size_with_padding)."""
    if padded := _int(args, "padded_vocab_size"):
        return padded
    if (vocab := _int(args, "vocab_size")) is None:
        return None
    multiple = (_int(args, "make_vocab_size_divisible_by") or DEFAULT_VOCAB_DIVISOR) * (_int(args, "tensor_model_parallel_size") or 1)
    return -(-vocab // multiple) * multiple


def megatron_flops_per_iteration(args: dict) -> tuple[float | None, str]:
    """(model FLOPs of one iteration, "") or (None, what is missing or unsupported)."""
    missing = [name for name in REQUIRED if _int(args, name) is None] + (
        [] if padded_vocab(args) else ["padded_vocab_size (or vocab_size)"])
    if missing:
        return None, f"the log's Megatron arguments lack {', '.join(missing)}"
    experts = args.get("num_experts")
    if isinstance(experts, list) and any(isinstance(e, int) and e > 1 for e in experts) or (
            isinstance(experts, int) and experts > 1):
        return None, "mixture-of-experts model: the dense Megatron FLOPs formula does not apply"
    layers, hidden, heads = _int(args, "num_layers"), _int(args, "hidden_size"), _int(args, "num_attention_heads")
    seq, vocab = _int(args, "seq_length"), padded_vocab(args)
    swiglu = args.get("swiglu") is True
    ffn = _int(args, "ffn_hidden_size")
    if ffn is None:
        if swiglu:
            return None, "SwiGLU without ffn_hidden_size in the log: the FFN width is not known"
        ffn = 4 * hidden  # Megatron's default
    kv_channels = _int(args, "kv_channels") or hidden // heads
    groups = _int(args, "num_key_value_heads") or (
        _int(args, "num_query_groups") if args.get("group_query_attention") is True else None) or heads
    d_q, d_kv = kv_channels * heads, kv_channels * groups
    gated = 3 if swiglu else 2
    tokens = _int(args, "global_batch_size") * seq
    per_token = 6 * (layers * (hidden * (d_q + 2 * d_kv) + d_q * hidden + gated * hidden * ffn) + hidden * vocab) \
        + 6 * layers * d_q * seq
    return float(tokens * per_token), ""


def megatron_mfu(step_time: pl.DataFrame, facts: dict, peak: Peak | None, world_size: int) -> tuple[pl.DataFrame, str]:
    """MFU per logged iteration interval kept by `step_time` (rows in the `mfu` table's columns), or
    no rows and why. Only for runs whose step time is Megatron's iteration time. GPUs: the run's world size
    (manifest.settle_world_size; the log's arguments are among its sources)."""
    args = facts.get("megatron_args") or {}
    if step_time.is_empty() or not args or not step_time["definition"][0].startswith("Megatron"):
        return pl.DataFrame(), ""
    flops, problem = megatron_flops_per_iteration(args)
    if flops is None or peak is None:
        return pl.DataFrame(), problem
    kept = step_time.filter(~pl.col("excluded") & (pl.col("step_time_ns") > 0))
    frame = kept.select(
        "step", "step_time_ns", rank=pl.lit(None, pl.Int64), metric=pl.lit("MFU"), numerator=pl.lit("megatron_args"),
        flops=pl.lit(flops), gpus=pl.lit(world_size, pl.Int64), peak_flops=pl.lit(peak.flops),
        utilization=utilization(flops, pl.col("step_time_ns"), world_size, peak.flops),
        definition=pl.lit(MEGATRON_DEFINITION), peak=pl.lit(peak.label))
    return frame, ""

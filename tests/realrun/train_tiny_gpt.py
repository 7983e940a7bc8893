"""Train a tiny GPT (random tokens) with real DeepSpeed, for tests, the sample run and the benchmark.

Runs on CPU with 2 ranks (gloo), see launch.py:
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 tests/realrun/train_tiny_gpt.py --out_dir /tmp/run

Native DeepSpeed artifacts are switched on one by one (--csv_monitor, --tensorboard, --wandb,
--comms_logger verbose, --wall_clock_breakdown, --ds_flops_profiler, --log_level info), so other tests can
make fresh ones. The steplens collector is on by default (--no-collector turns it off).

Besides DeepSpeed's and the collector's output, every rank writes `script/rank<r>.json`: the script's own
per-step wall times and the engine's global_samples after each optimizer step, an independent record
the tests compare the collector against.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import json
import math
import os
import signal
import time
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

LAUNCHER_POLL_S = 1.0  # deepspeed/launcher/launch.py: time.sleep(1) between polls of its ranks
VOCAB = 512  # defaults of the CPU tests; the GPU check (tests/gpu) makes it bigger
D_MODEL = 128
HEADS = 4
LAYERS = 2


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.d_model, self.heads = d_model, heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, seq, 3, self.heads, self.d_model // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, self.d_model))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, seq_len: int, vocab: int = VOCAB, d_model: int = D_MODEL, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.tok(tokens[:, :-1]) + self.pos.weight[: tokens.shape[1] - 1]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab).float(), tokens[:, 1:].reshape(-1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    p.add_argument("--out_dir", required=True, help="Run folder: collector output and native artifacts go here.")
    p.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=8, help="Optimizer steps.")
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps.")
    p.add_argument("--micro_batch", type=int, default=4, help="train_micro_batch_size_per_gpu.")
    p.add_argument("--seq_len", type=int, default=64, help="Tokens per sample.")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision.")
    p.add_argument("--model", default=f"{VOCAB},{D_MODEL},{HEADS},{LAYERS}", metavar="VOCAB,D_MODEL,HEADS,LAYERS",
                   help="Model size.")
    p.add_argument("--dist_backend", default="gloo", help="gloo (CPU) or nccl (GPU).")
    p.add_argument("--deepspeed_config", help="Use this ds_config (a .json file, or base64 JSON as the autotuner passes it) instead of building one; "
                        "the switches below are then ignored.")

    native = p.add_argument_group("native DeepSpeed artifacts (written under --out_dir)")
    native.add_argument("--csv_monitor", action="store_true", help="csv_monitor -> csv_monitor/tiny_gpt/*.csv")
    native.add_argument("--tensorboard", action="store_true", help="tensorboard monitor -> tensorboard/tiny_gpt/events.*")
    native.add_argument("--wandb", action="store_true", help="wandb monitor; set WANDB_MODE=offline WANDB_DIR=... yourself")
    native.add_argument("--comms_logger", choices=["off", "summary", "verbose", "debug"], default="off",
                        help="comms_logger block; verbose/debug print one line per call (needs --log_level info); "
                             "summary and above write comms/log_summary_rank<r>.json at the end")
    native.add_argument("--wall_clock_breakdown", action="store_true", help="wall_clock_breakdown timer lines")
    native.add_argument("--ds_flops_profiler", type=int, metavar="STEP", default=None,
                        help="DeepSpeed's own flops profiler at this profile_step -> flops_profiler/flops_profile.txt")
    native.add_argument("--log_level", default=None, help='ds_config "log_level", e.g. info')
    native.add_argument("--steps_per_print", type=int, default=2)

    collector = p.add_argument_group("steplens collector")
    collector.add_argument("--collector", action=argparse.BooleanOptionalAction, default=True,
                           help="Attach steplens.collect (default on).")
    collector.add_argument("--flush_every", type=int, default=4, help="Collector flush interval, optimizer steps.")
    collector.add_argument("--flops_step", type=int, default=2, help="Step the collector profiles FLOPs on (-1: off).")
    collector.add_argument("--profile_window", default="1,1,1,1", metavar="WAIT,WARMUP,ACTIVE,REPEAT",
                           help="torch.profiler schedule of the collector ('off': none).")
    collector.add_argument("--profile_skip_first", type=int, default=2, help="Steps before the first profiler window.")
    collector.add_argument("--profile_modules", action="store_true",
                           help="Profiler window with module hierarchy (with_modules) as well as shapes.")
    collector.add_argument("--profile_stack", action="store_true", help="Profiler window with Python stacks (with_stack).")
    collector.add_argument("--comms_synchronize", choices=["on", "off"], default="on",
                           help="The collector's comms_synchronize setting.")
    collector.add_argument("--collector_comms", choices=["on", "off"], default="on",
                           help="The collector's comms setting (one record per deepspeed.comm call).")
    collector.add_argument("--cupti_teardown", choices=["auto", "on", "off"], default="auto",
                           help="The collector's cupti_teardown setting (auto: its default).")
    collector.add_argument("--scalars_all_ranks", action="store_true", help="Collector scalars on every rank, not only rank 0.")
    collector.add_argument("--collector_run_dir", default=None, help="Collector run_dir, when not --out_dir.")
    collector.add_argument("--alarms", default=None, metavar="JSON",
                           help='The steplens block\'s "alarms" list (default: no key, the default rules).')
    collector.add_argument("--pushgateway", default=None, metavar="HOST:PORT", help="Push alarms to this pushgateway.")
    collector.add_argument("--alarm_sink", choices=["jsonl", "hang", "raise"], default="jsonl",
                           help="on_alarm callback: write script/alarms_rank<r>.jsonl, never return, or raise "
                                "(benchmarks of a failing sink).")

    tests = p.add_argument_group("test hooks")
    tests.add_argument("--probe_comms", type=int, metavar="STEP", default=None,
                       help="After this step: an all_reduce that rank 1 enters 200 ms late, timed by the script itself.")
    tests.add_argument("--unknown_comm_op", action="store_true",
                       help="Call all_gather_object and monitored_barrier once (ops DeepSpeed's comms logger exits on).")
    tests.add_argument("--kill_rank", type=int, default=None, help="This rank SIGKILLs itself ...")
    tests.add_argument("--kill_at_step", type=int, default=None, help="... after this optimizer step.")
    tests.add_argument("--inject_fault", default=None, metavar="HOOK",
                       help="Make this collector method raise (e.g. record_timers), to show training goes on.")
    tests.add_argument("--log_odd_values", action="store_true",
                       help="Also log, each step, values that are not numbers (test/text = 'n/a', test/none = None) "
                            "and non-finite ones (test/nonfinite: nan, inf, -inf in turn).")
    tests.add_argument("--grad_spike_at", type=int, default=None, metavar="STEP",
                       help="Backward of 1000 x the loss at this step (a real grad-norm spike); logs train/grad_norm each step.")
    tests.add_argument("--nan_loss_at", type=int, default=None, metavar="STEP",
                       help="The loss becomes NaN from this step on (NaN x loss, so the weights follow).")
    tests.add_argument("--save_checkpoint_at", type=int, default=None, metavar="STEP",
                       help="engine.save_checkpoint(out_dir/checkpoints) after this optimizer step.")
    tests.add_argument("--slow_rank", type=int, default=None, help="This rank sleeps --slow_ms in every step ...")
    tests.add_argument("--slow_ms", type=float, default=0.0, help="... before its forward (a straggler).")
    tests.add_argument("--slow_all_from", type=int, default=None, metavar="STEP",
                       help="Every rank sleeps --slow_ms between forward and backward from this step on (a run that slows down).")
    tests.add_argument("--collector_ab", type=int, default=None, metavar="BLOCK",
                       help="Benchmark: attach the collector for BLOCK steps, close it for BLOCK steps, and so on "
                            "(script/rank<r>.json says which steps ran with it).")
    return p.parse_args()


def ds_config(args: argparse.Namespace, out_dir: Path) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": args.steps_per_print,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": args.zero_stage},
        "wall_clock_breakdown": args.wall_clock_breakdown,
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.log_level:
        config["log_level"] = args.log_level
    for monitor in ("csv_monitor", "tensorboard"):
        if getattr(args, monitor):
            config[monitor] = {"enabled": True, "output_path": str(out_dir / monitor), "job_name": "tiny_gpt"}
    if args.wandb:
        config["wandb"] = {"enabled": True, "project": "tiny_gpt_ds", "group": f"zero{args.zero_stage}"}
    if args.comms_logger != "off":
        # DeepSpeed enables the logger when the key is present, whatever "enabled" says.
        config["comms_logger"] = {"enabled": True, "verbose": args.comms_logger in ("verbose", "debug"),
                                  "prof_all": True, "debug": args.comms_logger == "debug"}
    if args.ds_flops_profiler is not None:
        config["flops_profiler"] = {"enabled": True, "profile_step": args.ds_flops_profiler, "module_depth": -1,
                                    "top_modules": 3, "detailed": True,
                                    "output_file": str(out_dir / "flops_profiler" / "flops_profile.txt")}
    if args.collector:
        profile = None
        if args.profile_window != "off":
            wait, warmup, active, repeat = (int(x) for x in args.profile_window.split(","))
            profile = {"skip_first": args.profile_skip_first, "wait": wait, "warmup": warmup, "active": active,
                       "repeat": repeat}
        config["steplens"] = {"run_dir": args.collector_run_dir or str(out_dir), "flush_every": args.flush_every, "seq_len": args.seq_len,
                              "flops_step": None if args.flops_step < 0 else args.flops_step, "profile": profile,
                              "scalars_all_ranks": args.scalars_all_ranks, "profile_with_modules": args.profile_modules,
                              "profile_with_stack": args.profile_stack,
                              "comms_synchronize": args.comms_synchronize == "on", "comms": args.collector_comms == "on"}
        if args.cupti_teardown != "auto":
            config["steplens"]["cupti_teardown"] = args.cupti_teardown == "on"
        if args.alarms is not None:
            config["steplens"]["alarms"] = json.loads(args.alarms)
        if args.pushgateway:
            config["steplens"]["pushgateway"] = args.pushgateway
    return config


def load_config(value: str) -> dict:
    """A ds_config file, or the base64 JSON the DeepSpeed autotuner passes in --deepspeed_config."""
    if value.endswith(".json"):
        return json.loads(Path(value).read_text())
    return json.loads(base64.urlsafe_b64decode(value))


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out_dir).resolve()
    deepspeed.init_distributed(dist_backend=args.dist_backend)
    rank = deepspeed.comm.get_rank()
    if args.kill_rank is not None and args.kill_rank != rank:
        # DeepSpeed's launcher polls its ranks once a second and reports the first non-zero exit in rank order:
        # a survivor that fails within that second (gloo: "Connection closed by peer") would be reported instead
        # of the rank that was killed. Registered first, this runs last: after the traceback and every other
        # exit handler (the collector's), a survivor waits out the launcher's poll, which then kills it.
        atexit.register(time.sleep, 3 * LAUNCHER_POLL_S)
    torch.manual_seed(0)
    vocab, d_model, heads, layers = (int(x) for x in args.model.split(","))
    model = TinyGPT(args.seq_len + 1, vocab, d_model, heads, layers)
    if args.deepspeed_config:
        config = load_config(args.deepspeed_config)
    else:
        config = ds_config(args, out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "ds_config.json").write_text(json.dumps(config, indent=2))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    collector = None
    if args.collector and "steplens" in config:
        from steplens.collect import attach

        # Settings from the ds_config's "steplens" block; every alarm also goes to script/alarms_rank<r>.jsonl
        # (--alarm_sink jsonl).
        (out_dir / "script").mkdir(parents=True, exist_ok=True)
        alarm_log = open(out_dir / "script" / f"alarms_rank{rank}.jsonl", "w", buffering=1)
        sinks = {"jsonl": lambda alarm: alarm_log.write(json.dumps(alarm) + "\n"),
                 "hang": lambda alarm: time.sleep(3600), "raise": lambda alarm: 1 / 0}
        collector = attach(engine, on_alarm=sinks[args.alarm_sink])
        if args.inject_fault:
            def fault(*_args, **_kwargs):
                raise RuntimeError(f"injected fault in {args.inject_fault}")
            setattr(collector, args.inject_fault, fault)

    generator = torch.Generator().manual_seed(1 + rank)
    record = {"rank": rank, "steps": [], "probe": None}
    (out_dir / "script").mkdir(parents=True, exist_ok=True)
    # One line per finished step as it happens: what a job stopped from outside got through.
    progress = open(out_dir / "script" / f"rank{rank}.steps.jsonl", "w", buffering=1)
    for step in range(args.steps):
        if args.collector_ab and step % args.collector_ab == 0 and step:
            if collector is None:
                collector = attach(engine)
            else:
                collector.close()
                collector = None
        start = time.time_ns()
        for _ in range(args.gas):
            tokens = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=generator).to(engine.device)
            if args.slow_rank == rank:
                time.sleep(args.slow_ms / 1e3)
            loss = engine(tokens)
            if args.slow_all_from is not None and step >= args.slow_all_from:
                time.sleep(args.slow_ms / 1e3)  # inside the step as the collector times it (forward to step())
            if args.nan_loss_at is not None and step >= args.nan_loss_at:
                loss = loss * math.nan
            engine.backward(loss * 1000 if step == args.grad_spike_at else loss)
            engine.step()
        end = time.time_ns()
        grad_norm = engine.get_global_grad_norm() if args.grad_spike_at is not None else None
        grad_norm = None if grad_norm is None else float(grad_norm)
        record["steps"].append({"step": step, "start_ns": start, "end_ns": end, "collector_on": collector is not None,
                                "global_samples": engine.global_samples, "global_steps": engine.global_steps,
                                "loss": loss.item(), "grad_norm": grad_norm})
        if collector is not None:
            collector.log("train/loss", loss.item())
            if grad_norm is not None:
                collector.log("train/grad_norm", grad_norm)
            if args.log_odd_values:
                collector.log("test/text", "n/a")
                collector.log("test/none", None)
                collector.log("test/nonfinite", (math.nan, math.inf, -math.inf)[step % 3])
        progress.write(json.dumps({"step": step, "global_samples": engine.global_samples}) + "\n")
        if args.probe_comms == step:
            record["probe"] = probe_comms(rank)
        if args.unknown_comm_op and step == 0:
            objects = [None] * deepspeed.comm.get_world_size()
            deepspeed.comm.all_gather_object(objects, {"rank": rank})
            deepspeed.comm.monitored_barrier()
        if args.save_checkpoint_at == step:
            engine.save_checkpoint(str(out_dir / "checkpoints"))
        if args.kill_rank == rank and args.kill_at_step == step:
            os.kill(os.getpid(), signal.SIGKILL)

    if args.comms_logger != "off":
        summary = deepspeed.comm.log_summary(return_dict=True)
        (out_dir / "comms").mkdir(exist_ok=True)
        (out_dir / "comms" / f"log_summary_rank{rank}.json").write_text(json.dumps(summary, indent=1, default=str))
    if collector is not None:
        collector.close()
    (out_dir / "script" / f"rank{rank}.json").write_text(json.dumps(record, indent=1))


def probe_comms(rank: int) -> dict:
    """An all_reduce that rank 1 enters 200 ms late, timed here with the wall clock: on rank 0 the call
    takes about 200 ms. `caller` is this function's name, as the collector should record it."""
    tensor = torch.ones(1024)
    deepspeed.comm.barrier()
    if rank == 1:
        time.sleep(0.2)
    start = time.time_ns()
    deepspeed.comm.all_reduce(tensor)
    end = time.time_ns()
    return {"caller": "probe_comms", "start_ns": start, "end_ns": end, "msg_bytes": tensor.numel() * 4}


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Synthetic multi-rank PyTorch-profiler (Kineto) Chrome traces with exact ground truth.

Usage as a script::

    python tests/synthetic.py OUT_DIR --ranks 8 --steps 4 [--kernels-per-step 40]
        [--target-mb-per-rank 50] [--seed 0] [--no-gzip] [--compresslevel N]
        [--straggler RANK:STEP ...] [--straggler-factor 3.0]
        [--clock-offset-us US ... | R:US ...] [--max-clock-offset-us 500]
        [--first-step 10] [--gpus-per-node G] [--jobs J] [--quiet]

and as a module (tests put ``tests/`` on ``sys.path``)::

    from synthetic import generate_run
    truth = generate_run(out_dir, ranks=4, steps=4, stragglers=[(1, 12)])

Standard library only.  Every rank gets ``OUT_DIR/rank-<r>.pt.trace.json.gz`` (or
``.json`` with ``--no-gzip``); ``OUT_DIR/truth.json`` holds the ground truth.  Files
are streamed step by step (a step's events are formatted with string templates and
written straight through gzip), so memory stays flat however large the target is.

Time model
==========
All times are generated as integer nanoseconds of a *true global clock* ``t``
(``t = 0`` is absolute ``T0 = 1_700_000_001_250_000_000`` ns).  Rank ``r`` has a
clock offset ``offset_r`` (rank 0 = 0; default uniform in +-500 us, seeded, or set
with ``--clock-offset-us``): an event that truly happens at ``t`` is written at
absolute ``T0 + t + offset_r`` ns.  The file stores ``baseTimeNanoseconds = B_r``
(``1_700_000_000_000_000_000 + (r % 2) * 1e9``, so even and odd ranks deliberately
use different bases; lowered by whole seconds only for offsets beyond -0.25 s) and every ``ts``/``dur`` in microseconds with exactly three
decimals, so ``abs_ns = B_r + round(ts * 1000)`` is exact.  Every ``*_ns`` value in
truth.json is such a *written absolute* ns value (rank-local clock) unless the key
says ``true``.

Per step and rank (host pid ``1000 + r``, tid 1; GPU pid = device id, tid = stream)
================================================================================
``ProfilerStep#N`` (user_annotation) containing, in CPU order:
  [straggler only: python_function ``dataloader.py(631): __next__`` stall of
  ``(straggler_factor - 1) * estimated step time``, at the very start of the step]
  H2D ``cudaMemcpyAsync`` (aten::to > aten::_to_copy > aten::copy_) and
  ``cudaMemsetAsync`` (aten::zero_) on stream 7 + ``[memory]`` events;
  forward (python_function ``nn.Module: GPT_0``): cpu_op > launch (cudaLaunchKernel,
  cudaLaunchKernelExC, cuLaunchKernel/cuLaunchKernelEx as cat ``cuda_driver``), one
  ``cudaGraphLaunch`` launching 3 kernels with one correlation id; in launch-bound
  steps a stretch of short kernels whose launches are separated by 40-80 us of
  python time (python_function ``model.py(57): _python_heavy_block``);
  ``aten::item`` > ``aten::_local_scalar_dense`` > blocking ``cudaMemcpy`` D2H (it
  starts while stream 7 is busy and returns 2-4 us after the copy ends);
  backward (python_function): kernels, with NCCL collectives ``_allgather_base``
  (after the 3rd backward launch; normally fully overlapped), ``_reduce_scatter_base``
  (after 2/3 of them; normally fully overlapped) and a big bf16 ``allreduce`` (after
  the last backward launch; normally partially exposed), each a cpu_op
  ``record_param_comms`` > cudaLaunchKernel (+ cudaEventRecord) whose kernel runs on
  stream 20; bare ``cudaStreamWaitEvent`` (stream 7 waits for the allreduce);
  user_annotation ``Optimizer.step#AdamW.step`` with 3 kernels; bare
  ``cudaStreamSynchronize`` (waits for stream 7); a 1-element Float ``allreduce``
  (loss for logging, launched on a drained stream 7, so fully exposed); then a bare
  ``cudaDeviceSynchronize`` in device-sync steps, else a second bare
  ``cudaStreamSynchronize`` (on stream 20).  That last collective re-aligns all
  ranks at every step end, so a straggler only affects its own step.
A collective instance ends at the same true time on every rank:
``end = max_r(start_r) + transfer``, ``start_r = max(launch_r + latency, stream20_free_r)``.
Collectives per step: 4, ``Seq`` = 1, 2, 3, ... over the whole run.
Default scenarios: launch-bound steps are step index ``i % 3 == 1``, device-sync
steps ``i % 2 == 1`` (``i`` = 0-based step index).

Kernel placement on stream 7 (this is what makes every gap single-cause): an
activity whose launch call starts at ``l`` with launch latency ``lat`` starts at
``stream_free`` when ``l + lat <= stream_free`` (queued), at ``l + lat`` when
``l >= stream_free`` (the GPU waited for the CPU); a launch falling in between is
nudged to ``l = stream_free``.  The first optimizer kernel additionally waits for
the allreduce (cross-stream dependency).  Graph kernels 2 and 3 start when the
previous one ends.

Definitions used for truth
==========================
event_counts: complete (``ph == "X"``) and instant (``ph == "i"``) events per
``cat``; ``memory`` counts ``cpu_instant_event`` ``[memory]`` events; metadata (M)
and flow (s/f) events are not counted.  flow_events: number of ``ph`` ``s`` / ``f``
events (every launch that has device work has one ``s``; every device event
(kernel, memcpy, memset) has one ``f`` with ``id`` = correlation; a graph launch has
1 ``s`` and 3 ``f``).  launch_links: (runtime/driver call -> device event) pairs
joined by correlation = number of device events.
steps[i].start_ns/end_ns: the ProfilerStep window; gpu_start_ns/gpu_end_ns: the
step's *GPU span* = first start .. last end of the stream-7 device activity
(kernels, memcpy, memset) launched inside that step.
idle[step] (all within the GPU span, stream 7 only):
  compute_stream_busy_ns = total duration of stream-7 activity (kernels, memcpy,
  memset; they never overlap); every gap between consecutive stream-7 activities
  A (ends g0) -> B (launch call of B starts at l_B) is
  (the first two only when B then waited in the queue no longer than its call took from g0:
  c_B - g0 >= b0 - c_B, c_B the end of B's launch call)
  * sync_idle     if l_B >= g0 and the host thread is inside a synchronising call
    (cudaStreamSynchronize, cudaDeviceSynchronize, blocking cudaMemcpy) with
    call.start <= g0 < call.end;
  * host_bound    if l_B >= g0 otherwise (the GPU had nothing queued: it waited
    for the CPU to issue work);
  * other         if l_B < g0 (B was already queued: here always the cross-stream
    wait of the optimizer on the allreduce), or B queued longer than that.
  busy + host_bound + sync + other == gpu_end_ns - gpu_start_ns exactly.
exposed_comm_ns[step] = sum over that step's collectives (launched inside the
ProfilerStep) of the NCCL kernel time on stream 20 not overlapped by any ``kernel``
on stream 7 (by construction NCCL kernels never overlap stream-7 memcpy/memset, so
"any stream-7 activity" gives the same number).
collectives[].kernel_start_ns/kernel_end_ns: the rank's NCCL kernel (written
clock); ``kernel_end_ns - clock_offset_ns`` is identical on all ranks for one seq.
step_true_duration_ns[step] = max_r(true ProfilerStep end) - min_r(true
ProfilerStep start) (clock offsets removed); step_true_window_ns gives [start, end]
as true absolute ns (T0 + t).
mixed_cause_gaps: gaps where a cross-stream wait coincided with a late launch
(classified by the rule above, but not single-cause); 0 for the default scenarios.

What the scenarios look like in truth: launch-bound steps have host_bound_idle_ns
of ~0.1-0.3 ms at 40 kernels/step (more with more kernels; 0 in other steps); every step has ~15-25 us sync_idle_ns (the
D2H); in a straggler step the other ranks' allgather/reduce-scatter/allreduce
kernels stretch until the straggler arrives, their optimizer waits for the
allreduce (large other_idle_ns and exposed_comm_ns), while the straggler itself has
a long ProfilerStep but a normal GPU span.

truth.json layout (``*_ns`` are ints)
=====================================
{"generator": {params..., "steps": steps actually generated},
 "world_size": N,
 "ranks": {"<r>": {
    "base_time_ns", "clock_offset_ns", "host_pid", "device",
    "event_counts": {"cpu_op", "user_annotation", "python_function", "cuda_runtime",
                     "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset",
                     "gpu_user_annotation" (0), "memory", "other" (0)},
    "flow_events": {"s", "f"},
    "steps": [{"step", "start_ns", "end_ns", "gpu_start_ns", "gpu_end_ns",
               "true_start_ns", "true_end_ns"}],
    "launch_links",
    "kernels_by_correlation": {"<corr>": [kernel abs start ns, ...]}  (only when the
        rank has <= 5000 kernels incl. NCCL; graph launches list 3 starts),
    "first_event_abs_ns", "last_event_end_abs_ns",   (over X and i events)
    "collectives": [{"seq", "name", "bytes" (= In msg nelems * element size),
                     "group_size", "kernel_start_ns", "kernel_end_ns", "step",
                     "correlation", "exposed_ns"}],
    "idle": {"<step>": {"compute_stream_busy_ns", "host_bound_idle_ns",
                        "sync_idle_ns", "other_idle_ns"}},
    "exposed_comm_ns": {"<step>": ns},
    "mixed_cause_gaps",
    "raw_bytes" (uncompressed JSON size), "file", "file_bytes"}},
 "stragglers": [{"rank", "step"}],
 "step_true_duration_ns": {"<step>": ns}, "step_true_window_ns": {"<step>": [a, b]},
 "scenarios": {"launch_bound_steps": [...], "device_sync_steps": [...]}}

Size and speed: ``--target-mb-per-rank`` measures the raw bytes per step on a
12-step dry run of rank 0 and sets the step count to reach the target (within ~1%);
``--steps`` is then a minimum.  gzip level defaults to 1 with a target size, else 6.
Compression runs in a writer thread (zlib releases the GIL); ``--jobs J`` writes
ranks in J processes (each re-simulates the cheap timeline of all ranks, so the
output is identical to ``--jobs 1``).
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import queue
import random
import sys
import threading
import time

T0_ABS_NS = 1_700_000_001_250_000_000
BASE_NS = 1_700_000_000_000_000_000
COMPUTE_STREAM = 7
COMM_STREAM = 20
KBC_LIMIT = 5000  # kernels_by_correlation is only written when total kernels <= this

# --------------------------------------------------------------------------- catalog

# launch kinds: (fragment with cat and name, cbid, call dur base ns, call dur range ns)
KINDS = (
    ('"cat": "cuda_runtime", "name": "cudaLaunchKernel"', 211, 3000, 2500, "cuda_runtime"),
    ('"cat": "cuda_runtime", "name": "cudaLaunchKernelExC"', 430, 3500, 2500, "cuda_runtime"),
    ('"cat": "cuda_driver", "name": "cuLaunchKernel"', 307, 2500, 2000, "cuda_driver"),
    ('"cat": "cuda_driver", "name": "cuLaunchKernelEx"', 652, 3000, 2000, "cuda_driver"),
)
K_RT, K_EXC, K_CU, K_CUEX = range(4)


def _kargs(regs, smem, grid, block, bps, wps, occ):
    return (
        '"registers per thread": %d, "shared memory": %d, "blocks per SM": %.6f, '
        '"warps per SM": %.6f, "grid": [%d, %d, %d], "block": [%d, 1, 1], '
        '"est. achieved occupancy %%": %d' % (regs, smem, bps, wps, grid[0], grid[1], grid[2], block, occ)
    )


# (cpu_op name, kernel name, launch kinds to pick from, dur lo us, dur hi us, static kernel args)
GEMM_FWD = [
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     (K_RT, K_RT, K_RT, K_CUEX), 40, 160, _kargs(168, 213504, (132, 1, 1), 384, 1.0, 12.0, 18)),
    ("aten::addmm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize256x128x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
     (K_RT, K_CUEX), 60, 180, _kargs(168, 227328, (132, 1, 1), 384, 1.0, 12.0, 18)),
    ("aten::mm", "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT",
     (K_CUEX,), 50, 150, _kargs(168, 221184, (66, 2, 1), 384, 1.0, 12.0, 18)),
]
GEMM_BWD = [
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
     (K_RT, K_RT, K_CUEX), 50, 200, _kargs(168, 227328, (132, 1, 1), 384, 1.0, 12.0, 18)),
    ("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     (K_RT, K_CUEX), 40, 160, _kargs(168, 213504, (132, 1, 1), 384, 1.0, 12.0, 18)),
]
ATTN_FWD = [
    ("aten::_flash_attention_forward",
     "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
     "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, "
     "false, false>(Flash_fwd_params)",
     (K_EXC,), 60, 120, _kargs(255, 49152, (16, 32, 16), 128, 1.0, 4.0, 6)),
]
ATTN_BWD = [
    ("aten::_flash_attention_backward",
     "void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
     "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, "
     "false, true, false, false, false, true, false, false>(Flash_bwd_params)",
     (K_EXC,), 120, 250, _kargs(255, 147456, (32, 16, 16), 256, 1.0, 8.0, 12)),
]
ELEM = [
    ("aten::add_", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
     "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
     (K_RT,), 4, 16, _kargs(26, 0, (1320, 1, 1), 128, 10.0, 40.0, 62)),
    ("aten::mul", "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16, "
     "c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >"
     "(int, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
     "at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3>)",
     (K_RT,), 4, 14, _kargs(24, 0, (1320, 1, 1), 128, 10.0, 40.0, 61)),
    ("aten::native_layer_norm", "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
     "float>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, "
     "c10::BFloat16*)",
     (K_RT,), 8, 20, _kargs(40, 0, (4096, 1, 1), 256, 8.0, 64.0, 80)),
    ("aten::_softmax", "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16, float, "
     "c10::BFloat16, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(c10::BFloat16*, "
     "c10::BFloat16 const*, int)",
     (K_RT,), 6, 18, _kargs(32, 0, (4096, 1, 1), 1024, 2.0, 64.0, 90)),
    ("aten::gelu", "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl("
     "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() "
     "const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl("
     "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() "
     "const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)",
     (K_RT,), 5, 16, _kargs(28, 0, (1320, 1, 1), 128, 10.0, 40.0, 60)),
]
ELEM_BWD = [
    ("aten::gelu_backward", "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
     "GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::"
     "{lambda()#4}::operator()() const::{lambda(c10::BFloat16, c10::BFloat16)#1}, at::detail::Array<char*, 3> >(int, "
     "at::native::(anonymous namespace)::GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::"
     "{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16, c10::BFloat16)#1}, "
     "at::detail::Array<char*, 3>)",
     (K_RT,), 6, 18, _kargs(30, 0, (1320, 1, 1), 128, 10.0, 40.0, 58)),
    ("aten::native_layer_norm_backward", "void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized"
     "<c10::BFloat16, float>(c10::BFloat16 const*, c10::BFloat16 const*, float const*, float const*, "
     "c10::BFloat16 const*, c10::BFloat16*, int)",
     (K_RT,), 10, 24, _kargs(48, 0, (4096, 1, 1), 256, 8.0, 64.0, 75)),
    ("aten::add_", "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
     "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)",
     (K_RT,), 4, 16, _kargs(26, 0, (1320, 1, 1), 128, 10.0, 40.0, 62)),
]
TRITON = [
    ("triton_poi_fused__to_copy_add_mul_0", "triton_poi_fused__to_copy_add_mul_0", (K_CU,), 5, 20,
     _kargs(28, 0, (2048, 1, 1), 256, 8.0, 64.0, 70)),
    ("triton_red_fused_native_layer_norm_1", "triton_red_fused_native_layer_norm_1", (K_CU,), 8, 25,
     _kargs(40, 1024, (4096, 1, 1), 128, 8.0, 32.0, 55)),
]
GRAPH_KERNELS = [
    ("triton_per_fused_native_layer_norm_0", 8, 20, _kargs(36, 512, (4096, 1, 1), 128, 8.0, 32.0, 50)),
    ("triton_tem_fused_mm_1", 30, 60, _kargs(232, 163840, (264, 1, 1), 256, 1.0, 8.0, 12)),
    ("triton_poi_fused_gelu_2", 5, 15, _kargs(28, 0, (2048, 1, 1), 256, 8.0, 64.0, 70)),
]
OPT = [
    ("aten::_foreach_mul_", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, "
     "std::multiplies<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<1>, at::native::(anonymous "
     "namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, std::multiplies<float>, float)",
     (K_RT,), 20, 40, _kargs(38, 0, (320, 1, 1), 512, 2.4, 38.0, 60)),
    ("aten::_fused_adamw_", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, float*, double, float*, float*, double, double, double, double, double, bool, "
     "bool, float*, float*>(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::("
     "anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float*, double, float*, "
     "float*, double, double, double, double, double, bool, bool, float*, float*)",
     (K_RT,), 60, 100, _kargs(72, 0, (320, 1, 1), 512, 2.4, 38.0, 55)),
    ("aten::_foreach_add_", "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
     "namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, "
     "std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous "
     "namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float)",
     (K_RT,), 15, 35, _kargs(40, 0, (320, 1, 1), 512, 2.4, 38.0, 60)),
]

# collectives: (Collective name, kernel name, dtype, elem size, in_nelems(N), out_nelems(N), wire factor(N))
COLL_A = ("_allgather_base", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "BFloat16", 2,
          lambda n: 2_097_152, lambda n: 2_097_152 * n, lambda n: float(n - 1))
COLL_B = ("_reduce_scatter_base", "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
          "BFloat16", 2, lambda n: 1_048_576 * n, lambda n: 1_048_576, lambda n: (n - 1) / n)
COLL_C = ("allreduce", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "BFloat16", 2,
          None, None, lambda n: 2.0 * (n - 1) / n)  # nelems = C_NELEMS_PER_BWD_KERNEL * backward kernels
COLL_D = ("allreduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "Float", 4,
          lambda n: 1, lambda n: 1, lambda n: 2.0 * (n - 1) / n)
C_NELEMS_PER_BWD_KERNEL = 2_621_440
NCCL_BW_BYTES_PER_NS = 100  # 100 GB/s bus bandwidth
NCCL_BASE_NS = 12_000

H2D_BYTES = 2_097_152
MEMSET_BYTES = 4_194_304

# --------------------------------------------------------------------------- templates

_J = json.dumps

T_X_HOST = (
    '  {\n    "ph": "X", "cat": "%s", "name": %s, "pid": {PID}, "tid": 1,\n'
    '    "ts": %d.%03d, "dur": %d.%03d,\n'
    '    "args": {\n      %s\n    }\n  }'
)
T_X_DEV = (
    '  {\n    "ph": "X", "cat": "%s", "name": %s, "pid": {DEV}, "tid": %d,\n'
    '    "ts": %d.%03d, "dur": %d.%03d,\n'
    '    "args": {\n      %s\n    }\n  }'
)
T_FLOW = (
    '  {\n    "ph": "s", "id": %d, "pid": {PID}, "tid": 1, "ts": %d.%03d,\n'
    '    "cat": "ac2g", "name": "ac2g"\n  },\n'
    '  {\n    "ph": "f", "id": %d, "pid": {DEV}, "tid": %d, "ts": %d.%03d,\n'
    '    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }'
)
T_FLOW_F = (
    '  {\n    "ph": "f", "id": %d, "pid": {DEV}, "tid": %d, "ts": %d.%03d,\n'
    '    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }'
)
T_MEM = (
    '  {\n    "ph": "i", "cat": "cpu_instant_event", "s": "t", "name": "[memory]",\n'
    '    "pid": {PID}, "tid": 1,\n    "ts": %d.%03d,\n'
    '    "args": {\n      "Device Type": 1, "Device Id": {DEV}, "Addr": %d, "Bytes": %d, '
    '"Total Allocated": %d, "Total Reserved": %d\n    }\n  }'
)
T_META = (
    '  {\n    "name": "%s", "ph": "M", "ts": %d.%03d, "pid": %d, "tid": %d,\n'
    '    "args": {\n      %s\n    }\n  }'
)


# --------------------------------------------------------------------------- plan


class _Coll:
    __slots__ = ("name", "kname", "dtype", "esize", "in_n", "out_n", "transfer", "seq")


class _Plan:
    __slots__ = ("idx", "step", "launch_bound", "device_sync", "fwd_pre", "lb_range", "graph", "fwd_post",
                 "bwd", "a_after", "b_after", "opt", "colls", "h2d_dur", "memset_dur", "est_ns")


_JCACHE = {}


def _jname(x):
    """JSON-encode a name once (names repeat a lot)."""
    v = _JCACHE.get(x)
    if v is None:
        v = _JCACHE[x] = _J(x)
    return v


def _pick_slot(rng, table):
    opn, kn, kinds, lo, hi, kargs = table[int(rng.random() * len(table))]
    kind = kinds[int(rng.random() * len(kinds))]
    dur = int((lo + rng.random() * (hi - lo)) * 1000)
    return (_jname(opn), _jname(kn), kind, dur, kargs)


def _make_coll(spec, n, rng, seq, n_bwd):
    c = _Coll()
    c.name, c.kname, c.dtype, c.esize = spec[0], spec[1], spec[2], spec[3]
    if spec[4] is None:
        c.in_n = c.out_n = C_NELEMS_PER_BWD_KERNEL * n_bwd
    else:
        c.in_n, c.out_n = spec[4](n), spec[5](n)
    wire = c.in_n * c.esize * spec[6](n)
    c.transfer = NCCL_BASE_NS + int(wire / NCCL_BW_BYTES_PER_NS * (1.0 + 0.02 * rng.random()))
    c.seq = seq
    return c


def _make_plan(cfg, idx, seq0):
    """Step-level plan shared by all ranks (same model on every rank)."""
    rng = random.Random(cfg["seed"] * 1_000_003 + idx * 7919 + 17)
    p = _Plan()
    p.idx = idx
    p.step = cfg["first_step"] + idx
    p.launch_bound = idx in cfg["launch_bound_idx"] if cfg["launch_bound_idx"] is not None else idx % 3 == 1
    p.device_sync = idx in cfg["device_sync_idx"] if cfg["device_sync_idx"] is not None else idx % 2 == 1
    k = cfg["kernels_per_step"]
    rest = k - 8  # graph (3) + fwd_post (2) + optimizer (3)
    n_pre = max(8, rest * 2 // 5)  # 2 GEMMs + >= 6 (launch-bound stretch in launch-bound steps)
    n_bwd = rest - n_pre  # >= 4 because kernels_per_step >= 20
    pre = [_pick_slot(rng, GEMM_FWD), _pick_slot(rng, GEMM_FWD)]
    if p.launch_bound:
        p.lb_range = (2, n_pre)
        for _ in range(2, n_pre):
            pre.append(_pick_slot(rng, ELEM if rng.random() < 0.6 else TRITON))
    else:
        p.lb_range = None
        for _ in range(2, n_pre):
            x = rng.random()
            tab = GEMM_FWD if x < 0.35 else ATTN_FWD if x < 0.45 else ELEM if x < 0.85 else TRITON
            pre.append(_pick_slot(rng, tab))
    p.fwd_pre = pre
    p.graph = [(_jname(kn), int((lo + rng.random() * (hi - lo)) * 1000), ka) for kn, lo, hi, ka in GRAPH_KERNELS]
    post = []
    for _ in range(2):
        s = _pick_slot(rng, GEMM_FWD)
        post.append(s[:3] + (max(s[3], 60_000),) + s[4:])
    p.fwd_post = post
    bwd = []
    for i in range(n_bwd):
        x = rng.random()
        # the first 3 are long GEMMs so that the queue refills right after the D2H sync
        tab = GEMM_BWD if (x < 0.5 or i < 3) else ATTN_BWD if x < 0.6 else ELEM_BWD
        bwd.append(_pick_slot(rng, tab))
    p.bwd = bwd
    p.a_after = 2  # n_bwd >= 4
    p.b_after = max(3, (n_bwd * 2) // 3)
    p.opt = [_pick_slot(rng, [o]) for o in OPT]
    n = cfg["ranks"]
    specs = [COLL_A, COLL_B, COLL_C, COLL_D]
    p.colls = [_make_coll(s, n, rng, seq0 + i, n_bwd) for i, s in enumerate(specs)]
    p.h2d_dur = H2D_BYTES // 25 + int(rng.random() * 2000)  # ~25 GB/s pinned
    p.memset_dur = 2000 + MEMSET_BYTES // 1000
    est = p.h2d_dur + p.memset_dur + sum(s[3] for s in pre + post + bwd + p.opt) + sum(g[1] for g in p.graph)
    p.est_ns = est + p.colls[2].transfer // 4
    return p


# --------------------------------------------------------------------------- rank simulation


class _Rank:
    """Simulates one rank; with ``emit=False`` it only keeps the timeline (for --jobs)."""

    def __init__(self, cfg, r, offset_ns, emit=True):
        self.r = r
        self.emit = emit
        self.n = cfg["ranks"]
        self.pid = 1000 + r
        self.dev = (r % cfg["gpus_per_node"]) if cfg["gpus_per_node"] else 0
        self.offset = offset_ns
        self.abs0 = T0_ABS_NS + offset_ns  # written abs ns = t + abs0
        base = BASE_NS + (r % 2) * 1_000_000_000
        while self.abs0 - base < 1_000_000:  # only with offsets beyond -0.25 s
            base -= 1_000_000_000
        self.base = base
        self.shift = self.abs0 - base  # written relative ns = t + shift
        self.rng = random.Random(cfg["seed"] * 1_000_003 + 7 * r + 1)
        self.rnd = self.rng.random
        self.cpu = 100_000 + int(self.rnd() * 20_000)
        self.s7 = 0
        self.s20 = 0
        self.ext = 0
        self.corr = 1_000 * (1 + r % 3)  # arbitrary starting correlation id
        self.buf = []
        self.cnt = dict(cpu_op=0, user_annotation=0, python_function=0, cuda_runtime=0, cuda_driver=0, kernel=0,
                        gpu_memcpy=0, gpu_memset=0, gpu_user_annotation=0, memory=0, other=0)
        self.n_s = 0
        self.n_f = 0
        self.kernels = 0
        self.kbc = {}
        self.pyid = 0
        self.mem_alloc = 12_884_901_888
        self.mem_reserved = 40_802_189_312
        self.mixed = 0
        self.steps = []
        self.idle = {}
        self.exposed = {}
        self.colls = []
        self.first = None
        self.last = None
        self.stragglers = set(s for (rr, s) in cfg["stragglers"] if rr == r)
        self.straggler_factor = cfg["straggler_factor"]
        self.spid = pid = str(self.pid)
        self.sdev = dev = str(self.dev)
        sub = lambda t: t.replace("{PID}", pid).replace("{DEV}", dev)  # noqa: E731
        self.T_X_HOST = sub(T_X_HOST)
        self.T_X_DEV = sub(T_X_DEV)
        self.T_FLOW = sub(T_FLOW)
        self.T_FLOW_F = sub(T_FLOW_F)
        self.T_MEM = sub(T_MEM)
        self.pg_ranks = "[" + ", ".join(str(i) for i in range(self.n)) + "]"

    # ---- small emitters (not on the hottest path)
    def _xh(self, cat, name_json, s, e, args):
        self.cnt[cat] += 1
        if self.emit:
            sh = self.shift
            self.buf.append(self.T_X_HOST % ((cat, name_json) + divmod(s + sh, 1000) + divmod(e - s, 1000) + (args,)))

    def _xd(self, cat, name_json, tid, s, e, args):
        self.cnt[cat] += 1
        if self.emit:
            sh = self.shift
            self.buf.append(self.T_X_DEV % ((cat, name_json, tid) + divmod(s + sh, 1000) + divmod(e - s, 1000) + (args,)))

    def _flow(self, corr, s_ts, f_ts, tid):
        self.n_s += 1
        self.n_f += 1
        if self.emit:
            sh = self.shift
            self.buf.append(self.T_FLOW % ((corr,) + divmod(s_ts + sh, 1000) + (corr, tid) + divmod(f_ts + sh, 1000)))

    def _pyfunc(self, name, s, e):
        self.pyid += 1
        self._xh("python_function", _J(name), s, e,
                 '"Python parent id": %d, "Python id": %d, "Python thread": 0' % (self.pyid - 1, self.pyid))

    def _mem(self, t, nbytes):
        self.cnt["memory"] += 1
        self.mem_alloc += nbytes
        if self.emit:
            addr = 139_800_000_000_000 + (self.mem_alloc & 0xFFFFFFF) * 512
            self.buf.append(self.T_MEM % (divmod(t + self.shift, 1000) + (addr, nbytes, self.mem_alloc, self.mem_reserved)))

    def _next_ext(self):
        self.ext += 1
        return self.ext

    def _next_corr(self):
        self.corr += 1
        return self.corr

    # ---- stream-7 placement + idle accounting
    def _place(self, l, lat, dur, is_kernel, dep=0, call=None):
        """Place an activity launched at ``l`` on stream 7 (its launch call lasting ``call``; None: a call that
        returns only after the work started).  Returns (l, start)."""
        s7 = self.s7
        if l + lat <= s7:
            start = s7
        else:
            if l < s7:
                l = s7  # nudge: the launch call starts exactly when the stream drains
            start = l + lat
        dep_bound = dep > start
        if dep_bound:
            start = dep
        if self.span_start is None:
            self.span_start = start
        else:
            gap = start - s7
            if gap > 0:
                # issued after the stream drained, and queued no longer than the host took to issue it
                if l >= s7 and (call is None or l + call - s7 >= start - (l + call)):
                    if dep_bound:
                        self.mixed += 1
                    for (a, b) in self.syncs:
                        if a <= s7 < b:
                            self.sync_idle += gap
                            break
                    else:
                        self.host_idle += gap
                else:
                    self.other_idle += gap
        end = start + dur
        self.busy += dur
        self.s7 = end
        (self.k7 if is_kernel else self.m7).append((start, end))
        return l, start

    # ---- a plain kernel launch (hot path)
    def _op(self, slot, gap, dep=0):
        rnd = self.rnd
        opn, kn, kind, base_dur, kargs = slot
        frag, cbid, call_lo, call_rng, kcat = KINDS[kind]
        t = self.cpu + gap
        self.ext = ext = self.ext + 1
        self.corr = corr = self.corr + 1
        call = call_lo + int(rnd() * call_rng)
        lat = call + 1000 + int(rnd() * 1000)
        dur = base_dur + int(rnd() * 800)
        l, ks = self._place(t + 2000 + int(rnd() * 3000), lat, dur, True, dep, call)
        ce = l + call
        oe = ce + 1000 + int(rnd() * 1500)
        self.cpu = oe
        cnt = self.cnt
        cnt["cpu_op"] += 1
        cnt[kcat] += 1
        cnt["kernel"] += 1
        self.n_s += 1
        self.n_f += 1
        self.kernels += 1
        if self.kbc is not None:
            self.kbc[corr] = [ks]
        if self.emit:
            # hot path: an f-string; "%d.%03d" of a value >= 1000 ns is str(v) with a dot before
            # the last 3 digits (every ts here is >= shift > 1e8 ns, every dur >= 2.5 us)
            sh = self.shift
            pid = self.spid
            dev = self.sdev
            ext = str(ext)
            corr = str(corr)
            a = str(t + sh)
            b = str(oe - t)
            c = str(l + sh)
            d = str(call)
            e = str(ks + sh)
            f = str(dur)
            self.buf.append(
                f'  {{\n    "ph": "X", "cat": "cpu_op", "name": {opn}, "pid": {pid}, "tid": 1,\n'
                f'    "ts": {a[:-3]}.{a[-3:]}, "dur": {b[:-3]}.{b[-3:]},\n'
                f'    "args": {{\n      "External id": {ext}, "Record function id": 0, "Ev Idx": {ext}\n    }}\n  }},\n'
                f'  {{\n    "ph": "X", {frag}, "pid": {pid}, "tid": 1,\n'
                f'    "ts": {c[:-3]}.{c[-3:]}, "dur": {d[:-3]}.{d[-3:]},\n'
                f'    "args": {{\n      "External id": {ext}, "cbid": {cbid}, "correlation": {corr}\n    }}\n  }},\n'
                f'  {{\n    "ph": "X", "cat": "kernel", "name": {kn}, "pid": {dev}, "tid": 7,\n'
                f'    "ts": {e[:-3]}.{e[-3:]}, "dur": {f[:-3]}.{f[-3:]},\n'
                f'    "args": {{\n      "External id": {ext}, "queued": 0, "device": {dev}, "context": 1, "stream": 7, '
                f'"correlation": {corr},\n      {kargs}\n    }}\n  }},\n'
                f'  {{\n    "ph": "s", "id": {corr}, "pid": {pid}, "tid": 1, "ts": {c[:-3]}.{c[-3:]},\n'
                f'    "cat": "ac2g", "name": "ac2g"\n  }},\n'
                f'  {{\n    "ph": "f", "id": {corr}, "pid": {dev}, "tid": 7, "ts": {e[:-3]}.{e[-3:]},\n'
                f'    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}')

    def _graph(self, graph):
        rnd = self.rnd
        t = self.cpu + 1000 + int(rnd() * 2000)
        ext = self._next_ext()
        corr = self._next_corr()
        call = 10_000 + int(rnd() * 5000)
        lat = call + 1500 + int(rnd() * 1000)
        kname0, d0, ka0 = graph[0]
        d0 += int(rnd() * 800)
        l, ks = self._place(t + 3000 + int(rnd() * 2000), lat, d0, True, call=call)
        ce = l + call
        oe = ce + 1000 + int(rnd() * 1000)
        self.cpu = oe
        self._xh("cpu_op", _J("CUDAGraph::replay"), t, oe,
                 '"External id": %d, "Record function id": 0, "Ev Idx": %d' % (ext, ext))
        self._xh("cuda_runtime", '"cudaGraphLaunch"', l, ce, '"External id": %d, "cbid": 311, "correlation": %d' % (ext, corr))
        self.n_s += 1
        if self.emit:
            self.buf.append(self.T_FLOW % ((corr,) + divmod(l + self.shift, 1000) + (corr, 7) + divmod(ks + self.shift, 1000)))
        self.n_f += 1
        starts = [ks]
        self._gkernel(kname0, ks, ks + d0, ext, corr, ka0)
        for kname, d, ka in graph[1:]:
            d += int(rnd() * 800)
            _, s = self._place(l, 0, d, True)  # queued behind the previous graph kernel
            starts.append(s)
            self._gkernel(kname, s, s + d, ext, corr, ka)
            self.n_f += 1
            if self.emit:
                self.buf.append(self.T_FLOW_F % ((corr, 7) + divmod(s + self.shift, 1000)))
        if self.kbc is not None:
            self.kbc[corr] = starts

    def _gkernel(self, kname_json, s, e, ext, corr, kargs):
        self.kernels += 1
        self._xd("kernel", kname_json, 7, s, e,
                 '"External id": %d, "queued": 0, "device": %d, "context": 1, "stream": 7, "correlation": %d,\n      %s'
                 % (ext, self.dev, corr, kargs))

    def _copy_async(self, t, op_names, call_name, cbid, cat, dname, nbytes, dur):
        """Nested cpu_ops around a cudaMemcpyAsync / cudaMemsetAsync; device event on stream 7."""
        rnd = self.rnd
        exts = [self._next_ext() for _ in op_names]
        corr = self._next_corr()
        starts = [t + i * (800 + int(rnd() * 700)) for i in range(len(op_names))]
        call = 5000 + int(rnd() * 3000)
        lat = call + 1500 + int(rnd() * 1000)
        l, ds = self._place(starts[-1] + 1500 + int(rnd() * 1500), lat, dur, False, call=call)
        ce = l + call
        e = ce
        ends = []
        for _ in op_names:
            e += 600 + int(rnd() * 900)
            ends.append(e)
        for name, s, e2, x in zip(op_names, starts, reversed(ends), exts):
            self._xh("cpu_op", _J(name), s, e2, '"External id": %d, "Record function id": 0, "Ev Idx": %d' % (x, x))
        self._xh("cuda_runtime", _J(call_name), l, ce,
                 '"External id": %d, "cbid": %d, "correlation": %d' % (exts[-1], cbid, corr))
        self._xd(cat, _J(dname), 7, ds, ds + dur,
                 '"device": %d, "context": 1, "stream": 7, "correlation": %d, "bytes": %d, '
                 '"memory bandwidth (GB/s)": %.6f' % (self.dev, corr, nbytes, nbytes / max(dur, 1)))
        self._flow(corr, l, ds, 7)
        self.cpu = ends[-1]
        return l, ce

    def _item(self):
        """Blocking D2H cudaMemcpy (loss.item()): waits for all queued stream-7 work."""
        rnd = self.rnd
        t = self.cpu + 2000 + int(rnd() * 2000)
        ext = self._next_ext()
        corr = self._next_corr()
        t2 = t + 1000 + int(rnd() * 800)
        c0 = t2 + 1500 + int(rnd() * 1000)
        lat = 4000 + int(rnd() * 1000)
        assert c0 < self.s7, "D2H must start while the GPU is busy"
        dur = 1800 + int(rnd() * 600)
        c0, ds = self._place(c0, lat, dur, False)
        ce = ds + dur + 2000 + int(rnd() * 2000)
        self.syncs.append((c0, ce))
        e2 = ce + 800 + int(rnd() * 800)
        e1 = e2 + 800 + int(rnd() * 800)
        self._xh("cpu_op", '"aten::item"', t, e1, '"External id": %d, "Record function id": 0, "Ev Idx": %d' % (ext, ext))
        self._xh("cpu_op", '"aten::_local_scalar_dense"', t2, e2,
                 '"External id": %d, "Record function id": 0, "Ev Idx": %d' % (ext + 1, ext + 1))
        self.ext += 1
        self._xh("cuda_runtime", '"cudaMemcpy"', c0, ce, '"External id": %d, "cbid": 31, "correlation": %d' % (ext + 1, corr))
        self._xd("gpu_memcpy", '"Memcpy DtoH (Device -> Pageable)"', 7, ds, ds + dur,
                 '"device": %d, "context": 1, "stream": 7, "correlation": %d, "bytes": 4, '
                 '"memory bandwidth (GB/s)": %.6f' % (self.dev, corr, 4 / dur))
        self._flow(corr, c0, ds, 7)
        self.cpu = e1

    def _bare_sync(self, name, cbid, wait_until):
        rnd = self.rnd
        s = self.cpu + 1500 + int(rnd() * 1500)
        corr = self._next_corr()
        e = max(s + 1500 + int(rnd() * 1000), wait_until + 1500 + int(rnd() * 1500))
        self.syncs.append((s, e))
        self._xh("cuda_runtime", _J(name), s, e, '"cbid": %d, "correlation": %d' % (cbid, corr))
        self.cpu = e

    def _bare_call(self, name, cbid):
        rnd = self.rnd
        s = self.cpu + 1000 + int(rnd() * 1500)
        corr = self._next_corr()
        e = s + 1500 + int(rnd() * 1000)
        self._xh("cuda_runtime", _J(name), s, e, '"cbid": %d, "correlation": %d' % (cbid, corr))
        self.cpu = e

    def _coll(self, c, step):
        """NCCL collective (generator): yields the kernel start, receives the common end."""
        rnd = self.rnd
        t = self.cpu + 1500 + int(rnd() * 2000)
        ext = self._next_ext()
        corr = self._next_corr()
        l = t + 4000 + int(rnd() * 3000)
        call = 4000 + int(rnd() * 3000)
        lat = call + 2000 + int(rnd() * 1000)
        start = max(l + lat, self.s20)
        end = yield start
        assert end > start
        self.s20 = end
        ce = l + call
        ers = ce + 800 + int(rnd() * 800)
        ere = ers + 1200 + int(rnd() * 800)
        oe = ere + 1500 + int(rnd() * 1500)
        self.cpu = oe
        cargs = ('"Collective name": "%s", "In msg nelems": %d, "Out msg nelems": %d, "In split size": "[]", '
                 '"Out split size": "[]", "Global rank start": 0, "Global rank stride": 1, "Group size": %d, '
                 '"Process Group Name": "0", "Process Group Description": "default_pg", "Process Group Ranks": "%s", '
                 '"dtype": "%s", "Seq": %d, "Rank": %d'
                 % (c.name, c.in_n, c.out_n, self.n, self.pg_ranks, c.dtype, c.seq, self.r))
        self._xh("cpu_op", '"record_param_comms"', t, oe,
                 '"External id": %d, "Record function id": 0, "Ev Idx": %d, %s' % (ext, ext, cargs))
        self._xh("cuda_runtime", '"cudaLaunchKernel"', l, ce, '"External id": %d, "cbid": 211, "correlation": %d' % (ext, corr))
        corr2 = self._next_corr()
        self._xh("cuda_runtime", '"cudaEventRecord"', ers, ere, '"External id": %d, "cbid": 135, "correlation": %d' % (ext, corr2))
        self.kernels += 1
        self._xd("kernel", _J(c.kname), COMM_STREAM, start, end,
                 '"External id": %d, "queued": 0, "device": %d, "context": 1, "stream": 20, "correlation": %d, '
                 '"registers per thread": 96, "shared memory": 0, "blocks per SM": 0.181818, "warps per SM": 3.636364, '
                 '"grid": [24, 1, 1], "block": [640, 1, 1], "est. achieved occupancy %%": 0,\n      %s'
                 % (ext, self.dev, corr, cargs))
        self._flow(corr, l, start, COMM_STREAM)
        if self.kbc is not None:
            self.kbc[corr] = [start]
        self.step_colls.append((c, start, end, corr))
        return end

    # ---- one step (generator: yields once per collective)
    def step(self, p):
        rnd = self.rnd
        self.buf = []
        self.syncs = []
        self.k7 = []
        self.m7 = []
        self.step_colls = []
        self.span_start = None
        self.busy = self.host_idle = self.sync_idle = self.other_idle = 0
        t0 = self.cpu
        self.cpu = t0 + 1000 + int(rnd() * 2000)
        if p.step in self.stragglers:
            s = self.cpu
            e = s + int((self.straggler_factor - 1.0) * p.est_ns)
            self._pyfunc("torch/utils/data/dataloader.py(631): __next__", s, e)
            self.cpu = e + 1000
        # inputs to device
        l, _ = self._copy_async(self.cpu, ["aten::to", "aten::_to_copy", "aten::copy_"], "cudaMemcpyAsync", 41,
                                "gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", H2D_BYTES, p.h2d_dur)
        self._mem(l - 500, H2D_BYTES)
        self._copy_async(self.cpu + 1000 + int(rnd() * 1000), ["aten::zero_"], "cudaMemsetAsync", 51,
                         "gpu_memset", "Memset (Device)", MEMSET_BYTES, p.memset_dur)
        # forward
        fs = self.cpu + 1000 + int(rnd() * 1000)
        self.cpu = fs + 1000
        lb = p.lb_range
        for i, slot in enumerate(p.fwd_pre):
            if lb is not None and i == lb[0]:
                lbs = self.cpu + 1000
                self.cpu = lbs
            if lb is not None and lb[0] <= i < lb[1]:
                self._op(slot, 40_000 + int(rnd() * 40_000))
            else:
                self._op(slot, 1000 + int(rnd() * 2000))
            if lb is not None and i == lb[1] - 1:
                lbe = self.cpu + 1000
                self._pyfunc("model.py(57): _python_heavy_block", lbs, lbe)
                self.cpu = lbe
        self._graph(p.graph)
        for slot in p.fwd_post:
            self._op(slot, 1000 + int(rnd() * 2000))
        fe = self.cpu + 1000 + int(rnd() * 1000)
        self._pyfunc("nn.Module: GPT_0", fs, fe)
        self.cpu = fe
        # loss.item()
        self._item()
        # backward
        bs = self.cpu + 1000 + int(rnd() * 1000)
        self.cpu = bs + 1000
        for i, slot in enumerate(p.bwd):
            self._op(slot, 1000 + int(rnd() * 2000))
            if i == p.a_after:
                yield from self._coll(p.colls[0], p.step)
            if i == p.b_after:
                yield from self._coll(p.colls[1], p.step)
        c_end = yield from self._coll(p.colls[2], p.step)
        self._mem(self.cpu + 500, 67_108_864)
        be = self.cpu + 1000 + int(rnd() * 1000)
        self._pyfunc("torch/autograd/__init__.py(266): backward", bs, be)
        self.cpu = be
        # optimizer: stream 7 waits for the allreduce
        self._bare_call("cudaStreamWaitEvent", 147)
        os_ = self.cpu + 1000 + int(rnd() * 1000)
        self.cpu = os_ + 1000
        for i, slot in enumerate(p.opt):
            self._op(slot, 1000 + int(rnd() * 2000), c_end if i == 0 else 0)
        self._mem(self.cpu + 500, -67_108_864 - H2D_BYTES)
        oe = self.cpu + 1000 + int(rnd() * 1000)
        self._xh("user_annotation", '"Optimizer.step#AdamW.step"', os_, oe, '"External id": %d, "Record function id": 0, '
                 '"Ev Idx": %d' % (self._next_ext(), self.ext))
        self.cpu = oe
        self._bare_sync("cudaStreamSynchronize", 131, self.s7)
        # loss all-reduce for logging (fully exposed: stream 7 is drained), then wait for it
        yield from self._coll(p.colls[3], p.step)
        if p.device_sync:
            self._bare_sync("cudaDeviceSynchronize", 165, max(self.s7, self.s20))
        else:
            self._bare_sync("cudaStreamSynchronize", 131, self.s20)
        t_end = self.cpu + 1000 + int(rnd() * 2000)
        self._xh("user_annotation", _J("ProfilerStep#%d" % p.step), t0, t_end,
                 '"External id": %d, "Record function id": 0, "Ev Idx": %d' % (self._next_ext(), self.ext))
        self.cpu = t_end + 200 + int(rnd() * 800)
        self._finish_step(p, t0, t_end)

    def _finish_step(self, p, t0, t_end):
        a0 = self.abs0
        span0, span1 = self.span_start, self.s7
        assert self.busy + self.host_idle + self.sync_idle + self.other_idle == span1 - span0
        self.steps.append({"step": p.step, "start_ns": t0 + a0, "end_ns": t_end + a0,
                           "gpu_start_ns": span0 + a0, "gpu_end_ns": span1 + a0,
                           "true_start_ns": t0 + T0_ABS_NS, "true_end_ns": t_end + T0_ABS_NS})
        self.idle[str(p.step)] = {"compute_stream_busy_ns": self.busy, "host_bound_idle_ns": self.host_idle,
                                  "sync_idle_ns": self.sync_idle, "other_idle_ns": self.other_idle}
        exposed = 0
        k7, m7 = self.k7, self.m7
        for (c, s, e, corr) in self.step_colls:
            ov = 0
            for (ks, ke) in k7:
                if ke > s and ks < e:
                    ov += min(e, ke) - max(s, ks)
            for (ms, me) in m7:
                if me > s and ms < e:
                    raise AssertionError("NCCL kernel overlaps a stream-7 memcpy/memset")
            exposed += (e - s) - ov
            self.colls.append({"seq": c.seq, "name": c.name, "bytes": c.in_n * c.esize, "group_size": self.n,
                               "kernel_start_ns": s + a0, "kernel_end_ns": e + a0, "step": p.step,
                               "correlation": corr, "exposed_ns": (e - s) - ov})
        self.exposed[str(p.step)] = exposed
        lo = min(t0, span0)
        hi = max(t_end, span1, self.s20)
        self.first = lo if self.first is None else min(self.first, lo)
        self.last = hi if self.last is None else max(self.last, hi)
        if self.kbc is not None and self.kernels > KBC_LIMIT:
            self.kbc = None

    # ---- file framing
    def header(self):
        n = self.n
        dp = ('  "deviceProperties": [\n    {\n      "id": %d, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912,\n'
              '      "computeMajor": 9, "computeMinor": 0,\n      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,\n'
              '      "regsPerBlock": 65536, "warpSize": 32,\n      "sharedMemPerBlock": 49152, "numSms": 132,\n'
              '      "regsPerMultiprocessor": 65536, "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472\n'
              '    }\n  ],\n' % self.dev)
        di = ('  "distributedInfo": {"backend": "nccl", "rank": %d, "world_size": %d, "pg_count": 1, "pg_config": '
              '[{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": %d, "ranks": %s}], '
              '"nccl_version": "2.21.5"},\n' % (self.r, n, n, self.pg_ranks))
        return '{\n  "schemaVersion": 1,\n' + dp + di + '  "traceEvents": [\n'

    def metadata(self, first_t):
        ts = divmod(first_t + self.shift, 1000)
        pid, dev = self.pid, self.dev
        m = [
            ("process_name", pid, 0, '"name": "python3"'),
            ("process_labels", pid, 0, '"labels": "CPU"'),
            ("process_sort_index", pid, 0, '"sort_index": %d' % pid),
            ("thread_name", pid, 1, '"name": "thread 1 (python3)"'),
            ("thread_sort_index", pid, 1, '"sort_index": 1'),
            ("process_name", dev, 0, '"name": "python3"'),
            ("process_labels", dev, 0, '"labels": "GPU %d"' % dev),
            ("process_sort_index", dev, 0, '"sort_index": %d' % (5000000 + dev)),
            ("thread_name", dev, 7, '"name": "stream 7"'),
            ("thread_sort_index", dev, 7, '"sort_index": 7'),
            ("thread_name", dev, 20, '"name": "stream 20"'),
            ("thread_sort_index", dev, 20, '"sort_index": 20'),
        ]
        return ",\n".join(T_META % ((name,) + ts + (p, t, a)) for name, p, t, a in m)

    def trailer(self, trace_name):
        return ('\n  ],\n  "traceName": %s,\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": %d\n}\n'
                % (_J(trace_name), self.base))

    def truth(self):
        a0 = self.abs0
        c = dict(self.cnt)
        t = {
            "base_time_ns": self.base,
            "clock_offset_ns": self.offset,
            "host_pid": self.pid,
            "device": self.dev,
            "event_counts": c,
            "flow_events": {"s": self.n_s, "f": self.n_f},
            "steps": self.steps,
            "launch_links": c["kernel"] + c["gpu_memcpy"] + c["gpu_memset"],
            "first_event_abs_ns": self.first + a0,
            "last_event_end_abs_ns": self.last + a0,
            "collectives": self.colls,
            "idle": self.idle,
            "exposed_comm_ns": self.exposed,
            "mixed_cause_gaps": self.mixed,
        }
        if self.kbc is not None and self.kernels <= KBC_LIMIT:
            t["kernels_by_correlation"] = {str(k): [x + a0 for x in v] for k, v in self.kbc.items()}
        return t


# --------------------------------------------------------------------------- driver


def _offsets(ranks, seed, clock_offsets_us, max_clock_offset_us):
    if clock_offsets_us is not None:
        offs = [0] * ranks
        if isinstance(clock_offsets_us, dict):
            for r, us in clock_offsets_us.items():
                offs[int(r)] = int(round(float(us) * 1000))
        else:
            for r, us in enumerate(clock_offsets_us):
                if r < ranks:
                    offs[r] = int(round(float(us) * 1000))
        return offs
    rng = random.Random(seed * 31 + 5)
    m = int(max_clock_offset_us * 1000)
    return [0] + [int(rng.uniform(-m, m)) for _ in range(1, ranks)]


class _Writer:
    """Background writer thread.  zlib and file writes release the GIL, so compression
    overlaps event generation; chunks of about 1 MB per rank are handed over."""

    CHUNK = 1 << 20

    def __init__(self):
        self.q = queue.Queue(maxsize=16)
        self.err = None
        self.pending = {}
        self.th = threading.Thread(target=self._loop, name="synthetic-writer", daemon=True)
        self.th.start()

    def _loop(self):
        while True:
            item = self.q.get()
            if item is None:
                return
            f, data = item
            if self.err is None:
                try:
                    f.write(data)
                except BaseException as e:  # re-raised in the main thread
                    self.err = e

    def write(self, f, data, flush=False):
        if self.err is not None:
            raise self.err
        lst = self.pending.setdefault(f, [0, []])
        lst[1].append(data)
        lst[0] += len(data)
        if flush or lst[0] >= self.CHUNK:
            self.q.put((f, b"".join(lst[1])))
            lst[0], lst[1] = 0, []

    def close(self):
        for f, (n, parts) in self.pending.items():
            if parts:
                self.q.put((f, b"".join(parts)))
        self.pending = {}
        self.q.put(None)
        self.th.join()
        if self.err is not None:
            raise self.err


class _NullFile:
    def write(self, data):
        return len(data)

    def close(self):
        pass


def _run(cfg, out_dir, write_ranks, progress=False):
    """Simulate all ranks in lockstep; write files for ``write_ranks``.  Returns (truth per written rank, windows)."""
    n = cfg["ranks"]
    offs = cfg["clock_offsets_ns"]
    ranks = [_Rank(cfg, r, offs[r], emit=(r in write_ranks)) for r in range(n)]
    ext = ".pt.trace.json.gz" if cfg["gzip"] else ".pt.trace.json"
    files, raws, nbytes, paths = {}, {}, {}, {}
    writer = _Writer()
    for r in write_ranks:
        path = os.path.join(out_dir or "", "rank-%d%s" % (r, ext))
        paths[r] = path
        if out_dir is None:  # size probe
            raws[r] = files[r] = _NullFile()
            continue
        raws[r] = raw = open(path, "wb")
        files[r] = gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=cfg["compresslevel"], mtime=0) \
            if cfg["gzip"] else raw
    for r in write_ranks:
        head = (ranks[r].header() + ranks[r].metadata(ranks[r].cpu)).encode()
        writer.write(files[r], head)
        nbytes[r] = len(head)
    nsteps = cfg["steps"]
    seq = 1
    idx = 0
    windows = {}
    t_start = time.time()
    probe = write_ranks[0] if write_ranks else None
    while idx < nsteps:
        p = _make_plan(cfg, idx, seq)
        seq += len(p.colls)
        gens = [rk.step(p) for rk in ranks]
        pending = [next(g) for g in gens]
        for c in p.colls:
            end = max(pending) + c.transfer
            nxt = []
            for g in gens:
                try:
                    nxt.append(g.send(end))
                except StopIteration:
                    nxt.append(None)
            pending = nxt
        assert all(x is None for x in pending)
        starts = [rk.steps[-1]["true_start_ns"] for rk in ranks]
        ends = [rk.steps[-1]["true_end_ns"] for rk in ranks]
        windows[str(p.step)] = [min(starts), max(ends)]
        for r in write_ranks:
            rk = ranks[r]
            data = (",\n" + ",\n".join(rk.buf)).encode()
            writer.write(files[r], data)
            nbytes[r] += len(data)
            rk.buf = []
        idx += 1
        if progress and idx % 200 == 0 and probe is not None:
            el = time.time() - t_start
            mb = nbytes[probe] / 1e6
            print("  step %d/%d: %.1f MB/rank raw, %.1f MB/s" % (idx, nsteps, mb, mb * len(write_ranks) / max(el, 1e-9)),
                  file=sys.stderr)
    out = {}
    for r in write_ranks:
        tail = ranks[r].trailer("rank-%d.pt.trace.json" % r).encode()
        writer.write(files[r], tail)
        nbytes[r] += len(tail)
    writer.close()
    for r in write_ranks:
        files[r].close()
        raws[r].close()
        t = ranks[r].truth()
        t["raw_bytes"] = nbytes[r]
        t["file"] = os.path.basename(paths[r])
        t["file_bytes"] = os.path.getsize(paths[r]) if out_dir is not None else 0
        out[r] = t
    return out, windows, idx


def _worker(args):
    cfg, out_dir, write_ranks = args
    return _run(cfg, out_dir, write_ranks)


def generate_run(out_dir, ranks=8, steps=4, kernels_per_step=40, target_mb_per_rank=None, seed=0, gzip_output=True,
                 compresslevel=None, stragglers=(), straggler_factor=3.0, clock_offsets_us=None,
                 max_clock_offset_us=500.0, first_step=10, gpus_per_node=0, launch_bound_steps=None,
                 device_sync_steps=None, jobs=1, progress=False, write_truth=True):
    """Generate a synthetic run into ``out_dir``; returns the truth dict (also written to truth.json).

    stragglers: iterable of (rank, step_number).  clock_offsets_us: list (per rank, from rank 0) or
    dict {rank: us}; unspecified ranks get 0.  launch_bound_steps / device_sync_steps: iterables of
    step numbers (default: index % 3 == 1 / index % 2 == 1).  compresslevel: default 1 with a
    target size, else 6.  jobs > 1 writes ranks in parallel processes (each re-simulates the
    cheap timeline of all ranks, so results are identical).
    """
    if kernels_per_step < 20:
        raise ValueError("kernels_per_step must be >= 20")
    if ranks < 1:
        raise ValueError("ranks must be >= 1")
    os.makedirs(out_dir, exist_ok=True)
    stragglers = [(int(r), int(s)) for r, s in stragglers]
    for r, s in stragglers:
        if not 0 <= r < ranks:
            raise ValueError("straggler rank %d out of range" % r)
    if compresslevel is None:
        compresslevel = 1 if target_mb_per_rank else 6
    cfg = {
        "ranks": ranks, "steps": steps, "kernels_per_step": kernels_per_step, "seed": seed,
        "target_mb_per_rank": target_mb_per_rank,
        "target_bytes": int(target_mb_per_rank * 1e6) if target_mb_per_rank else None,
        "gzip": bool(gzip_output), "compresslevel": compresslevel, "stragglers": stragglers,
        "straggler_factor": straggler_factor, "first_step": first_step, "gpus_per_node": gpus_per_node,
        "launch_bound_idx": None if launch_bound_steps is None else set(s - first_step for s in launch_bound_steps),
        "device_sync_idx": None if device_sync_steps is None else set(s - first_step for s in device_sync_steps),
        "clock_offsets_ns": _offsets(ranks, seed, clock_offsets_us, max_clock_offset_us),
    }
    if cfg["target_bytes"] is not None:
        # size probe: 12 steps (two scenario cycles) of rank 0, not written anywhere
        npr = 12
        pr, _, _ = _run(dict(cfg, steps=npr, gzip=False), None, [0])
        pr1, _, _ = _run(dict(cfg, steps=1, gzip=False), None, [0])
        per_step = (pr[0]["raw_bytes"] - pr1[0]["raw_bytes"]) / (npr - 1)
        fixed = pr1[0]["raw_bytes"] - per_step
        cfg["steps"] = max(steps, int(math.ceil((cfg["target_bytes"] - fixed) / per_step)))
    for r, s in stragglers:
        if not first_step <= s < first_step + cfg["steps"]:
            raise ValueError("straggler step %d outside the generated steps %d..%d"
                             % (s, first_step, first_step + cfg["steps"] - 1))
    jobs = max(1, min(int(jobs), ranks))
    if jobs == 1:
        per_rank, windows, nsteps = _run(cfg, out_dir, list(range(ranks)), progress)
    else:
        import multiprocessing as mp
        groups = [list(range(ranks))[j::jobs] for j in range(jobs)]
        with mp.Pool(jobs) as pool:
            res = pool.map(_worker, [(cfg, out_dir, g) for g in groups])
        per_rank, windows, nsteps = {}, None, None
        for pr, w, ns in res:
            per_rank.update(pr)
            windows, nsteps = w, ns
    truth = {
        "generator": {
            "name": "steplens tests/synthetic.py", "version": 1, "ranks": ranks, "steps": nsteps,
            "steps_requested": steps, "first_step": first_step, "kernels_per_step": kernels_per_step,
            "target_mb_per_rank": target_mb_per_rank, "seed": seed, "gzip": bool(gzip_output),
            "compresslevel": compresslevel if gzip_output else None, "straggler_factor": straggler_factor,
            "max_clock_offset_us": max_clock_offset_us, "gpus_per_node": gpus_per_node,
            "t0_abs_ns": T0_ABS_NS, "compute_stream": COMPUTE_STREAM, "comm_stream": COMM_STREAM,
        },
        "world_size": ranks,
        "ranks": {str(r): per_rank[r] for r in range(ranks)},
        "stragglers": [{"rank": r, "step": s} for r, s in stragglers],
        "step_true_duration_ns": {k: v[1] - v[0] for k, v in windows.items()},
        "step_true_window_ns": windows,
        "scenarios": {
            "launch_bound_steps": [first_step + i for i in range(nsteps)
                                   if (i in cfg["launch_bound_idx"] if cfg["launch_bound_idx"] is not None else i % 3 == 1)],
            "device_sync_steps": [first_step + i for i in range(nsteps)
                                  if (i in cfg["device_sync_idx"] if cfg["device_sync_idx"] is not None else i % 2 == 1)],
        },
    }
    if write_truth:
        with open(os.path.join(out_dir, "truth.json"), "w") as f:
            json.dump(truth, f, indent=1)
            f.write("\n")
    return truth


def _parse_straggler(s):
    try:
        r, st = s.split(":")
        return int(r), int(st)
    except ValueError:
        raise argparse.ArgumentTypeError("expected RANK:STEP, got %r" % s)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate synthetic multi-rank Kineto traces with exact ground truth.")
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4, help="number of steps (minimum when --target-mb-per-rank is set)")
    ap.add_argument("--kernels-per-step", type=int, default=40, help="compute-stream kernels per step (>= 20)")
    ap.add_argument("--target-mb-per-rank", type=float, default=None,
                    help="add steps until each rank's raw (uncompressed) JSON reaches about this many MB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-gzip", action="store_true")
    ap.add_argument("--compresslevel", type=int, default=None, help="gzip level (default 1 with a target size, else 6)")
    ap.add_argument("--straggler", type=_parse_straggler, nargs="+", action="extend", default=[], metavar="RANK:STEP")
    ap.add_argument("--straggler-factor", type=float, default=3.0)
    ap.add_argument("--clock-offset-us", nargs="+", default=None, metavar="US|R:US",
                    help="per-rank clock offsets in us: plain values from rank 0 on, or R:US items; others 0")
    ap.add_argument("--max-clock-offset-us", type=float, default=500.0, help="range of random offsets (default)")
    ap.add_argument("--first-step", type=int, default=10)
    ap.add_argument("--gpus-per-node", type=int, default=0, help="device id = rank %% G (default 0: all device 0)")
    ap.add_argument("--jobs", type=int, default=1, help="write ranks in this many processes")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    offs = None
    if a.clock_offset_us is not None:
        if all(":" in x for x in a.clock_offset_us):
            offs = {int(x.split(":")[0]): float(x.split(":")[1]) for x in a.clock_offset_us}
        elif not any(":" in x for x in a.clock_offset_us):
            offs = [float(x) for x in a.clock_offset_us]
        else:
            ap.error("--clock-offset-us: use either plain values or R:US items")
    t = time.time()
    try:
        truth = generate_run(a.out_dir, ranks=a.ranks, steps=a.steps, kernels_per_step=a.kernels_per_step,
                             target_mb_per_rank=a.target_mb_per_rank, seed=a.seed, gzip_output=not a.no_gzip,
                             compresslevel=a.compresslevel, stragglers=a.straggler,
                             straggler_factor=a.straggler_factor, clock_offsets_us=offs,
                             max_clock_offset_us=a.max_clock_offset_us, first_step=a.first_step,
                             gpus_per_node=a.gpus_per_node, jobs=a.jobs, progress=not a.quiet)
    except ValueError as e:
        ap.error(str(e))
    el = time.time() - t
    if not a.quiet:
        raw = sum(v["raw_bytes"] for v in truth["ranks"].values())
        disk = sum(v["file_bytes"] for v in truth["ranks"].values())
        print("wrote %d ranks x %d steps to %s: %.1f MB raw, %.1f MB on disk, %.2f s (%.1f MB/s raw)"
              % (a.ranks, truth["generator"]["steps"], a.out_dir, raw / 1e6, disk / 1e6, el, raw / 1e6 / max(el, 1e-9)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

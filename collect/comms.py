"""One record per `deepspeed.comm` call, timed per call by the collector itself.

DeepSpeed's comms logger cannot be used for this: since 0.18.3 each logged latency is the running total
of every earlier call with the same name (deepspeed-artifacts.md pitfall 2), and an op its bandwidth
formula does not know (all_gather_object, monitored_barrier) makes it call exit(0) (pitfall 4). So the
collector wraps the ops in `deepspeed.comm` itself, and keeps DeepSpeed's logger away from the ops that
would end the job.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path


# The functions of deepspeed/comm/comm.py that carry @timed_op (DeepSpeed 0.19.8): the primitive ops.
# Helpers such as allgather_fn and reduce_scatter_fn call these, so each call is recorded once.
TIMED_OPS = (
    "broadcast", "broadcast_object_list", "all_gather", "all_gather_object", "reduce_scatter_tensor",
    "all_gather_into_tensor", "all_to_all_single", "all_to_all", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "gather", "scatter", "barrier", "monitored_barrier", "reduce", "reduce_scatter",
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced",
)
# Ops `calc_bw_log` knows (deepspeed/utils/comms_logging.py); any other makes the logger call exit(0).
DEEPSPEED_LOGGER_OPS = frozenset((
    "all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_reduce", "all_reduce_coalesced", "inference_all_reduce", "send", "recv",
    "isend", "irecv", "batch_isend_irecv", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
    "barrier",
))
# Point-to-point ops issued asynchronously: waiting on them inside the wrapper could deadlock (a send
# whose receive the peer posts later), so their latency is the time to issue them.
P2P_ASYNC_OPS = frozenset(("isend", "irecv", "batch_isend_irecv"))

# The argument whose size DeepSpeed records as msg_size, first match (deepspeed/comm/utils.py get_tensor_position).
MESSAGE_ARGS = ("tensor", "tensors", "input_list", "input_tensor_list", "p2p_op_list")

_COMM_DIR = None  # deepspeed/comm, skipped when looking for the caller


def _original(wrapper):
    """The function @timed_op wrapped (its signature says where the tensor and group are)."""
    try:
        return inspect.getclosurevars(wrapper).nonlocals.get("func", wrapper)
    except (TypeError, ValueError):
        return wrapper


def message_bytes(arguments: dict) -> int:
    """msg_size as DeepSpeed's get_msg_size_from_args computes it, from the call's bound arguments (without
    its two inspect.signature calls per op)."""
    for name in MESSAGE_ARGS:
        if (value := arguments.get(name)) is not None:
            if isinstance(value, list):  # list ops sum their tensors; P2POp objects wrap theirs
                return sum(t.element_size() * t.nelement() for t in (getattr(x, "tensor", x) for x in value))
            return value.element_size() * value.nelement()
    return 0


def caller_name(frame) -> str | None:
    """First function outside deepspeed/comm and this file, e.g. allreduce_bucket."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_COMM_DIR) and filename != __file__:
            return frame.f_code.co_name
        frame = frame.f_back
    return None


class CommsRecorder:
    """Wraps the ops of `deepspeed.comm` (module and `deepspeed.comm.comm`) while installed."""

    def __init__(self, collector, synchronize: bool):
        global _COMM_DIR
        import deepspeed.comm as ds_comm
        import deepspeed.comm.comm as ds_comm_impl
        from deepspeed.accelerator import get_accelerator

        _COMM_DIR = str(Path(ds_comm_impl.__file__).parent) + os.sep
        self.collector = collector
        self.modules = (ds_comm, ds_comm_impl)
        self.accelerator = get_accelerator()
        # Host ops (gloo on CPU) finish inside the call; device ops are queued and need a sync to time.
        self.device_queued = self.accelerator.device_name() != "cpu"
        self.synchronize = synchronize
        self.get_world_size = ds_comm.get_world_size
        self.logger = ds_comm_impl.comms_logger
        self.saved: list[tuple[object, str, object]] = []
        self.group_sizes: dict[int, int] = {}

    def install(self) -> None:
        for name in TIMED_OPS:
            current = getattr(self.modules[1], name, None)
            if current is None:
                continue
            wrapped = self._wrap(name, current)
            for module in self.modules:
                if getattr(module, name, None) is current:
                    self.saved.append((module, name, current))
                    setattr(module, name, wrapped)
        append = self.logger.append
        self.saved.append((self.logger, "append", None))

        def append_known_ops(raw_name, record_name, latency, msg_size):
            if raw_name in DEEPSPEED_LOGGER_OPS:  # others would exit(0) inside calc_bw_log
                append(raw_name, record_name, latency, msg_size)

        self.logger.append = append_known_ops

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.saved):
            if original is None:
                delattr(owner, name)  # the instance attribute shadowing CommsLogger.append
            else:
                setattr(owner, name, original)
        self.saved.clear()

    def _wrap(self, name: str, op):
        signature = inspect.signature(_original(op))
        collector = self.collector

        def timed(*args, **kwargs):
            if not collector.active("comms"):
                return op(*args, **kwargs)
            wall = time.time_ns()
            start = time.perf_counter_ns()
            result = op(*args, **kwargs)
            waited = collector.guard("comms", self._wait, name, result)
            latency = time.perf_counter_ns() - start
            collector.guard("comms", self._record, name, signature, args, kwargs, wall, latency, bool(waited),
                            sys._getframe(1))
            return result

        timed.__name__ = name
        timed.__wrapped__ = op
        return timed

    def _wait(self, name: str, result) -> bool:
        """Make the timed span cover the transfer; True when that forced a synchronization."""
        if not self.synchronize or name in P2P_ASYNC_OPS:
            return False
        forced = False
        if hasattr(result, "wait"):  # async_op=True: collectives run in the same order on every rank
            result.wait()
            forced = True
        if self.device_queued:
            self.accelerator.synchronize()
            forced = True
        return forced

    def _record(self, name, signature, args, kwargs, wall, latency, waited, frame) -> None:
        bound = signature.bind_partial(*args, **kwargs).arguments
        group = bound.get("group")
        key = id(group)
        if key not in self.group_sizes:
            self.group_sizes[key] = self.get_world_size(group)
        # Without a wait, the span covers the transfer only for a blocking host op (gloo), or a device op that
        # DeepSpeed's logger synchronized; otherwise it is the time to issue the op.
        returned_done = not bound.get("async_op") and (not self.device_queued or self.logger.enabled)
        issue_only = name in P2P_ASYNC_OPS or not (waited or returned_done)
        self.collector.record_comm({
            "op": name, "caller": caller_name(frame), "ts_ns": wall,
            "msg_bytes": message_bytes(bound), "group_size": self.group_sizes[key],
            "latency_ns": latency, "latency_origin": "issue_only" if issue_only else "measured",
            # DeepSpeed's own logger also synchronizes queued device work when it is on.
            "synchronized": waited or (self.device_queued and self.logger.enabled),
        })

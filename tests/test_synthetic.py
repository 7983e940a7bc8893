"""Self-consistency checks of the synthetic trace generator (tests/synthetic.py).

The checks re-derive every truth number from the parsed trace files with an independent
implementation of the definitions in synthetic.py's docstring.
"""
import gzip
import json
import os
import re
import sys
from collections import Counter, defaultdict

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic import generate_run, main  # noqa: E402

TOP_KEYS = ["schemaVersion", "deviceProperties", "distributedInfo", "traceEvents", "traceName",
            "displayTimeUnit", "baseTimeNanoseconds"]
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"}
NUM_RE = re.compile(r'"(ts|dur)": (-?[0-9.eE+]+)')


def _read(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return f.read().decode()


def _ns(x):
    return round(x * 1000)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn")
    truth = generate_run(str(out), ranks=3, steps=6, kernels_per_step=20, seed=3, stragglers=[(1, 12)])
    traces = {}
    for r in range(3):
        text = _read(str(out / ("rank-%d.pt.trace.json.gz" % r)))
        traces[r] = (text, json.loads(text))
    return out, truth, traces


def test_truth_file_and_layout(run):
    out, truth, traces = run
    assert json.loads((out / "truth.json").read_text()) == truth
    assert truth["world_size"] == 3 and set(truth["ranks"]) == {"0", "1", "2"}
    assert truth["ranks"]["0"]["clock_offset_ns"] == 0
    for r, (text, d) in traces.items():
        assert list(d) == TOP_KEYS
        rt = truth["ranks"][str(r)]
        assert d["baseTimeNanoseconds"] == rt["base_time_ns"] and rt["base_time_ns"] % 1_000_000_000 == 0
        assert d["distributedInfo"]["rank"] == r and d["distributedInfo"]["world_size"] == 3
        assert rt["raw_bytes"] == len(text.encode())
        # every ts/dur is written with exactly 3 decimals
        nums = NUM_RE.findall(text)
        assert nums and all(re.fullmatch(r"\d+\.\d{3}", v) for _, v in nums)
        n_ts = sum(1 for e in d["traceEvents"] if "ts" in e)
        n_dur = sum(1 for e in d["traceEvents"] if "dur" in e)
        assert Counter(k for k, _ in nums) == Counter(ts=n_ts, dur=n_dur)
        for e in d["traceEvents"]:
            assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
            assert 0 <= e["ts"] < 1e7


def test_event_counts_and_flows(run):
    _, truth, traces = run
    for r, (_, d) in traces.items():
        rt = truth["ranks"][str(r)]
        counts = Counter()
        flows = Counter()
        s_ids, f_ids = Counter(), Counter()
        for e in d["traceEvents"]:
            if e["ph"] in ("X", "i"):
                counts["memory" if e["cat"] == "cpu_instant_event" else e["cat"]] += 1
            elif e["ph"] in ("s", "f"):
                flows[e["ph"]] += 1
                assert e["cat"] == "ac2g"
                (s_ids if e["ph"] == "s" else f_ids)[e["id"]] += 1
        expected = {k: v for k, v in rt["event_counts"].items() if v}
        assert dict(counts) == expected
        assert dict(flows) == rt["flow_events"]
        assert set(s_ids) == set(f_ids) and max(s_ids.values()) == 1
        n_steps = len(rt["steps"])  # one 3-kernel graph launch per step
        assert sorted(Counter(f_ids.values()).items()) == [(1, len(f_ids) - n_steps), (3, n_steps)]
        # launch links by correlation
        rt_corr = {e["args"]["correlation"] for e in d["traceEvents"]
                   if e["ph"] == "X" and e["cat"] in ("cuda_runtime", "cuda_driver")}
        dev = [e for e in d["traceEvents"] if e["ph"] == "X" and e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")]
        assert sum(1 for e in dev if e["args"]["correlation"] in rt_corr) == rt["launch_links"] == len(dev)
        # kernels_by_correlation
        B = d["baseTimeNanoseconds"]
        kbc = defaultdict(list)
        for e in dev:
            if e["cat"] == "kernel":
                kbc[str(e["args"]["correlation"])].append(B + _ns(e["ts"]))
        assert {k: sorted(v) for k, v in kbc.items()} == {k: sorted(v) for k, v in rt["kernels_by_correlation"].items()}
        xs = [e for e in d["traceEvents"] if e["ph"] in ("X", "i")]
        assert min(B + _ns(e["ts"]) for e in xs) == rt["first_event_abs_ns"]
        assert max(B + _ns(e["ts"]) + _ns(e.get("dur", 0)) for e in xs) == rt["last_event_end_abs_ns"]


def test_slices_nest(run):
    _, _, traces = run
    for r, (_, d) in traces.items():
        by_thread = defaultdict(list)
        for e in d["traceEvents"]:
            if e["ph"] == "X":
                s = _ns(e["ts"])
                by_thread[(e["pid"], e["tid"])].append((s, -(_ns(e["dur"])), e["name"]))
        assert set(by_thread) == {(1000 + r, 1), (0, 7), (0, 20)}
        for key, evs in by_thread.items():
            evs.sort()
            stack = []
            for s, negd, name in evs:
                end = s - negd
                while stack and stack[-1] <= s:
                    stack.pop()
                assert not stack or end <= stack[-1], (key, name, s)
                if key[1] != 1:
                    assert not stack, "device streams are sequential"
                stack.append(end)


def _steps_and_launches(d):
    """ProfilerStep windows and, per correlation id, the launching call's start and end (ns, rank clock)."""
    B = d["baseTimeNanoseconds"]
    steps, launch, syncs, call_end = [], {}, [], {}
    for e in d["traceEvents"]:
        if e["ph"] != "X":
            continue
        if e["cat"] == "user_annotation" and e["name"].startswith("ProfilerStep#"):
            steps.append((int(e["name"].split("#")[1]), B + _ns(e["ts"]), B + _ns(e["ts"]) + _ns(e["dur"])))
        elif e["cat"] in ("cuda_runtime", "cuda_driver"):
            s = B + _ns(e["ts"])
            launch[e["args"]["correlation"]] = s
            call_end[e["args"]["correlation"]] = s + _ns(e["dur"])
            if e["name"] in SYNC_CALLS:
                syncs.append((s, s + _ns(e["dur"])))
    steps.sort()
    return steps, launch, syncs, call_end


def _step_of(steps, t):
    for n, s, e in steps:
        if s <= t < e:
            return n
    raise AssertionError("launch outside every ProfilerStep")


def test_steps_idle_and_exposed_comm_recomputed(run):
    """Re-derive idle split and exposed comm from the trace with the documented rule."""
    _, truth, traces = run
    for r, (_, d) in traces.items():
        rt = truth["ranks"][str(r)]
        B = d["baseTimeNanoseconds"]
        steps, launch, syncs, call_end = _steps_and_launches(d)
        assert [(s["step"], s["start_ns"], s["end_ns"]) for s in rt["steps"]] == steps
        s7 = defaultdict(list)
        nccl = defaultdict(list)
        k7 = []
        for e in d["traceEvents"]:
            if e["ph"] == "X" and e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset"):
                s = B + _ns(e["ts"])
                iv = (s, s + _ns(e["dur"]), launch[e["args"]["correlation"]], call_end[e["args"]["correlation"]])
                step = _step_of(steps, iv[2])
                if e["tid"] == 7:
                    s7[step].append(iv)
                    if e["cat"] == "kernel":
                        k7.append(iv)
                else:
                    assert e["tid"] == 20 and e["name"].startswith("ncclDevKernel_")
                    nccl[step].append(iv)
        for n, _, _ in steps:
            acts = sorted(s7[n])
            idle = Counter()
            for (a0, a1, _, _), (b0, b1, lb, cb) in zip(acts, acts[1:]):
                gap = b0 - a1
                assert gap >= 0
                if gap == 0:
                    continue
                if lb >= a1:
                    in_sync = any(s <= a1 < e for s, e in syncs)
                    idle["sync_idle_ns" if in_sync else "host_bound_idle_ns"] += gap
                else:
                    idle["other_idle_ns"] += gap
            idle["compute_stream_busy_ns"] = sum(b - a for a, b, _, _ in acts)
            want = rt["idle"][str(n)]
            assert {k: idle[k] for k in want} == want
            st = rt["steps"][n - steps[0][0]]
            assert (st["gpu_start_ns"], st["gpu_end_ns"]) == (acts[0][0], acts[-1][1])
            assert sum(want.values()) == acts[-1][1] - acts[0][0]
            exposed = 0
            for c0, c1, _, _ in nccl[n]:
                ov = sum(max(0, min(c1, k1) - max(c0, k0)) for k0, k1, _, _ in k7)
                exposed += (c1 - c0) - ov
            assert exposed == rt["exposed_comm_ns"][str(n)]
        assert rt["mixed_cause_gaps"] == 0


def test_scenarios_present(run):
    _, truth, _ = run
    lb = set(truth["scenarios"]["launch_bound_steps"])
    assert lb == {11, 14}
    for r, rt in truth["ranks"].items():
        for step, v in rt["idle"].items():
            assert v["sync_idle_ns"] > 0  # the D2H loss.item() every step
            assert (v["host_bound_idle_ns"] > 50_000) == (int(step) in lb)
    # straggler: its step is much longer, other ranks wait in the collectives
    dur = truth["step_true_duration_ns"]
    normal = sorted(v for k, v in dur.items() if k != "12")
    assert dur["12"] > 2 * normal[len(normal) // 2]
    ex = {r: rt["exposed_comm_ns"]["12"] for r, rt in truth["ranks"].items()}
    assert ex["0"] > 3 * ex["1"] and ex["2"] > 3 * ex["1"]
    # overlap mix: some fully overlapped, some fully exposed, some partial
    kinds = set()
    for rt in truth["ranks"].values():
        for c in rt["collectives"]:
            d = c["kernel_end_ns"] - c["kernel_start_ns"]
            kinds.add("overlapped" if c["exposed_ns"] == 0 else "exposed" if c["exposed_ns"] == d else "partial")
    assert kinds == {"overlapped", "exposed", "partial"}


def test_collectives_match_and_end_together(run):
    _, truth, traces = run
    ends = defaultdict(set)
    for r, (_, d) in traces.items():
        rt = truth["ranks"][str(r)]
        B = d["baseTimeNanoseconds"]
        rpc = [e for e in d["traceEvents"] if e["ph"] == "X" and e["name"] == "record_param_comms"]
        kern = sorted((e for e in d["traceEvents"] if e["ph"] == "X" and e["tid"] == 20), key=lambda e: e["ts"])
        assert len(rpc) == len(kern) == len(rt["collectives"]) == 4 * 6
        for c, k, p in zip(rt["collectives"], kern, sorted(rpc, key=lambda e: e["ts"])):
            assert c["seq"] == k["args"]["Seq"] == p["args"]["Seq"]
            assert c["name"] == k["args"]["Collective name"] == p["args"]["Collective name"]
            assert p["args"]["Group size"] == c["group_size"] == 3 and p["args"]["Rank"] == r
            assert p["args"]["Process Group Ranks"] == "[0, 1, 2]"
            esize = {"BFloat16": 2, "Float": 4}[p["args"]["dtype"]]
            assert c["bytes"] == p["args"]["In msg nelems"] * esize
            assert (c["kernel_start_ns"], c["kernel_end_ns"]) == (B + _ns(k["ts"]), B + _ns(k["ts"]) + _ns(k["dur"]))
            ends[c["seq"]].add(c["kernel_end_ns"] - rt["clock_offset_ns"])
    assert sorted(ends) == list(range(1, 25))
    assert all(len(v) == 1 for v in ends.values())


def test_cli_target_size_and_plain_json(tmp_path):
    out = tmp_path / "t"
    rc = main([str(out), "--ranks", "2", "--steps", "2", "--target-mb-per-rank", "0.6", "--no-gzip",
               "--clock-offset-us", "1:-250.5", "--seed", "7", "--quiet"])
    assert rc == 0
    truth = json.loads((out / "truth.json").read_text())
    assert truth["ranks"]["1"]["clock_offset_ns"] == -250_500
    for r in range(2):
        text = (out / ("rank-%d.pt.trace.json" % r)).read_text()
        json.loads(text)
        assert len(text) == truth["ranks"][str(r)]["raw_bytes"]
        assert 0.55e6 < len(text) < 0.7e6
    assert "kernels_by_correlation" in truth["ranks"]["0"]

"""Peak memory and wall time of a command, summed over its whole process tree.

CLI:     python peak_rss.py [--interval S] -- CMD ARGS...
         The command's stdout/stderr pass through; then one JSON line is printed on stdout:
         {"peak_rss_mb": ..., "seconds": ..., "returncode": ..., "samples": ...}
Import:  from peak_rss import measure; measure(["cmd", "arg"], capture=True)

peak_rss_mb is the largest SUM of RSS over the process and all its descendants seen in any
sample, in MiB (2**20 bytes). Pages shared between processes (e.g. after fork) count once per
process, so for multiprocessing tools this is an upper bound on real memory use. Children that
live shorter than one interval may be missed.
"""
import json
import subprocess
import sys
import tempfile
import time

import psutil


def tree_rss(proc: psutil.Process) -> int:
    """Sum of RSS in bytes over proc and all its descendants (processes that vanish are skipped)."""
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def measure(cmd, interval: float = 0.02, capture: bool = False, **popen_kwargs) -> dict:
    """Run cmd, sampling the tree's RSS every `interval` s. capture=True returns its stdout as text."""
    out = tempfile.TemporaryFile() if capture else None
    if out is not None:
        popen_kwargs["stdout"] = out
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, **popen_kwargs)
    proc = psutil.Process(child.pid)
    peak, samples = 0, 0
    while True:
        peak = max(peak, tree_rss(proc))
        samples += 1
        try:
            child.wait(timeout=interval)  # returns as soon as the command exits
            break
        except subprocess.TimeoutExpired:
            pass
    result = {
        "peak_rss_mb": round(peak / 2**20, 1),
        "seconds": round(time.perf_counter() - t0, 3),
        "returncode": child.returncode,
        "samples": samples,
    }
    if out is not None:
        out.seek(0)
        result["stdout"] = out.read().decode(errors="replace")
        out.close()
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(__doc__, file=sys.stderr)
        return 2
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    interval = float(opts[opts.index("--interval") + 1]) if "--interval" in opts else 0.02
    result = measure(cmd, interval=interval)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())

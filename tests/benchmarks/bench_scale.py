"""Scale benchmark: many generated ranks end to end (ingest, analyses, report), peak memory against rank count.

    .venv/bin/python tests/benchmarks/bench_scale.py [--ranks 64] [--mb-per-rank 20] [--cache DIR]

Generates `--ranks` ranks of about `--mb-per-rank` MB of raw Kineto JSON each (once, cached), then runs
`analyze` on the first 8, 16, 32, ... ranks and prints, for each: raw MB, ingest seconds, analysis
seconds, report seconds (as `analyze` reports them), the size of report.html and peak RSS of the
whole process tree. The memory should
stay flat as ranks grow: at most --jobs files are parsed at once and the analyses go rank by rank.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peak_rss import measure  # noqa: E402

ANALYZE = Path(sys.executable).parent / "analyze"
SUMMARY = re.compile(r"([\d.]+) MB of trace data in ([\d.]+)s.*?analyses\s+([\d.]+)s", re.S)  # wrapped at 80 columns
REPORT = re.compile(r"rendered in ([\d.]+)s")


def generate(cache: Path, ranks: int, mb: int) -> Path:
    out = cache / f"gen-{ranks}x{mb}mb"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"generating {ranks} ranks x {mb} MB into {out} ...", flush=True)
        subprocess.run([sys.executable, str(HERE.parent / "synthetic.py"), str(out), "--ranks", str(ranks),
                        "--target-mb-per-rank", str(mb), "--seed", "0", "--jobs", "2", "--quiet"], check=True)
        (out / ".done").touch()
    return out


def subset(cache: Path, gen: Path, n: int) -> Path:
    d = cache / "scale-sets" / f"first{n}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for r in range(n):
        (d / f"rank-{r}.pt.trace.json.gz").symlink_to(gen / f"rank-{r}.pt.trace.json.gz")
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--mb-per-rank", type=int, default=20)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/steplens-bench"))
    args = ap.parse_args()
    cache = args.cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    gen = generate(cache, args.ranks, args.mb_per_rank)
    print(f"\n   {'ranks':>5}{'raw MB':>9}{'ingest s':>10}{'analyses s':>12}{'report s':>10}{'report KB':>11}"
          f"{'wall s':>8}{'peak RSS MiB':>14}")
    n = 8
    while n <= args.ranks:
        d = subset(cache, gen, n)
        with tempfile.TemporaryDirectory(prefix="steplens-scale-") as tmp:
            # Not -q: the summary line holds the stage times. A subset's traces name the whole generated job,
            # so analyze reports the other ranks lost (exit status 1, results written).
            r = measure([str(ANALYZE), str(d), "--out", str(Path(tmp) / "out")], capture=True,
                        stderr=subprocess.STDOUT)
            written = r["returncode"] in (0, 1) and (Path(tmp) / "out" / "report.html").exists()
            report_kb = (Path(tmp) / "out" / "report.html").stat().st_size / 1e3 if written else 0
        found, rendered = SUMMARY.search(r["stdout"]), REPORT.search(r["stdout"])
        if not written or not found or not rendered:
            print(f"analyze failed on {n} ranks:\n{r['stdout'][-2000:]}")
            return 1
        mb, ingest_s, analyses_s = (float(x) for x in found.groups())
        print(f"   {n:>5}{mb:>9.0f}{ingest_s:>10.1f}{analyses_s:>12.2f}{float(rendered.group(1)):>10.2f}{report_kb:>11.0f}"
              f"{r['seconds']:>8.1f}{r['peak_rss_mb']:>14.0f}", flush=True)
        n *= 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run train_tiny_gpt.py on 2 CPU ranks with the deepspeed launcher (or torchrun) and return the run folder.

    from tests.realrun.launch import run_tiny_gpt
    out = run_tiny_gpt(tmp_path / "z2", "--zero_stage", "2", "--steps", "6")

Each call picks a free master port, so jobs of people sharing the machine do not collide.
"""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_tiny_gpt.py")
REPO = Path(__file__).resolve().parents[2]
# DeepSpeed's CPU shm comm op maps a 69 MB buffer per rank into /dev/shm and never removes it: a test
# session that runs dozens of jobs would fill memory with them (/dev/shm is RAM). Named by master port.
SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"
PORTS_USED: list[int] = []


def release_shm(ports: list[int] | None = None) -> None:
    """Remove the shm buffers of finished jobs (of these master ports, default every port used here)."""
    for port in list(PORTS_USED if ports is None else ports):
        for buffer in glob.glob(SHM_BUFFERS.format(port=port)):
            with contextlib.suppress(OSError):
                os.unlink(buffer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_env() -> dict:
    env = dict(os.environ)
    # DeepSpeed's CPU accelerator and gloo; one thread per rank, or 2 ranks oversubscribe 2 cores
    # (deepspeed-artifacts.md pitfall 9). The repo on PYTHONPATH lets the ranks import tests helpers.
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.setdefault("WANDB_MODE", "offline")
    return env


def command(out_dir: Path, args: tuple[str, ...], launcher: str = "deepspeed", ranks: int = 2) -> list[str]:
    bin_dir = Path(sys.executable).parent
    port = str(free_port())
    PORTS_USED.append(int(port))
    if launcher == "deepspeed":
        head = [str(bin_dir / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port,
                "--enable_each_rank_log", str(out_dir / "rank_logs")]
    elif launcher == "torchrun":
        head = [str(bin_dir / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", port,
                "--log-dir", str(out_dir / "torchrun_logs"), "--redirects", "3"]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return [*head, str(SCRIPT), "--out_dir", str(out_dir), *args]


def run_tiny_gpt(out_dir: Path, *args: str, launcher: str = "deepspeed", ranks: int = 2, timeout: float = 300,
                 check: bool = True) -> Path:
    """Run the job; launcher output goes to out_dir/launcher.log. Raises on a nonzero exit when check."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = command(out_dir, args, launcher, ranks)
    (out_dir / "COMMAND.txt").write_text(" ".join(cmd) + "\n")
    try:
        with open(out_dir / "launcher.log", "wb") as log:
            proc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(), timeout=timeout,
                                  cwd=out_dir)
    finally:
        release_shm([PORTS_USED[-1]])
    if check and proc.returncode != 0:
        tail = (out_dir / "launcher.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"training job exited with {proc.returncode}:\n{tail}")
    return out_dir


if __name__ == "__main__":
    # python tests/realrun/launch.py OUT_DIR [train_tiny_gpt.py args...]
    print(run_tiny_gpt(Path(sys.argv[1]), *sys.argv[2:]))

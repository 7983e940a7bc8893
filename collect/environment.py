"""What the run was: library versions, devices, host and the training code's git revision."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def versions() -> dict:
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None}
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):  # built without NCCL
            pass
    try:
        import deepspeed

        found["deepspeed"] = deepspeed.__version__
    except ImportError:
        found["deepspeed"] = None
    from steplens import collect

    found["steplens"] = collect.__version__
    return found


def devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu ({os.cpu_count()} cores)"]


def git_revision(start: Path) -> dict | None:
    """Commit and dirty flag of the repository holding `start` (the training script), if any."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(start), *args], capture_output=True, text=True, timeout=5,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
                "repo": git("rev-parse", "--show-toplevel")}
    except (OSError, subprocess.SubprocessError):
        return None


def training_script_dir() -> Path:
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else None)
    return Path(script).resolve().parent if script else Path.cwd()


def describe_host() -> dict:
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "devices": devices(),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}

"""How a job's out-of-memory errors read, stated once for the autotuner's experiment failures and the memory
analysis (standard library only)."""

from __future__ import annotations

import re

# Any out-of-memory error. DeepSpeed itself only records "the first line containing Error/error/ERROR"
# (autotuning/utils.py search_error) and has no OOM class.
OOM = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|MemoryError|Cannot allocate memory|"
                 r"std::bad_alloc", re.IGNORECASE)
# Those of a device: PyTorch's CUDA/HIP caching allocator, cuBLAS's workspace allocation; the others are the host's.
DEVICE_OOM = re.compile(r"(CUDA|HIP) out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)

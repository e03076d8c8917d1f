"""Peak memory of one call, beyond what its inputs already hold.

GPU: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus memory_allocated
before the call (exact for the caching allocator's tensors; cuBLAS/cuDNN workspaces outside it
are not seen).

CPU has no allocator statistics, so we measure the process's peak resident set growth: a helper
process ("zygote", `python -m attnx.bench.rss_helper`) imports torch and attnx once, never computes,
and forks one child per measurement. The child builds the inputs, runs the call once to warm
up, records VmRSS, resets the kernel's peak-RSS mark (writing 5 to /proc/self/clear_refs), runs
the call again and reads VmHWM: growth = VmHWM - VmRSS. glibc is told to serve every block of
64 KiB or more with mmap (MALLOC_MMAP_THRESHOLD_), so freed memory leaves the process at once
and cannot hide a later allocation. The count is in pages touched, so it includes small
allocator and thread-stack noise (tens of KiB) and is honest to about 0.1 MB.
For "backward" both methods count what the backward adds to the saved forward state.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import torch

GPU_METHOD = "torch.cuda.max_memory_allocated - memory_allocated before the call"
CPU_METHOD = "peak RSS growth (VmHWM after clear_refs) in a forked child per measurement"


def gpu_peak(step) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_supported() -> Optional[str]:
    """Why the CPU method cannot run here, or None."""
    if not sys.platform.startswith("linux"):
        return "peak RSS reset needs Linux (/proc/self/clear_refs)"
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        return f"cannot reset peak RSS: {exc}"
    return None


class CpuMemory:
    """Parent side of the zygote. Use as a context manager; `peak(...)` returns bytes or raises."""

    def __enter__(self):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        self.proc = subprocess.Popen([sys.executable, "-m", "attnx.bench.rss_helper"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def peak(self, provider: str, case, pass_: str) -> int:
        request = {"provider": provider, "case": case.as_dict(), "pass": pass_}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the memory helper process exited")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["bytes"]

    def __exit__(self, *exc):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        return False


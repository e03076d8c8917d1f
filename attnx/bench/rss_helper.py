"""The CPU memory helper process (see `attnx.bench.memory`): `python -m attnx.bench.rss_helper`.

It imports torch and attnx once and never computes itself, so that each forked child starts
clean (no OpenMP thread pool to inherit, no freed memory cached by the allocator).
"""

from __future__ import annotations

import json
import os
import sys

from .memory import status_kib
from .providers import discover
from .shapes import Case
from .workload import make_step


def _child_measure(providers: dict, request: dict) -> dict:
    provider = providers.get((request["provider"], request["case"]["op"]))
    if provider is None or not provider.available:
        return {"error": f"{request['provider']} is not available in the memory helper"}
    step = make_step(provider, Case(**request["case"]), request["pass"])
    step()
    base = status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    return {"bytes": max(0, status_kib("VmHWM") - base) * 1024}


def _serve() -> None:
    """The zygote's loop: one JSON request per stdin line, one JSON answer per stdout line."""
    providers = {(p.name, p.op): p for p in discover("cpu", probe_flex=False, probe_compile=False)}
    for line in sys.stdin:
        request = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                answer = _child_measure(providers, request)
            except BaseException as exc:  # reported to the parent, which goes on
                answer = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            os.write(w, json.dumps(answer).encode())
            os._exit(0)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        if chunks:
            answer = json.loads(b"".join(chunks))
        else:
            answer = {"error": f"measuring child died (wait status {status})"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()



if __name__ == "__main__":
    _serve()

"""The fixture of the pytest-benchmark suite: `pytest benchmarks/ --benchmark-only`.

Each test times one provider (attnx backend, torch SDPA kernel, naive formula, ...; see
`attnx.bench.providers`) on one pass (forward, backward, forward_backward) of one shape family.
Shapes are small so the whole suite runs in a couple of minutes on a CPU. Providers that do
not exist here (no GPU, library not installed) are skipped with the reason; a provider that
exists and fails is a failure. FlexAttention is probed (torch.compile) only when
ATTNX_BENCH_FLEX=1, as compiling it can take minutes on a CPU.
"""

import pytest
import torch

from bench_params import DEVICE


@pytest.fixture
def run_benchmark(benchmark):
    """Times `provider` on `case`/`pass_` with pytest-benchmark, synchronising on GPU."""
    from attnx.bench.workload import make_step

    def run(provider, case, pass_):
        if not provider.available:
            pytest.skip(f"{provider.name}: {provider.reason}")
        step = make_step(provider, case, pass_)
        if DEVICE == "cuda":
            def timed():
                step()
                torch.cuda.synchronize()
        else:
            timed = step
        benchmark.group = f"{pass_} {case.label()}"
        benchmark.extra_info.update(provider=provider.name, **case.as_dict())
        benchmark(timed)

    return run

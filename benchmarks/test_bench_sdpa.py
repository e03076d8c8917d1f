"""pytest-benchmark: scaled dot-product attention, every provider x pass x shape family."""

import pytest

from bench_params import PASS_PARAMS, case_params, provider_params


@pytest.mark.parametrize("case", case_params("sdpa"))
@pytest.mark.parametrize("pass_", PASS_PARAMS)
@pytest.mark.parametrize("provider", provider_params("sdpa"))
def test_sdpa(run_benchmark, provider, pass_, case):
    run_benchmark(provider, case, pass_)

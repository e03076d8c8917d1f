"""pytest-benchmark: additive (Bahdanau) attention, every provider x pass x shape family."""

import pytest

from bench_params import PASS_PARAMS, case_params, provider_params


@pytest.mark.parametrize("case", case_params("additive"))
@pytest.mark.parametrize("pass_", PASS_PARAMS)
@pytest.mark.parametrize("provider", provider_params("additive"))
def test_additive(run_benchmark, provider, pass_, case):
    run_benchmark(provider, case, pass_)

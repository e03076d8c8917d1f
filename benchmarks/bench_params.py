"""Providers, shape families and passes of the pytest-benchmark suite (see conftest.py)."""

import os

import pytest
import torch

from attnx.bench import providers as bench_providers
from attnx.bench.shapes import PASSES, Case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"

# name -> (batch, heads, Lq, Lk, head dim or A, Ev, causal)
SDPA_FAMILIES = {
    "self-256": (1, 4, 256, 256, 64, 64, False),
    "causal-256": (1, 4, 256, 256, 64, 64, True),
    "cross-64x512": (2, 4, 64, 512, 64, 64, False),  # decoder queries over encoder keys
}
ADDITIVE_FAMILIES = {
    "nmt-32": (8, 1, 32, 32, 128, 128, False),  # Bahdanau-sized: batch of sentences, A=128
    "nmt-causal-32": (8, 1, 32, 32, 128, 128, True),
}

_PROVIDERS = bench_providers.discover(DEVICE, probe_flex=os.environ.get("ATTNX_BENCH_FLEX") == "1",
                                      probe_compile=os.environ.get("ATTNX_BENCH_COMPILE") == "1")


def provider_params(op: str):
    return [pytest.param(p, id=p.name) for p in _PROVIDERS if p.op == op]


def case_params(op: str):
    families = SDPA_FAMILIES if op == "sdpa" else ADDITIVE_FAMILIES
    return [pytest.param(Case(op, *dims[:6], dims[6], DTYPE, DEVICE), id=name)
            for name, dims in families.items()]


PASS_PARAMS = [pytest.param(p, id=p) for p in PASSES]

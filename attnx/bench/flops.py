"""FLOP counts, as flash-attention's benchmarks count them, so figures compare with published ones.

SDPA forward: 4 * B * H * Lq * Lk * D (two GEMMs QK^T and PV of 2*Lq*Lk*D each; softmax not
counted), halved for causal; backward 2.5x forward (five GEMMs); forward+backward 3.5x.

Additive, per admissible (i, j) pair, counting a multiply-add as 2 FLOPs as the GEMM counts do
and tanh as 1: forward 4A + 2Ev (q_i + k_j, tanh, the dot with v as A multiply-adds; then PV);
backward 12A + 4Ev (recomputing the scores 4A; dtanh = dS * v * (1 - t^2) 4A; accumulating it
into dq_i and dk_j 2A and dS * t into dv 2A; dP = dO V^T and dV = P^T dO 2Ev each). Causal halves
the pairs. (A count of 3A + 2Ev, also seen, takes the v dot-product as A FLOPs.)
Packed sequences (varlen) count as flash-attention counts them, over the real tokens only:
4 * H * D * sum_n L_n^2, halved for causal. Decoding (kvcache) counts every query against the
whole cache, 4 * B * Hq * Lq * L * D (the causal band drops Lq - 1 keys of L: not halved).
These are conventions for comparing providers on the same problem, not hardware counters.
"""

from __future__ import annotations

from .shapes import Case

BACKWARD_FACTOR = 2.5  # flash-attention's convention for SDPA


def pairs(case: Case) -> float:
    """Number of (query, key) pairs computed, with causal taken as half the square."""
    if case.op == "kvcache":
        return case.batch * case.heads * case.seqlen_q * case.seqlen_k
    if case.op == "varlen":
        n = case.heads * sum(length * length for length in case.lengths)
    else:
        n = case.batch * case.heads * case.seqlen_q * case.seqlen_k
    return n / 2 if case.causal else n


def forward(case: Case) -> float:
    if case.op == "additive":
        return pairs(case) * (4.0 * case.head_dim + 2.0 * case.value_dim)
    return 4.0 * pairs(case) * case.head_dim


def backward(case: Case) -> float:
    if case.op in ("sdpa", "varlen"):
        return BACKWARD_FACTOR * forward(case)
    return pairs(case) * (12.0 * case.head_dim + 4.0 * case.value_dim)


def count(case: Case, pass_: str) -> float:
    if pass_ == "forward":
        return forward(case)
    if pass_ == "backward":
        return backward(case)
    return forward(case) + backward(case)

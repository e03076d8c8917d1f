"""What each spawned rank runs for tests/test_distributed.py: a gloo process group on
127.0.0.1, then named checks, each comparing this rank's results with the single-process ones
on the full sequence, sliced to the rank's shard."""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import attnx
from _compare import assert_within  # tests/ is on the spawned ranks' path, as on the parent's
from attnx.distributed import ring_attention, shard, unshard

PG_TIMEOUT_S = 60  # a rank left waiting raises after this; the parent's deadline is longer


def run(rank: int, world: int, port: int, checks: list, timeout_s: float = PG_TIMEOUT_S) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        for name, kwargs in checks:
            try:
                CHECKS[name](**kwargs)
            except BaseException:
                # The parent reports the first rank to exit, often one that only lost its
                # peer: every rank's own error goes to stderr (the test's captured output).
                print(f"rank {rank}/{world}: {name}({kwargs}) failed:\n{traceback.format_exc()}",
                      file=sys.stderr, flush=True)
                raise
    finally:
        dist.destroy_process_group()


def _tol(dtype):
    return dict(rtol=1e-4, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)


def _inputs(hq, hk, length, e, ev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    shapes = ((2, hq, length, e), (2, hk, length, e), (2, hk, length, ev), (2, hq, length, ev))
    return [torch.randn(s, generator=g, dtype=dtype) for s in shapes] + [
        torch.randn((2, hq, length), generator=g, dtype=torch.float32)]


def ring_matches(layout, is_causal=False, window=None, hq=4, hk=2, per_rank=4, e=5, ev=7,
                 dtype=torch.float32, backend=None, scale=None, huge_lse=False, softcap=None,
                 overflow=False, huge_values=False, huge_dout=False):
    """out, lse, dq, dk, dv of ring_attention on this rank's shard == the single-process op on
    the full sequence, sliced; the loss reads the lse too, so its gradient is checked.
    `huge_lse`: every key shares a large first coordinate, which shifts each row's scores by
    a constant in the hundreds (|lse| > 256) and leaves its softmax as spread as before.
    `overflow`: finite inputs whose scores pass float32's range on some rows (one query row and
    two keys of +-3e19 in one coordinate), on the last rank's shard and the first's.
    `huge_values`: values of +-1e38, whose float32 backward overflows (dout V^T) where the
    forward does not. `huge_dout`: an output gradient of ~1e37 (values ~10), the same in the
    backward alone (dout is known only there)."""
    world = dist.get_world_size()
    q, k, v, dout, dlse = _inputs(hq, hk, per_rank * world, e, ev, dtype)
    if huge_lse:
        q[..., 0] = 10.0
        k[..., 0] += 100.0
    if overflow:
        q[0, 0, -2, 0] = 3e19
        k[0, 0, 1, 0], k[0, 0, -1, 0] = 3e19, -3e19
    if huge_values:
        v = v.sign() * 1e38
    if huge_dout:  # dout V^T ~1e39 for values ~10
        dout, v = dout * 1e37, v * 10

    def single(inputs, backend):
        full = [t.clone().requires_grad_() for t in inputs]
        out, lse = attnx.scaled_dot_product_attention(
            *full, is_causal=is_causal, window=window, scale=scale, enable_gqa=hq != hk,
            softcap=softcap, backend=backend, return_lse=True)
        ((out * dout.to(out.dtype)).sum() + (lse * dlse).sum()).backward()
        return out, lse, full

    out, lse, full = single((q, k, v), backend)

    def cut(t, dim=-2):
        return shard(t, layout=layout, dim=dim)

    local = [cut(t).detach().requires_grad_() for t in (q, k, v)]
    out_l, lse_l = ring_attention(*local, is_causal=is_causal, window=window, scale=scale,
                                  layout=layout, softcap=softcap, backend=backend,
                                  return_lse=True)
    ((out_l * cut(dout)).sum() + (lse_l * cut(dlse, -1)).sum()).backward()
    assert lse_l.dtype == torch.float32 and out_l.dtype == dtype
    assert not any(t.isnan().any() for t in (out_l, lse_l, *(x.grad for x in local)))
    what = (f"rank {dist.get_rank()}/{world} {layout} causal={is_causal} window={window} "
            f"softcap={softcap}")
    # 16-bit types, as flash-attention tests: against float64, bounded by
    if dtype in (torch.bfloat16, torch.float16):
        gold_out, gold_lse, gold = single((t.double() for t in (q, k, v)), "reference")
        pairs = [("out", out_l, out, gold_out), ("lse", lse_l, lse, gold_lse)] + [
            ("d" + n, mine.grad, ref.grad, g.grad) for n, mine, ref, g in zip("qkv", local, full,
                                                                             gold)]
        for name, mine, ref, g in pairs:  # a small multiple of the single call's own error
            dim = -1 if name == "lse" else -2
            floor = 1e-2 if dtype == torch.bfloat16 else 2e-3  # test_cpu_sdpa.py's floors
            assert_within(mine, cut(g, dim), cut(ref, dim), factor=2.0, floor=floor,
                          what=f"{what} {name}")
        return
    tol = _tol(dtype)
    if huge_values:  # terms of +-1e38 that cancel: float32's rounding of them, ~1e38 * 6e-8 each
        tol = dict(rtol=1e-4, atol=1e32)
    if huge_dout:  # gradients ~1e38: the same relative bound
        tol = dict(rtol=1e-4, atol=1e34)
    torch.testing.assert_close(out_l, cut(out), **tol, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(lse_l, cut(lse, -1), **tol, msg=lambda m: f"{what} lse: {m}")
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad, cut(ref.grad), **tol,
                                   msg=lambda m, n=name: f"{what} d{n}: {m}")
    # the whole output gathered back from the shards
    torch.testing.assert_close(unshard(out_l.detach(), layout=layout), out.detach(), **tol)


def shard_roundtrip(layout):
    """unshard(shard(x)) == x, and unshard's backward hands each rank its shard of the summed
    full gradient."""
    world = dist.get_world_size()
    x = torch.arange(2 * 3 * 2 * world * 2, dtype=torch.float64).view(2, 3, 2 * world * 2)
    local = shard(x, layout=layout, dim=-1).requires_grad_()
    full = unshard(local, layout=layout, dim=-1)
    assert torch.equal(full, x)
    (full * x).sum().backward()  # every rank's loss reads every position
    assert torch.equal(local.grad, world * shard(x, layout=layout, dim=-1))
    # the all-reduce sums a copy: the caller's gradient tensor stays as it was, and a branch
    # beside unshard (a residual) that autograd hands the same tensor takes its own gradient
    ones = torch.ones_like(x)
    unshard(local, layout=layout, dim=-1).backward(ones)
    assert torch.equal(ones, torch.ones_like(x))
    c = torch.ones_like(x).requires_grad_()
    ((unshard(local, layout=layout, dim=-1) + 2 * c) * 1.0).sum().backward()
    assert torch.equal(c.grad, torch.full_like(x, 2.0))
    # dtypes the collectives do not gather themselves travel as bytes
    for dtype in (torch.float8_e4m3fn, torch.uint16):
        y = x.to(dtype)
        assert torch.equal(unshard(shard(y, layout=layout, dim=-1), layout=layout,
                                   dim=-1).view(torch.uint8), y.view(torch.uint8))


def _expect_error(exc_type, words, fn):
    try:
        fn()
    except exc_type as exc:
        for word in words:
            assert word in str(exc), f"expected {word!r} in the error, got: {exc}"
        return
    raise AssertionError(f"expected {exc_type.__name__} mentioning {words}")


def bad_input_everywhere():
    """Bad input on one rank (or ranks that disagree) makes every rank raise, at once."""
    rank = dist.get_rank()
    q, k, v, *_ = _inputs(2, 2, 8, 4, 4, torch.float32)
    ql, kl, vl = (shard(t) for t in (q, k, v))
    # rank 1 only: an integer query
    bad_q = ql.long() if rank == 1 else ql
    _expect_error(TypeError if rank == 1 else ValueError,
                  ["q: expected"] if rank == 1 else ["rank(s) [1]"],
                  lambda: ring_attention(bad_q, kl, vl))
    # every rank: its own message, naming ring_attention's arguments (q, k, v; it has no
    # enable_gqa flag, which the messages of scaled_dot_product_attention's checks named)
    _expect_error(ValueError, ["k: expected a head count dividing 3 (that of q)"],
                  lambda: ring_attention(torch.cat([ql, ql[:, :1]], 1), kl, vl))
    _expect_error(ValueError, ["k: expected this rank's shard of q's sequence"],
                  lambda: ring_attention(ql, kl[..., :2, :], vl[..., :2, :]))
    # rank 1 only: an odd shard under zigzag (the full length not divisible by 2W)
    odd = ql[..., :3, :] if rank == 1 else ql
    _expect_error(ValueError, ["even"] if rank == 1 else ["rejected"],
                  lambda: ring_attention(odd, odd, odd))
    # shards of different lengths: L does not divide evenly
    uneven = ql[..., :2, :] if rank == 1 else ql
    _expect_error(ValueError, ["sequence length", "rank 1: 2"],
                  lambda: ring_attention(uneven, uneven, uneven))
    # flags that differ between ranks
    _expect_error(ValueError, ["is_causal"],
                  lambda: ring_attention(ql, kl, vl, is_causal=rank == 0))
    # windows that differ: the band's sides named as window= sets them, not as sentinels
    _expect_error(ValueError, ["window", "rank 0: left 3", "rank 1: no left bound"],
                  lambda: ring_attention(ql, kl, vl, window=(3, None) if rank == 0 else None))
    _expect_error(ValueError, ["layout"], lambda: ring_attention(ql, kl, vl, layout="striped"))
    _expect_error(ValueError, ["divisible by 4"], lambda: shard(q[..., :6, :]))
    # unshard: one rank's bad input, or shards that differ, raise on every rank (its all-gather
    # of unequal shards would leave the others waiting)
    _expect_error(ValueError, ["even shard length"] if rank == 1 else ["unshard: rank(s) [1]"],
                  lambda: unshard(odd))
    _expect_error(TypeError if rank == 0 else ValueError,
                  ["dim: expected an int"] if rank == 0 else ["unshard: rank(s) [0]"],
                  lambda: unshard(ql, dim=0.5 if rank == 0 else -2))
    _expect_error(ValueError,
                  ["unshard: expected the same", f"rank 1: shape {tuple(ql[..., :2, :].shape)}"],
                  lambda: unshard(uneven))
    _expect_error(ValueError, ["torch.float64", "torch.float32"],
                  lambda: unshard(ql.double() if rank == 1 else ql))
    _expect_error(ValueError, ["torch.float8_e4m3fn", "torch.float8_e5m2"],  # the same bytes
                  lambda: unshard(ql.to(torch.float8_e5m2 if rank == 1 else torch.float8_e4m3fn)))
    _expect_error(ValueError, ["contiguous", "zigzag"],
                  lambda: unshard(ql, layout="contiguous" if rank == 0 else "zigzag"))
    assert unshard(ql).shape == q.shape
    _expect_error(TypeError, ["dim: expected an int, got float"], lambda: shard(q, dim=1.5))
    _expect_error(ValueError, ["group: expected None or a process group"],
                  lambda: shard(q, group="not-a-group"))  # (torch's error named no argument)
    _expect_error(TypeError, ["attn_mask"], lambda: ring_attention(ql, kl, vl, attn_mask=None))
    # rank 1 alone: a keyword ring_attention or unshard does not take, or a group that is none.
    # Python's own TypeError (refusing the call) would leave rank 0 waiting in the agreement.
    for kwargs, words in (({"dropout_p": 0.1}, ["dropout_p: ring_attention takes no such"]),
                          ({"group": "not-a-group"}, ["group: expected None or a process group"])):
        _expect_error(TypeError if "group" not in kwargs and rank == 1 else ValueError,
                      words if rank == 1 else ["rank(s) [1]"],
                      lambda: ring_attention(ql, kl, vl, **(kwargs if rank == 1 else {})))
    _expect_error(TypeError if rank == 1 else ValueError,
                  ["ring_attention: expected its tensors as the only positional"] if rank == 1
                  else ["rank(s) [1]"],
                  lambda: ring_attention(ql, kl, vl, *([None] if rank == 1 else [])))
    _expect_error(TypeError if rank == 1 else ValueError,
                  ["dims: unshard takes no such"] if rank == 1 else ["unshard: rank(s) [1]"],
                  lambda: unshard(ql, **({"dims": -2} if rank == 1 else {})))
    _expect_error(ValueError, ["softcap"], lambda: ring_attention(ql, kl, vl, softcap=-1.0))
    _expect_error(ValueError, ["softcap"],
                  lambda: ring_attention(ql, kl, vl, softcap=1.0 + rank))
    # a meta tensor on one rank: refused there before any collective, so the others raise too
    meta = ql.to("meta") if rank == 1 else ql
    _expect_error(TypeError if rank == 1 else ValueError,
                  ["q: expected a CPU or CUDA tensor"] if rank == 1 else ["rank(s) [1]"],
                  lambda: ring_attention(meta, meta, meta))
    for odd_one, words in ((ql.to("meta"), ["x_local: expected a CPU or CUDA tensor"]),
                           (ql.to_sparse(), ["x_local: expected a dense"])):
        _expect_error(TypeError if rank == 1 else ValueError,
                      words if rank == 1 else ["unshard: rank(s) [1]"],
                      lambda: unshard(odd_one if rank == 1 else ql))
    # unshard recording a graph on one rank only: its backward all-reduce would hang the other
    _expect_error(ValueError, ["gradient recording", "graph recorded", "graph none"],
                  lambda: unshard(ql.clone().requires_grad_(rank == 0)))
    # a graph recorded on one rank only: its backward ring would wait for the other forever
    qg = ql.clone().requires_grad_(rank == 0)
    _expect_error(ValueError, ["gradient recording", "rank 0: 1", "rank 1: 0"],
                  lambda: ring_attention(qg, kl, vl))
    # leading dims that differ but flatten to the same batch
    lead = (2, 3) if rank == 0 else (3, 2)
    ql6, kl6, vl6 = (t[:1].expand(*lead, *t.shape[1:]) for t in (ql, kl, vl))
    _expect_error(ValueError, ["leading dims"], lambda: ring_attention(ql6, kl6, vl6))
    # no heads anywhere: empty results without a ring (it divides by the heads), gradients 0
    q0, k0, v0 = (t[:, :0].clone().requires_grad_() for t in (ql, kl, vl))
    out, lse = ring_attention(q0, k0, v0, is_causal=True, return_lse=True)
    assert out.shape == (2, 0, 4, 4) and lse.shape == (2, 0, 4)
    out.sum().backward()
    assert q0.grad.shape == q0.shape
    # and the group still works afterwards
    ring_matches("zigzag", is_causal=True)


def outside_a_subgroup():
    """A group of ranks 0 and 1: they run a ring over it; rank 2, outside it, calling with it
    raises a ValueError naming `group` at once, with no collective (torch gives it rank -1 and
    world size -1: shard's length came out negative, ring_attention's checks ran on them)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # every rank makes it
    q, k, v, *_ = _inputs(2, 2, 8, 4, 4, torch.float64)
    if rank < 2:
        ql, kl, vl = (shard(t, group=group) for t in (q, k, v))
        out = unshard(ring_attention(ql, kl, vl, group=group, is_causal=True), group=group)
        torch.testing.assert_close(out, attnx.scaled_dot_product_attention(q, k, v,
                                                                           is_causal=True))
    else:
        for fn in (lambda: shard(q, group=group), lambda: unshard(q, group=group),
                   lambda: ring_attention(q, k, v, group=group)):
            _expect_error(ValueError, ["group: expected None or a process group of this rank",
                                       "rank 2 of the default group"], fn)
    dist.barrier()


def softcap_matches(layout):
    """Soft-capped ring attention (the kernels the dispatcher picks for float64 CPU tensors)
    against the formula in float64, not through attnx."""
    world = dist.get_world_size()
    cap, length = 2.0, 4 * world
    q, k, v, dout, _ = _inputs(2, 1, length, 3, 3, torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    s = full[0] @ full[1].transpose(-2, -1) / 3 ** 0.5
    s = (cap * torch.tanh(s / cap)).masked_fill(
        torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(s, -1) @ full[2]
    (out * dout).sum().backward()
    local = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
    out_l = ring_attention(*local, is_causal=True, layout=layout, softcap=cap)
    (out_l * shard(dout, layout=layout)).sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(out_l, shard(out, layout=layout), **tol)
    for mine, ref in zip(local, full):
        torch.testing.assert_close(mine.grad, shard(ref.grad, layout=layout), **tol)


def no_second_order(layout):
    """create_graph=True gives the first-order gradients (as the single-process op's); their
    own backward raises NotImplementedError on every rank, whatever the backend (the reference
    blocks' graphs gave wrong second-order gradients: they miss the ring's sends)."""
    q, k, v, dout, _ = _inputs(2, 1, 4 * dist.get_world_size(), 3, 3, torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnx.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    want = torch.autograd.grad((out * dout).sum(), full)
    for backend in ("reference", "cpu"):
        local = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
        out_l = ring_attention(*local, is_causal=True, layout=layout, backend=backend)
        grads = torch.autograd.grad((out_l * shard(dout, layout=layout)).sum(), local,
                                    create_graph=True)
        for mine, ref in zip(grads, want):
            torch.testing.assert_close(mine, shard(ref, layout=layout), **_tol(torch.float64))
        _expect_error(NotImplementedError, ["ring_attention", "second-order"],
                      lambda: sum((g * g).sum() for g in grads).backward())


def ring_under_torch_func(layout):
    """torch.func.grad through ring_attention (its loss reading out and lse) and vjp through
    unshard give autograd's gradients: float32, bfloat16 on the cpu kernels (the backward keeps
    the float32 out apart from the result) and float64 (a float64 lse apart). Both raised
    torch's setup_context error before (old-style autograd.Functions)."""
    world = dist.get_world_size()
    for dtype, backend in ((torch.float32, None), (torch.bfloat16, "cpu"), (torch.float64, None)):
        q, k, v, dout, _ = _inputs(4, 2, 4 * world, 5, 7, dtype)
        local = [shard(t, layout=layout) for t in (q, k, v)]
        d = shard(dout, layout=layout)

        def loss(q, k, v):
            out, lse = ring_attention(q, k, v, is_causal=True, layout=layout, backend=backend,
                                      return_lse=True)
            return (out.float() * d.float()).sum() + lse.sum()

        got = torch.func.grad(loss, argnums=(0, 1, 2))(*local)
        leaves = [t.clone().requires_grad_() for t in local]
        want = torch.autograd.grad(loss(*leaves), leaves)
        for mine, ref in zip(got, want):
            assert mine.dtype == dtype and torch.equal(mine, ref), (dtype, mine, ref)
    full, pull = torch.func.vjp(lambda x: unshard(x, layout=layout), local[0])
    (grad,) = pull(torch.ones_like(full))  # every rank's ones, summed
    assert torch.equal(grad, torch.full_like(local[0], float(world)))


def ring_under_autocast(layout):
    """Under torch.autocast, ring_attention casts as the functional ops do (q float32 beside
    k bfloat16: bfloat16 out, where outside autocast that is a TypeError on every rank): the
    same out and gradients as the ring on inputs cast by hand, float32 gradients for float32
    shards."""
    q, k, v, dout, _ = _inputs(4, 2, 4 * dist.get_world_size(), 8, 8, torch.float32)
    local = [shard(t, layout=layout).detach().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu"):
        out = ring_attention(local[0], local[1].bfloat16(), local[2], is_causal=True,
                             layout=layout)
    (out.float() * shard(dout, layout=layout)).sum().backward()
    by_hand = [t.detach().bfloat16().requires_grad_() for t in local]
    want = ring_attention(*by_hand, is_causal=True, layout=layout)
    (want.float() * shard(dout, layout=layout)).sum().backward()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    for mine, ref in zip(local, by_hand):
        assert mine.grad.dtype == torch.float32
        torch.testing.assert_close(mine.grad, ref.grad.float(), rtol=0, atol=0)


def ddp_transformer_matches(steps=3):
    """attnx.nn.Transformer trained under DistributedDataParallel (each rank half the batch)
    ends with the weights of the single-process run on the whole batch."""
    from torch.nn.parallel import DistributedDataParallel

    import attnx.nn as ann
    rank, world = dist.get_rank(), dist.get_world_size()

    def model():
        torch.manual_seed(0)
        return ann.Transformer(d_model=16, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=24, dropout=0.0, batch_first=True,
                               dtype=torch.float64)

    g = torch.Generator().manual_seed(1)
    src, tgt = (torch.randn(2 * world, n, 16, generator=g, dtype=torch.float64) for n in (7, 5))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)

    def train(net, src, tgt):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            net(src, tgt, tgt_mask=mask, tgt_is_causal=True).pow(2).mean().backward()
            opt.step()

    single = model()
    train(single, src, tgt)
    ddp = DistributedDataParallel(model())
    mine = slice(2 * rank, 2 * rank + 2)
    train(ddp, src[mine], tgt[mine])
    for (name, a), b in zip(ddp.module.named_parameters(), single.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


class _CausalSelfAttention(torch.nn.Module):
    """A decoder's attention block; `sharded=True` runs it on this rank's shard of the
    sequence with ring_attention (context parallelism), else on the whole sequence."""

    def __init__(self, dim=16, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, dtype=torch.float64)
        self.out = torch.nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x, sharded):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).transpose(1, 3).unbind(2)
        if sharded:
            y = ring_attention(q, k, v, is_causal=True)
        else:
            y = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


def context_parallel_matches(length=512):
    """A long sequence split over the ranks: forward and backward of an attention block with
    ring_attention == the single-process block; parameter gradients summed over the ranks."""
    torch.manual_seed(0)
    block = _CausalSelfAttention()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, length, 16, generator=g, dtype=torch.float64)
    target = torch.randn(1, length, 16, generator=g, dtype=torch.float64)
    full = x.clone().requires_grad_()
    (block(full, sharded=False) * target).sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    local = shard(x, dim=1).requires_grad_()
    y = block(local, sharded=True)
    (y * shard(target, dim=1)).sum().backward()
    tol = _tol(torch.float64)
    torch.testing.assert_close(local.grad, shard(full.grad, dim=1), **tol)
    for p, want in zip(block.parameters(), ref):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, want, **tol)


def nan_on_one_rank_keeps_the_float64_ring(layout):
    """A NaN in one rank's q (its own row's output NaN) must not switch the float64 ring off
    for the other ranks' finite rows whose float32 scores pass the range: the ranks' maximum
    of a NaN and a number depended on their order (ring._max_abs)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, *_ = _inputs(1, 1, 8 * world, 4, 4, torch.float32)
    row = 8 * world - 1  # the last rank's last row (both layouts)
    q[:, 0, row, 0] = 3e19
    k[:, 0, 1, 0], k[:, 0, -1, 0] = 3e19, 2.5e19
    q[:, 0, 0, 1] = float("nan")  # rank 0's first row (both layouts)
    out = ring_attention(*(shard(t, layout=layout) for t in (q, k, v)), layout=layout)
    s = q[:, 0].double() @ k[:, 0].double().transpose(-2, -1) / 2.0
    gold = (torch.softmax(s, -1) @ v[:, 0].double()).float().unsqueeze(1)
    want = shard(gold, layout=layout)
    finite = ~want.isnan().any(-1)  # the NaN row's own output is NaN, the rest is not
    assert finite.sum() == want.shape[0] * want.shape[2] - (rank == 0) * want.shape[0]
    torch.testing.assert_close(out[finite], want[finite], **_tol(torch.float32))


def peer_dies_mid_ring(timeout_s):
    """Rank 1 dies between the forward and the backward: rank 0's backward ring raises within
    the process group's timeout instead of waiting for it forever."""
    rank = dist.get_rank()
    q, k, v, *_ = _inputs(2, 2, 8, 4, 4, torch.float32)
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, is_causal=True)
    if rank == 1:
        os._exit(0)  # gone without a word, as a crashed or killed rank is
    start = time.monotonic()
    try:
        out.sum().backward()
    except RuntimeError:
        waited = time.monotonic() - start
        assert waited < timeout_s + 10, f"rank 0 raised only after {waited:.0f} s"
        os._exit(0)  # the group is broken: nothing to tear down
    raise AssertionError("the backward ring finished without its peer")


CHECKS = {f.__name__: f for f in (ring_matches, shard_roundtrip, bad_input_everywhere,
                                  outside_a_subgroup, softcap_matches, ring_under_autocast,
                                  ddp_transformer_matches, context_parallel_matches,
                                  peer_dies_mid_ring, no_second_order,
                                  ring_under_torch_func, nan_on_one_rank_keeps_the_float64_ring)}

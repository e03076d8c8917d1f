"""Ring attention: K/V shards travel a ring of ranks while each rank attends its queries to the
shard in hand; partial results merge by their log-sum-exp. The backward is a ring too: the
K/V shards travel again, each rank adds its block gradients to the dK/dV accumulator that
travels with them, and the accumulator ends at the shard's owner.

Communication is overlapped with compute: the next shard's receive (and the current one's send)
is posted before the kernels run on the shard in hand. A shard travels only as far as the last
rank whose queries the band admits to it (a causal contiguous layout stops at the last rank, a
window stops a few ranks on); every rank derives the same schedule from the global band, so
sends and receives always pair up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .. import _dispatch, _validate
from . import blocks, checks
from .layout import segments
from .merge import merge

# Message tags: the forward/backward K/V shard, a travelling dK/dV accumulator, and the
# accumulator's last hop back to its owner.
_TAG_KV, _TAG_DKV, _TAG_HOME = 7301, 7302, 7303


@dataclass(frozen=True)
class _Ring:
    """The schedule shared by every rank of one call."""
    group: object
    rank: int
    world: int
    local_len: int
    layout: str
    lo: int  # the global band
    hi: int
    scale: float
    kernels: blocks.Kernels
    softcap: object  # None or the cap (for the float64 kernels of a backward that needs them)
    v_max: float  # max|v| over every rank (the agreement's)

    def segs(self, rank: int) -> tuple:
        return segments(rank, self.world, self.local_len, self.layout)

    def blocks(self, q_rank: int, kv_rank: int) -> list:
        return blocks.plan(self.segs(q_rank), self.segs(kv_rank), self.lo, self.hi)

    def reach(self, owner: int) -> int:
        """How many hops the shard of `owner` travels: to the last rank after it, in ring
        order, whose queries attend some of its keys (0: it never leaves its owner)."""
        last = 0
        for t in range(1, self.world):
            if self.blocks((owner + t) % self.world, owner):
                last = t
        return last

    def peer(self, rank: int) -> int:
        import torch.distributed as dist
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


def _send(ring, tensor, to, tag):
    import torch.distributed as dist
    return dist.isend(tensor, ring.peer(to % ring.world), group=ring.group, tag=tag)


def _recv(ring, tensor, frm, tag):
    import torch.distributed as dist
    return dist.irecv(tensor, ring.peer(frm % ring.world), group=ring.group, tag=tag)


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, *likes):
    out, at = [], 0
    for like in likes:
        out.append(buf[at:at + like.numel()].view(like.shape))
        at += like.numel()
    return out


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _forward(ring: _Ring, q, k, v):
    """(out, lse, each block's own lse by (step, block)) of this rank's rows, out in the
    accumulation dtype (the backward's D = rowsum(dout out) from it, not from its rounding to
    bfloat16)."""
    r, w = ring.rank, ring.world
    reach = [ring.reach(s) for s in range(w)]
    acc = _acc_dtype(q.dtype)
    out = q.new_zeros(q.shape[:-1] + (v.shape[-1],), dtype=acc)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
    kv, touched = _pack(k, v), bytearray(q.shape[-2])  # rows that hold a partial result
    block_lse = {}
    for t in range(w):
        s = (r - t) % w
        holding = t <= reach[s]  # else that shard stopped before reaching this rank
        works, nxt = [], None
        if holding and t < reach[s]:
            works.append(_send(ring, kv, r + 1, _TAG_KV))
        if t + 1 < w and t + 1 <= reach[(s - 1) % w]:
            nxt = torch.empty_like(kv)
            works.append(_recv(ring, nxt, r - 1, _TAG_KV))
        ks, vs = _unpack(kv, k, v)
        for i, b in enumerate(ring.blocks(r, s) if holding else ()):
            o, l = ring.kernels.fwd(q[:, :, b.q0:b.q1], ks[:, :, b.k0:b.k1], vs[:, :, b.k0:b.k1],
                                    ring.scale, b.lo, b.hi)
            block_lse[t, i] = l
            rows = slice(b.q0, b.q1)
            if any(touched[rows]):
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                         o.to(acc), l.to(acc))
            else:  # the rows' first result: nothing to merge with
                out[:, :, rows], lse[:, :, rows] = o, l
            touched[rows] = b"\x01" * (b.q1 - b.q0)
        for work in works:
            work.wait()
        if nxt is not None:
            kv = nxt
    return out, lse, block_lse


def _backward(ring: _Ring, dout, q, k, v, out, lse, grad_lse, block_lse):
    r, w = ring.rank, ring.world
    reach = [ring.reach(s) for s in range(w)]
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk0, dv0 = (torch.zeros(x.shape, dtype=acc, device=x.device) for x in (k, v))
    kv, own, pending = _pack(k, v), None, []
    for t in range(w):
        s = (r - t) % w
        holding = t <= reach[s]
        works, nxt, incoming = [], None, None
        # Posted in the order the sender sends: last step's accumulator, then the next shard.
        if holding and t >= 1:
            incoming = torch.empty(dk0.numel() + dv0.numel(), dtype=acc, device=q.device)
            dkv_work = _recv(ring, incoming, r - 1, _TAG_DKV)
        if holding and t < reach[s]:
            works.append(_send(ring, kv, r + 1, _TAG_KV))
        if t + 1 < w and t + 1 <= reach[(s - 1) % w]:
            nxt = torch.empty_like(kv)
            works.append(_recv(ring, nxt, r - 1, _TAG_KV))
        if holding:
            ks, vs = _unpack(kv, k, v)
            dk, dv = torch.zeros_like(dk0), torch.zeros_like(dv0)
            for i, b in enumerate(ring.blocks(r, s)):
                rows, keys = slice(b.q0, b.q1), slice(b.k0, b.k1)
                gl = None if grad_lse is None else grad_lse[:, :, rows]
                gq, gk, gv = ring.kernels.bwd(dout[:, :, rows], q[:, :, rows], ks[:, :, keys],
                                              vs[:, :, keys], out[:, :, rows], lse[:, :, rows],
                                              block_lse[t, i], ring.scale, b.lo, b.hi, gl)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            dkv = _pack(dk, dv)
            if incoming is not None:
                dkv_work.wait()
                dkv += incoming
            if t < reach[s]:
                pending.append((_send(ring, dkv, r + 1, _TAG_DKV), dkv))
            elif t >= 1:
                pending.append((_send(ring, dkv, s, _TAG_HOME), dkv))
            else:
                own = dkv
        for work in works:
            work.wait()
        if nxt is not None:
            kv = nxt
    if own is None:  # this rank's shard travelled: its gradients come home from its last holder
        own = torch.empty(dk0.numel() + dv0.numel(), dtype=acc, device=q.device)
        _recv(ring, own, r + reach[r], _TAG_HOME).wait()
    for work, _buf in pending:
        work.wait()
    dk, dv = _unpack(own, dk0, dv0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block_keys(ring: _Ring) -> list:
    """The (step, block) keys of the blocks _forward runs on this rank, in its order."""
    r, w = ring.rank, ring.world
    return [(t, i) for t in range(w) if t <= ring.reach((r - t) % w)
            for i in range(len(ring.blocks(r, (r - t) % w)))]


def _separate_out(ring: _Ring, q) -> bool:
    """Whether the backward's out is the accumulation, apart from the result: where the kernels
    take it wide (wide_out) and it is wider than q (half precision)."""
    return ring.kernels.wide_out and _acc_dtype(q.dtype) != q.dtype


class _RingAttention(torch.autograd.Function):
    """(out, lse) of the ring, differentiable in q, k, v; then what the backward keeps, as
    outputs not differentiable (torch.func's transforms save only inputs and outputs): the
    accumulated out where _separate_out (else an empty tensor), the accumulated lse where it
    is float64 (else an empty tensor), each block's own lse in _block_keys' order."""

    @staticmethod
    def forward(q, k, v, ring):
        out, lse, block_lse = _forward(ring, q, k, v)
        result, lse32 = out.to(q.dtype), lse.float()
        return (result, lse32, out if _separate_out(ring, q) else q.new_empty((0,)),
                q.new_empty((0,)) if lse32 is lse else lse, *block_lse.values())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, ring = inputs
        result, lse32, wide_out, wide_lse, *block_lse = output
        ctx.set_materialize_grads(False)  # an unused lse passes None, not a tensor of zeros
        ctx.mark_non_differentiable(wide_out, wide_lse, *block_lse)
        ctx.ring = ring
        ctx.block_keys = _block_keys(ring)
        # the backward's out: the float32 accumulation where its kernels take it (wide_out);
        # the blocks' own lse saved too (not kept on ctx: freed with the rest after the backward)
        ctx.save_for_backward(q, k, v, wide_out if _separate_out(ring, q) else result,
                              wide_lse if q.dtype == torch.float64 else lse32, *block_lse)

    @staticmethod
    def backward(ctx, dout, grad_lse, *_):
        # No graph of the gradients: the block kernels' graphs (the reference backend's) would
        # miss the ring's sends and give wrong second-order gradients; create_graph=True gets
        # gradients whose own backward raises instead, on every rank that reaches them.
        with torch.no_grad():
            dq, dk, dv = _RingAttention._grads(ctx, dout, grad_lse)
        if torch.is_grad_enabled():
            dq, dk, dv = _NoSecondOrder.apply(dq, dk, dv, *ctx.saved_tensors[:3])
        return dq, dk, dv, None

    @staticmethod
    def _grads(ctx, dout, grad_lse):
        q, k, v, out, lse, *saved_lse = ctx.saved_tensors
        block_lse = dict(zip(ctx.block_keys, saved_lse))
        ring = ctx.ring
        dout = torch.zeros_like(out, dtype=q.dtype) if dout is None else dout.contiguous()
        if q.dtype != torch.float64 and _dout_may_overflow(ring, dout, v):
            # dout V^T past float32's range: the blocks' float32 kernels would rerun in float64
            # from a forward on the block alone, not the whole row; the whole backward in
            # float64 instead (every rank alike: the ranks agreed on it)
            dtypes = (q.dtype, k.dtype, v.dtype)
            q, k, v, out, lse, dout = (t.double() for t in (q, k, v, out, lse, dout))
            grad_lse = None if grad_lse is None else grad_lse.double()
            ring = replace(ring, kernels=blocks.kernels(
                _float64_backend(q, k, v, ring.scale, ring.softcap), ring.softcap))
            dq, dk, dv = _backward(ring, dout, q, k, v, out, lse, grad_lse, block_lse)
            return dq.to(dtypes[0]), dk.to(dtypes[1]), dv.to(dtypes[2])
        return _backward(ring, dout, q, k, v, out, lse, grad_lse, block_lse)


class _NoSecondOrder(torch.autograd.Function):
    """The ring's gradients (dq, dk, dv) tied to its inputs (the rest) under create_graph=True:
    differentiating them raises."""

    @staticmethod
    def forward(dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):  # (torch.func.grad's backward records a graph)
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("attnx: ring_attention has no second-order gradients (on any "
                                  "backend)")


def _dout_may_overflow(ring: _Ring, dout, v) -> bool:
    """Whether Ev max|dout| max|v| (max|dout| over every rank: one all-reduce, which every rank
    of the backward makes) may pass the float32 bound below."""
    import torch.distributed as dist
    d_max = _max_abs(dout).reshape(1)
    if ring.world > 1:
        d_max = d_max.to(checks._device(ring.group))
        dist.all_reduce(d_max, op=dist.ReduceOp.MAX, group=ring.group)
    return not v.shape[-1] * ring.v_max * float(d_max) <= _F32_BOUND  # (inf * 0: NaN)


# Scores or value products whose magnitude may pass this run the whole ring in float64: a
# block's float32 lse past 3.4e38 would be inf (its kernel reruns its scores in float64, but
# returns lse in float32) and the merge then NaN; a backward's dout V^T past the range makes
# its kernel rerun in float64 from a forward on the block alone, not the whole row. scale * E *
# max|q| * max|k| bounds every |score| (Cauchy-Schwarz, with |x|_2 <= sqrt(E) max|x|), Ev *
# max|v| every dout V^T per unit of dout, the maxima taken over every rank in the call's
# agreement; a bound under 2^100 leaves every lse and merge weight far inside float32. dout is
# known only in the backward, which checks Ev max|v| max|dout| against the same bound
# (_dout_may_overflow) and runs in float64 past it.
_F32_BOUND = 2.0 ** 100


def _extremes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(max|q|, max|k|, max|v|) of this rank's shards: no copy of them, one device-to-host
    read."""
    if not q.numel() or not k.numel():  # no scores
        return 0.0, 0.0, 0.0
    return tuple(torch.stack([_max_abs(t) for t in (q, k, v)]).tolist())


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    """max|t| as a float64 0-d tensor on t's device (0 for an empty t); inf where t holds a
    NaN: the ranks' maximum of a NaN and a number depends on their order (Python's max, gloo's
    MAX), and a NaN on one rank then switched the float64 ring off for rows of the others that
    needed it."""
    if not t.numel():
        return torch.zeros((), dtype=torch.float64, device=t.device)
    return torch.linalg.vector_norm(t.detach(), float("inf")).double().nan_to_num(nan=float("inf"))


def _float64_backend(q, k, v, scale: float, softcap) -> str:
    """The backend the dispatcher picks for the float64 copies q, k, v (a float64 ring, or
    backward, may leave the one chosen for the inputs' dtype: CUDA kernels take no float64)."""
    return _dispatch.select("sdpa", _validate.sdpa_call(q, k, v, None, 0.0, False, scale, True,
                                                        None, None, False, softcap=softcap))


def _may_overflow(call, q_max: float, k_max: float, v_max: float) -> bool:
    """Whether the float32 accumulation (float32, bfloat16 and float16 inputs) might overflow
    a score, soft-capped or not (a cap bounds the scores, not the products: inf - inf is NaN),
    or the backward's products of values."""
    if call.q.dtype == torch.float64:
        return False
    # (not <=: a NaN product, inf times 0, counts as past the bound)
    return not (abs(call.scale) * call.q.shape[-1] * q_max * k_max <= _F32_BOUND
                and call.v.shape[-1] * v_max <= _F32_BOUND)


def ring_attention(q, k, v, *positional, group=None, is_causal=False, scale=None,
                   layout="zigzag", window=None, softcap=None, backend=None, return_lse=False,
                   **unsupported):
    """Attention of this rank's shard of the queries to the whole sequence, whose K/V shards
    are spread over the ranks of `group` (see API.md, `attnx.distributed`).

    q (..., Hq, L_local, E), k (..., Hkv, L_local, E), v (..., Hkv, L_local, Ev): this rank's
    shard of the sequence in `layout`. Returns the shard's output (..., Hq, L_local, Ev), and
    with `return_lse=True` also its float32 lse (..., Hq, L_local).

    Any other argument (a fourth positional one, attn_mask=, dropout_p=, ...) raises a
    TypeError on every rank, and a `group` that is no process group a ValueError (told over
    the default group: where the other ranks use it).
    """
    rank, world, group, error = checks.member(group)
    try:
        if error is not None:
            raise error
        checks.unsupported_arguments("ring_attention", positional, unsupported)
        call = _validate.sdpa_call(q, k, v, None, 0.0, False, scale, True, None, backend,
                                   return_lse, softcap=softcap, names=("q", "k", "v"))
        checks.check_device("q", call.q)  # (sdpa_call: k and v on q's device)
        # The dispatcher's choice for the whole shard is the blocks' too: a backend that serves
        # the call (softcap included) with its lse serves every block of it.
        name = _dispatch.select("sdpa", call)
        spec = checks.local_spec(call, world, is_causal, window, layout, name)
        extremes, error = _extremes(call.q, call.k, call.v), None
    except Exception as exc:  # any: told to every rank before this one raises it
        spec, extremes, error = None, (0.0, 0.0, 0.0), exc
    q_max, k_max, v_max = checks.agree(spec, error, rank, world, group, extremes)
    if spec.batch == 0 or spec.heads_q == 0:  # nothing to attend: no ring (it divides by heads)
        shape = call.q.shape[:-1] + (call.v.shape[-1],)
        anchor = (call.q.sum() + call.k.sum() + call.v.sum()) * 0  # keeps the inputs' graph
        out = call.q.new_zeros(shape) + anchor
        lse = call.q.new_full(shape[:-1], float("-inf"), dtype=torch.float32) + anchor.float()
        out = out.reshape(call.prefix + tuple(out.shape[-2:]))
        return (out, lse.reshape(call.prefix + (lse.shape[-1],))) if return_lse else out
    qf, kf, vf = (t.contiguous() for t in (call.q, call.k, call.v))
    if _may_overflow(call, q_max, k_max, v_max):  # the same answer on every rank
        qf, kf, vf = (t.to(torch.float64) for t in (qf, kf, vf))
        name = _float64_backend(qf, kf, vf, call.scale, softcap)
    ring = _Ring(group, rank, world, spec.local_len, spec.layout, spec.lo, spec.hi, call.scale,
                 blocks.kernels(name, spec.softcap), spec.softcap, v_max)
    out, lse = _RingAttention.apply(qf, kf, vf, ring)[:2]
    out = out.to(call.q.dtype)
    out = out.reshape(call.prefix + tuple(out.shape[-2:]))
    if not return_lse:
        return out
    return out, lse.reshape(call.prefix + (lse.shape[-1],))

"""What the SDPA and additive kernels share: the admissible-key test, the online softmax,
launch configurations."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .rng import keep, row_keys

MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2


def _read_interpret() -> bool:
    knobs = getattr(triton, "knobs", None)  # Triton < 3.4 has no knobs
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


# Read once, when this module is imported: the ops registered below are custom_ops or
# triton_ops by it, so the mode is fixed then (TRITON_INTERPRET is set before import). And
# Triton 3.8 reads its knob through a C function (libtriton.getenv_bool) that torch.compile
# cannot trace: the dispatcher's availability check, asked on every CUDA SDPA call, broke
# fullgraph=True.
_INTERPRETING = _read_interpret()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, as Triton read it when
    attnx's Triton kernels were imported)."""
    return _INTERPRETING


def register_op(name: str):
    """Decorator registering `attnx::<name>`: a triton_op, so torch.compile sees the kernels
    inside; under the interpreter, where wrap_triton cannot trace a kernel, an opaque
    custom_op (shape-only fake kernels are registered for both)."""
    register = torch.library.custom_op if interpreting() else torch.library.triton_op
    return register(f"attnx::{name}", mutates_args=())


def launcher(kernel):
    """`kernel` as an op launches it: through wrap_triton, so torch.compile traces the launch
    inside a triton_op; directly under the interpreter, whose kernels run inside opaque
    custom_ops and which torch 2.11's wrap_triton rejects."""
    return kernel if interpreting() else torch.library.wrap_triton(kernel)


# Rows whose |lse| exceeds this may have lost log(l) to rounding (csrc/cpu/huge_lse.h): a
# row-sums pass (in sdpa, the backward's pre-pass) finds r_i = sum_j exp(s_ij - lse_i) there
# (1 elsewhere), and the backward runs on dO / r, which is exact since dV = P^T dO and
# dS = P (dP - D) are linear in dO.
HUGE_LSE = 256.0


@triton.jit
def huge_rows(lse, huge_lse):
    """The rows HUGE_LSE is about (empty rows, lse = +-inf, are not)."""
    return (tl.abs(lse) > huge_lse) & (tl.abs(lse) < float("inf"))


def sink_probabilities(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(sink - lse): each row's probability of its sink (the backward's dsinks); 0 under a
    sink of -inf, also on a row that admitted no key, whose lse is then -inf too."""
    return torch.where(sinks == float("-inf"), 0.0, torch.exp(sinks - lse))


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, shape: tuple,
              dims) -> torch.Tensor:
    """dsinks: d lse_i / d sink = P_sink,i = exp(sink - lse_i) / r_i, and the sink's value is 0:
    its score gradient is P_sink,i (0 - D_i), summed over `dims`, with delta holding D_i / r_i;
    in delta's dtype, sinks viewed as `shape` against lse."""
    p = sink_probabilities(sinks.to(delta.dtype).view(shape), lse)
    return -(p * delta).sum(dims).to(sinks.dtype)


def clamped_band(lo: int, hi: int, lq: int, lk: int) -> tuple[int, int]:
    """The band (lo, hi) in [-Lq, Lk]: the same admissible pairs, and i + lo, i + hi cannot
    overflow in the kernels whatever a direct caller of the ops passes."""
    return min(max(lo, -lq), lk), min(max(hi, -lq), lk)


def divide_rows(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x (..., L, D) with row i divided by r (..., L), in x's dtype (rows with r = 1 unchanged)."""
    return (x.float() / r.unsqueeze(-1)).to(x.dtype)


def mask_kind(mask) -> int:
    if mask is None:
        return MASK_NONE
    return MASK_BOOL if mask.dtype == torch.bool else MASK_FLOAT


def mask_arg(mask, dummy: torch.Tensor):
    """(tensor the kernel reads, its 4 strides); bool masks are read as bytes."""
    if mask is None:
        return dummy, (0, 0, 0, 0)
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask, tuple(mask.stride())


def length_bucket(n: int) -> int:
    """What the autotuners key on for a length: its power-of-two ceiling, so a decoding loop or
    varying batch lengths tune once per bucket, where an exact-length key re-tuned (seconds)
    at every new length."""
    return triton.next_power_of_2(n)


# exp(x) = exp2(x * LOG2E): the kernels fold LOG2E into the score scale, so one FMA per score
# feeds the exp2 instruction (tl.exp lowers to a multiply and ex2 anyway).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def tanh(x, SMALL_EXACT: tl.constexpr):
    """tanh from one exp2 of -2|x| (in (0, 1], so nothing overflows): Triton has no tanh that
    both the compiler and the interpreter take. That form's error is absolute, ~fp32's eps: as
    |x| -> 0 its relative error grows as eps / |x| (a softcap of 500 over scores ~1 erred 10x
    torch's float32). So float32 x below 1/2 takes x + x^3 P(x^2), P least-squares on [0, 1/2]
    (0.63 eps relative at most, evaluated in float32); float64 x (the reruns) keeps the
    exp form, whose 1e-16 is plenty. SMALL_EXACT=False keeps the exp form alone: for fp16 and
    bf16 inputs, whose rounding dominates, where the branch would cost the softcap forward's
    in-band loop ~20% more PTX instructions (float32's: 4.5%, with tf32x3's three dots); but
    not under a cap past EXACT_TANH_CAP (softcap_kind), where the scores' error cap x eps would
    not be small."""
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0, -t, t)
    if SMALL_EXACT and x.dtype == tl.float32:
        y = x * x
        p = ((0.01721986010670662 * y - 0.05303465202450752) * y + 0.13325712084770203) * y \
            - 0.3333313763141632
        t = tl.where(tl.abs(x) < 0.5, x + (x * y) * p, t)
    return t


@triton.jit
def modified(s, cap, slope, offs_i, offs_j, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
             FP32_INPUTS: tl.constexpr):
    """(scores s, already scaled, after softcap cap * tanh(s / cap) and ALiBi
    -slope * |i - j|; tanh(s / cap), whose 1 - t^2 is the softcap's derivative, or s itself
    without SOFTCAP). offs_i, offs_j: query and key positions broadcast to s's tile, aligned
    by the caller; slope a scalar or broadcast likewise. FP32_INPUTS: the tanh's exact small
    branch (a cap far above the scores, 500 over ~1, erred 10x torch's float32 without it)."""
    t = s
    if SOFTCAP:
        t = tanh(s / cap, FP32_INPUTS or SOFTCAP == SOFTCAP_HUGE)
        s = cap * t
    if ALIBI:
        s = s - slope * tl.abs(offs_i - offs_j).to(tl.float32)
    return s, t


def head_block(d: int) -> int:
    """The padded (power-of-two, >= 16 for tl.dot) block for a head dim; loads mask the rest."""
    return max(16, triton.next_power_of_2(d))


def head_blocks(d: int) -> tuple[int, int]:
    """A head dim as one or two power-of-two chunks (the second 0 for none), so that 48, 80, 96,
    160 and 192 are computed unpadded where one power-of-two block pads 96 to 128 and 160/192
    to 256: the largest power of two <= d, then the rest rounded up (>= 16 for tl.dot). The
    padding is at most 25% from d = 40 up (worst just past 1.5 x a power of two), 31% for
    d = 33-39 and 47% for d = 17-23 (one 32 block; two chunks of 16 would not be smaller)."""
    if d <= 32:
        return head_block(d), 0
    first = 1 << (d.bit_length() - 1)
    rest = head_block(d - first) if d > first else 0
    return (2 * first, 0) if rest == first else (first, rest)


# The SOFTCAP constexpr (softcap_kind): no cap, a cap, or a cap past EXACT_TANH_CAP, which
# takes tanh's exact small-|x| branch whatever the dtype. The exp form's absolute error, ~fp32's
# eps, becomes cap x eps in the scores: 1.5e-5 at 256, within fp16's rounding of scores near 1;
# at 1e6 the fp16 outputs erred 5x the bound, and at 1e30 every score came out 0.
SOFTCAP_HUGE = tl.constexpr(2)
EXACT_TANH_CAP = 256.0


def softcap_kind(softcap: Optional[float]) -> int:
    """The SOFTCAP constexpr of a call's softcap (None: none)."""
    if softcap is None:
        return 0
    return SOFTCAP_HUGE.value if softcap > EXACT_TANH_CAP else 1


# The DOT_PREC of float32 inputs: kernels test DOT_PREC == FP32_DOT for what only float32 needs.
FP32_DOT = tl.constexpr("tf32x3")


def dot_precision(dtype: torch.dtype) -> str:
    """The DOT_PREC constexpr of `dot`."""
    if dtype == torch.float32:
        # Three TF32 tensor-core products (big*big + big*small + small*big): about fp32's
        # error (tests/test_triton.py emulates it; the interpreter computes plain fp32), where
        # one TF32 product would lose to PyTorch's own fp32 error and "ieee" runs on the FMA
        # units, spilling heavily and compiling for tens of seconds (issue 18).
        return FP32_DOT.value
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"  # the interpreter's tl.dot mistakes bfloat16 for integers
    return "tf32"  # ignored for 16-bit inputs


# Every register a thread may have: without the bound ptxas may aim at occupancy and hold a
# kernel at 168 registers with spills (Triton 3.6's ptxas on sm_80, the compile test found).
MAX_REGISTERS = 255


def configs(shapes, small):
    """Autotuning configs: (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples for Ampere/Hopper,
    one small config under the interpreter (it runs every program in Python)."""
    if interpreting():
        return [triton.Config({"BLOCK_M": small[0], "BLOCK_N": small[1]}, num_warps=4)]
    return gpu_configs(shapes)


def gpu_configs(shapes):
    """The GPU's autotuning configs of (BLOCK_M, BLOCK_N, num_warps, num_stages) tuples, also
    under the interpreter (tests/test_triton_configs.py runs each one there)."""
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s,
                          maxnreg=MAX_REGISTERS) for m, n, w, s in shapes]


def shared_memory_limit() -> int:
    """The opt-in shared memory per block of the current CUDA device: what a launch may use
    (163 KiB on an A100, 227 KiB on an H100)."""
    from triton.runtime import driver
    return _device_shared_limit(driver.active.get_current_device())


@functools.lru_cache(maxsize=None)
def _device_shared_limit(device: int) -> int:
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(device)["max_shared_mem"]


def target_arch() -> int:
    """The current CUDA device's arch as Triton compiles for it (80: sm_80, 90: sm_90)."""
    from triton.runtime import driver
    return _device_arch(driver.active.get_current_device())


@functools.lru_cache(maxsize=None)
def _device_arch(device: int) -> int:
    from triton.runtime import driver
    return int(driver.active.get_current_target().arch)


def multiprocessors() -> int:
    """SMs of the current CUDA device; under the interpreter a nominal 2, so the tests' small
    grids reach every GQA split of the dK/dV kernel (sdpa._gqa_split)."""
    if interpreting():
        return 2
    from triton.runtime import driver
    return _device_sms(driver.active.get_current_device())


@functools.lru_cache(maxsize=None)
def _device_sms(device: int) -> int:
    from triton.runtime import driver
    return driver.active.utils.get_device_properties(device)["multiprocessor_count"]


# Registers (32-bit words per thread) a config's register tiles may take, of 255: the rest
# holds pointers, masks and the compiler's temporaries. From the sm_80/sm_90 compiles
# (tests/test_triton_compile.py): fp16/bf16 configs over it spill, configs within it do not.
REGISTER_WORDS = 128


def warps_fit(element_size: int, num_warps: int, rows: int) -> bool:
    """Whether a config's warps suit its accumulator's `rows` (what a program owns).

    fp32 (tf32x3 products) over two warpgroups (8 warps) needs 128 rows, 16 a warp: with fewer,
    Triton splits the warps along the head dim, and on sm_90 such backward configs faulted
    (illegal address) or miscomputed dK (H200, Triton 3.6, 2026-11-26: dK/dV over 16-64 queries
    x 64 keys and dQ over 64 x 32/64 with 8 warps; every 4-warp config and the 128-row 8-warp
    ones passed). Held for every kernel and arch: fp32 is not where speed is."""
    return element_size != 4 or num_warps <= 4 or num_warps * 16 <= rows


def pruner(tiles, compiled_fits=None):
    """The autotuner's early_config_prune for a kernel whose config `tiles(meta)` describes (meta:
    the config's BLOCK_M, BLOCK_N with the launch's arguments) as a dict of element counts:
    `staged` (tiles each pipeline stage buffers in shared memory; `mask`, the mask's tile, in its
    own dtype), `resident` (operand tiles of
    tl.dot staged once), `acc` (fp32 tiles in registers: accumulators, scores), `held`
    (input-dtype tiles kept in registers) and `rows` (the accumulator's rows: what the program
    owns).

    Shared memory, in bytes of Q's dtype: (num_stages + 1) * staged + resident, the resident
    tiles twice in fp32, where tf32x3 splits each operand in two; it must fit the device. Registers:
    acc + held * (element size / 4) over the config's threads must fit REGISTER_WORDS, for head
    dims up to 128 (wider ones keep every config that fits shared memory). For
    fp16/bf16 with head dims up to 128 the compile test holds both rules to the compiler's own
    figures on sm_80 and sm_90 (`needs` is the shared-memory estimate).

    `compiled_fits(meta, arch)`, where given, keeps configs over the register rule that compiles
    for that arch showed to fit (meta with the config's tiles, warps and stages): the rule counts
    every operand tile in registers, where sm_90's wgmma reads them from shared memory."""
    def needs(config, named_args, **kwargs) -> int:
        t = tiles({**named_args, **kwargs, **config.kwargs})
        size = named_args["Q"].element_size()
        resident = t["resident"] * (2 if size == 4 else 1)
        # A mask's tile is staged with the keys, in the mask's own dtype.
        mask = t["mask"] * named_args["M"].element_size() if kwargs["MASK_KIND"] else 0
        return (config.num_stages + 1) * (size * t["staged"] + mask) + size * resident

    def words(config, named_args, **kwargs) -> float:
        t = tiles({**named_args, **kwargs, **config.kwargs})
        held = t["held"] * named_args["Q"].element_size() / 4
        return (t["acc"] + held) / (32 * config.num_warps)

    def compiled(config, named_args, **kwargs) -> bool:
        meta = {**named_args, **kwargs, **config.kwargs, "num_warps": config.num_warps,
                "num_stages": config.num_stages}
        return compiled_fits is not None and compiled_fits(meta, target_arch())

    def warps_ok(config, named_args, **kwargs) -> bool:
        rows = tiles({**named_args, **kwargs, **config.kwargs})["rows"]
        return warps_fit(named_args["Q"].element_size(), config.num_warps, rows)

    def prune(configs_, named_args, **kwargs):
        limit = shared_memory_limit()
        fit = [c for c in configs_ if needs(c, named_args, **kwargs) <= limit
               and warps_ok(c, named_args, **kwargs)]
        kept = [c for c in fit if words(c, named_args, **kwargs) <= REGISTER_WORDS
                or compiled(c, named_args, **kwargs)]
        # Heads over 128 wide spill in every config but the smallest tiles: there the autotuner
        # times every config that fits (spilling, bigger tiles may win), as it does where no
        # config keeps within the registers. A device with less shared memory than sm_80's gets
        # the least hungry config, which the estimate's margin may still let launch.
        wide = max(kwargs["BLOCK_D"] + kwargs.get("BLOCK_D2", 0),
                   kwargs.get("BLOCK_DV", 0) + kwargs.get("BLOCK_DV2", 0))
        if wide > 128 or not kept:
            kept = fit
        kept = kept or [min(configs_, key=lambda c: needs(c, named_args, **kwargs))]
        # ATTNX_TRITON_AUTOTUNE=0: the first config kept, no tuning (scripts/gpu_check.sh's test
        # step, where tuning every test's shape took the step's whole time; speed is the bench's)
        return kept[:1] if os.environ.get("ATTNX_TRITON_AUTOTUNE") == "0" else kept

    prune.needs = needs
    return prune


@triton.jit
def dot(a, b, DOT_PREC: tl.constexpr):
    """tl.dot with fp32 accumulation; "upcast" multiplies exactly-converted fp32 copies."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def dot_acc(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b, the sum made by the tensor cores' accumulator (no separate add)."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def negated(x):
    """-x, through float32 (exact in every dtype): Triton 3.8's interpreter negates a bfloat16
    tile wrongly (-x of 0.13 gave -31), and tests run the kernels there."""
    return (-x.to(tl.float32)).to(x.dtype)


@triton.jit
def offsets(rows, cols, sr, sc):
    """The int64 element offsets of a (rows, cols) tile with strides (sr, sc): a tile's offsets
    relative to its block's first element are loop-invariant, so int64 costs nothing per step,
    and no product of an index and a stride can wrap at 2^31 (issue 18 item 6)."""
    return rows.to(tl.int64)[:, None] * sr + cols.to(tl.int64)[None, :] * sc


@triton.jit
def load_tile(ptrs, rows, cols, R, C, CHECK_R: tl.constexpr, CHECK_C: tl.constexpr):
    """tl.load of a (rows, cols) tile, masked (zeros) only on the axes that may pass their bound
    R / C: blocks wholly inside the sequence and unpadded head dims load without a mask."""
    if CHECK_R:
        if CHECK_C:
            x = tl.load(ptrs, mask=(rows[:, None] < R) & (cols[None, :] < C), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < R, other=0.0)
    else:
        if CHECK_C:
            x = tl.load(ptrs, mask=cols[None, :] < C, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def inner_range(m0, Lq, Lk, start, end, window_lo, window_hi, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """[lo, hi): the key blocks of [start, end) (BLOCK_N-aligned from start) wholly inside the
    band and the keys for query rows m0.. (those < Lq): they need no band, bounds or mask
    arithmetic; [start, lo) and [hi, end) are the edge blocks. Rows past Lq are never stored,
    so their scores need no mask. Operands of // stay >= 0 (C and numpy round negatives
    differently)."""
    last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    lo = tl.cdiv(tl.maximum(last + window_lo, 0), BLOCK_N) * BLOCK_N
    lo = tl.minimum(tl.maximum(lo, start), end)
    hi = (tl.maximum(tl.minimum(m0 + window_hi + 1, Lk), 0) // BLOCK_N) * BLOCK_N
    return lo, tl.maximum(tl.minimum(hi, end), lo)


@triton.jit
def admit(s, m_ptr, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi,
          MASK_KIND: tl.constexpr):
    """Scores with inadmissible keys set to -inf (band, bounds, bool mask), float mask added."""
    inb = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    diff = offs_n[None, :] - offs_m[:, None]
    ok = inb & (diff >= window_lo) & (diff <= window_hi)
    if MASK_KIND == 1:
        allowed = tl.load(m_ptr + offsets(offs_m, offs_n, smm, smn), mask=inb, other=0)
        ok = ok & (allowed != 0)
    if MASK_KIND == 2:
        s = s + tl.load(m_ptr + offsets(offs_m, offs_n, smm, smn), mask=inb,
                        other=0.0).to(tl.float32)
    return tl.where(ok, s, float("-inf"))


def tiles_grid(length: int, block: int, heads: int) -> tuple[int]:
    """The grid of `tile_and_head`: one axis, whose cap (2^31 - 1) no tensor reaches, where
    (tiles, heads) on axes (x, y) failed at launch from 65536 heads (CUDA caps y and z at 65535)."""
    return (triton.cdiv(length, block) * heads,)


@triton.jit
def tile_and_head(L, BLOCK: tl.constexpr):
    """(first row of this program's tile, head b * H + h) on a `tiles_grid`: the tiles of one
    head are neighbours, as on a (tiles, heads) grid, so they meet its K/V in L2."""
    return split_tile(tl.program_id(0), L, BLOCK)


@triton.jit
def split_tile(index, L, BLOCK: tl.constexpr):
    """(first row of tile index % tiles, index // tiles) for the cdiv(L, BLOCK) tiles of L."""
    tiles = tl.cdiv(L, BLOCK)
    return (index % tiles) * BLOCK, index // tiles


@triton.jit
def key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of the key blocks that the band lets query rows m0.. reach."""
    last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    start = (tl.maximum(m0 + window_lo, 0) // BLOCK_N) * BLOCK_N
    return start, tl.minimum(last + window_hi + 1, Lk)


@triton.jit
def query_range(n0, Lq, Lk, window_lo, window_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of the query blocks that the band lets key columns n0.. reach."""
    last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    start = (tl.maximum(n0 - window_hi, 0) // BLOCK_M) * BLOCK_M
    return start, tl.minimum(last - window_lo + 1, Lq)


# The fp32 accumulator acc += P V overflows where bf16 or fp32 values near their max meet
# hundreds of keys (P <= 1 each). The additive forward and decoding keep their rows normalised
# (softmax_step, decode.py's loop alike: a multiply a probability, small beside their other
# work). The SDPA forward, bound by its exponentials, does not: a program with such rows
# (`overflowed`) reruns its keys with their probabilities scaled by 2^-OVERFLOW_SHIFT, the
# shift subtracted from exp's argument after the row max (`shift_exponent`): l and acc alike,
# so acc / l is unchanged (the rescale alphas, differences of maxima, are too), and the row's
# max takes the shift back for the lse and a sink's term. 2^-64 keeps L * max|v| * P *
# (dropout's 1 / (1 - p) <= 2^24) below fp32's max for any L < 2^31; keys under 2^-62 of the
# row max flush, negligibly. fp16 values (< 65504) cannot overflow the sum: its kernels keep
# one pass and no check.
OVERFLOW_SHIFT = tl.constexpr(64.0)
# The rerun walks its keys in one loop of RERUN_BLOCK_N-key edge blocks: the first pass's
# calls repeated let the compiler share their tiles' addresses and offsets (the pipelines'
# first tiles) with the first pass, which held them in registers across it
# (tests/test_triton_compile.py: forwards +25-75 registers on sm_80/sm_90, new spills).
RERUN_BLOCK_N = tl.constexpr(16)

# Finite inputs make scores past float32's range (|q . k * scale| > 3.4e38: |q| |k| ~ 1e19 in
# bf16 or fp32, a scale near its bound, a float32 mask's bias near its largest). The float32
# online softmax gives NaN there (inf - inf), or, where every admitted score of a row overflowed
# downward, a row that looks empty. The SDPA forward and decoding flag such rows
# (`admitted`, `scores_overflowed`) and sdpa_fwd_rerun.py and decode_rerun.py compute them in
# float64, which holds every product and sum of float32 values. The backward's kernels take
# scores and the lse times log2(e) (exp2): past LSE_LIMIT (float32's largest over log2(e)) they
# overflow, and probabilities come out 0 with no NaN to flag; its pre-pass flags such rows, and
# sdpa_bwd_rerun redoes the call in float64.
LSE_LIMIT = tl.constexpr(2.35e38)


@triton.jit
def admitted(s):
    """Scores of admitted pairs with +-inf as NaN, which reaches the row's sum (flagged): from
    finite inputs an admitted inf is an overflow (a refusing float mask's -inf is applied
    after), of the true score or of a dot's partial sum only (inf stays inf in a sum); taken as
    it is, a row whose admitted scores all overflowed downward would look empty, and a softcap
    would saturate it. (A bias of float32's lowest, as Hugging Face's masks hold, plus a score
    under 1e31 in size rounds to that lowest, not to -inf.) The SDPA forward's in-band loop
    without mask or modifier takes no such per-score test, for speed: on bf16 and fp32 inputs it
    takes each row's least score beside its max instead, and a -inf there (or a +inf max) flags
    the row (fp16's dots cannot pass float32's range)."""
    return tl.where(tl.abs(s) == float("inf"), float("nan"), s)


@triton.jit
def scores_overflowed(m_i, l_i, row_ok):
    """The rows (of those row_ok) whose scores passed float32's range, from the online softmax's
    row max m_i and sum l_i: l NaN (an inf score against the max, inf - inf in a dot, an
    admitted -inf) or max +inf."""
    return ((l_i != l_i) | (m_i == float("inf"))) & row_ok


@triton.jit
def overflowed(acc, row_ok):
    """The rows (of those row_ok) whose accumulator holds inf or NaN."""
    return (tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), 1) > 0) & row_ok


@triton.jit
def flag_nonfinite(flag, acc):
    """Sets *flag (int32) to 1 where the tile acc holds inf or NaN: a plain store, as every
    program that writes it writes 1 (the SDPA backward's check, sdpa_bwd_rerun)."""
    if tl.max(tl.max(tl.where(tl.abs(acc) < float("inf"), 0, 1), 1), 0) > 0:
        tl.store(flag, 1)


@triton.jit
def shift_exponent(x, p_shift):
    """exp's argument x (rows of a tile) less its row's shift, x itself without one (None: the
    first pass)."""
    if p_shift is not None:
        x = x - p_shift[:, None]
    return x


@triton.jit
def softmax_start(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The online softmax's running row max, row sum and output before any key tile."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, BLOCK_DV], tl.float32))


@triton.jit
def softmax_step(s, v, m_i, l_i, acc, key_row, threshold, offs_n, DROPOUT: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """One key tile of the online softmax: its scores s and values v folded into the running
    row max m_i, row sum l_i (taken before dropout) and output acc, kept normalised (acc = sum_j
    P_j [j kept] v_j / l: a convex combination of values, finite where the unnormalised sum
    overflowed); returns the new three. Dropout's 1 / (1 - p) is the caller's, once at the end:
    within the sums, the first tiles' kept keys would take acc up to max|v| / (1 - p) before the
    later keys' share brought it down (inf where the result is finite). key_row and threshold
    are `row_keys` of the rows (None without DROPOUT)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing admissible so far keeps max -inf; subtracting 0 instead keeps
    # exp(-inf - -inf) = NaN out.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    inv = tl.where(l_new > 0.0, 1.0 / l_new, 0.0)  # (0 until the row admits a key)
    if DROPOUT:
        p = tl.where(keep(key_row, offs_n, threshold), p, 0.0)
    acc = acc * (alpha * l_i * inv)[:, None] + dot((p * inv[:, None]).to(v.dtype), v, DOT_PREC)
    return m_new, l_new, acc


@triton.jit
def second_chunk(BLOCK: tl.constexpr, BLOCK2: tl.constexpr):
    """Column offsets of a head dim's second chunk (common.head_blocks), after the first BLOCK;
    without one (BLOCK2 = 0) a 1-wide placeholder that only constexpr-guarded code reads."""
    if BLOCK2 > 0:
        offs = BLOCK + tl.arange(0, BLOCK2)
    else:
        offs = tl.full([1], BLOCK, tl.int32)
    return offs


@triton.jit
def store_out(o_base, l_i, acc, offs_m, offs_dv, Lq, Ev, som, sod):
    """Normalises and stores output columns offs_dv of the rows: 0 on rows that admitted no
    key."""
    has = l_i > 0.0
    out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    tl.store(o_base + offsets(offs_m, offs_dv, som, sod), out.to(o_base.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Ev))


@triton.jit
def store_lse(lse_base, m_i, l_i, offs_m, Lq):
    """Stores the rows' lse: -inf on rows that admitted no key."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    tl.store(lse_base + offs_m, tl.where(has, m_i + tl.log(l_safe), float("-inf")),
             mask=offs_m < Lq)


@triton.jit
def store_rows(o_base, lse_base, m_i, l_i, acc, offs_m, offs_dv, Lq, Ev, som, sod):
    """Normalises and stores the output rows and their lse: 0 and -inf on rows that admitted
    no key."""
    store_out(o_base, l_i, acc, offs_m, offs_dv, Lq, Ev, som, sod)
    store_lse(lse_base, m_i, l_i, offs_m, Lq)


@triton.jit
def store_normalised_rows(o_base, lse_base, m_i, l_i, acc, offs_m, offs_dv, Lq, Ev, som, sod):
    """store_rows of rows that softmax_step kept normalised (0 on rows that admitted no key)."""
    tl.store(o_base + offsets(offs_m, offs_dv, som, sod), acc.to(o_base.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_dv[None, :] < Ev))
    store_lse(lse_base, m_i, l_i, offs_m, Lq)


@triton.jit
def score_grad(p, do, val_t, dw, delta, RNG, bh, offs_m, offs_n, inv_keep,
               DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr):
    """(dscore, probabilities after dropout) of a tile, from its probabilities p, the output
    gradient rows do, the values transposed, the gradient dw of the weights (after dropout;
    0.0 for none) and delta = rowsum(dO * O) (less grad_lse)."""
    dp = dot(do, val_t, DOT_PREC) + dw
    if DROPOUT:
        key_row, threshold = row_keys(RNG, bh, offs_m)
        kept = keep(key_row, offs_n, threshold)
        p_used = tl.where(kept, p * inv_keep, 0.0)
        dp = tl.where(kept, dp * inv_keep, 0.0)
    else:
        p_used = p
    return p * (dp - delta[:, None]), p_used

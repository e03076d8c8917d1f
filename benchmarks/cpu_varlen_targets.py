"""attnx.varlen_attention on a packed batch against torch's SDPA on the same batch padded to
its longest sequence, interleaved in one process (issue 23 item 3: a training step, forward and
backward, >= 1.3x).

One packed batch of 13 sequences of 64-2048 tokens, 8192 in all; fp32, H=8, D=64; causal (a
language model's step) and not. The peer pads to (13, H, 2048, D): causal needs no mask with
right padding (a real query never sees a padded key) so torch runs its fused causal kernel;
non-causal takes a key-padding bool mask. The loss covers real tokens only. Per repeat both are
timed in turn; medians with min/max. FLOPs as flash-attention counts them (forward
4*H*D*sum(Lq*Lk), halved for causal; backward 2.5x), over the real tokens only, for both.
Writes benchmarks/results/cpu-varlen-<date>.json (-2, -3, ... for a later run the same day).

    python benchmarks/cpu_varlen_targets.py [--repeats N] [--threads T]
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.nn.functional as F

import attnx
from attnx.cli import positive_int
from cpu_sdpa_targets import machine, summary, timed, unused_path, write_results

LENGTHS = [2048, 1536, 1024, 1024, 768, 512, 384, 256, 256, 128, 128, 64, 64]  # 8192 tokens
H, D = 8, 64
TARGET = 1.3
HERE = os.path.dirname(os.path.abspath(__file__))


def case(causal: bool, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    total, n, longest = sum(LENGTHS), len(LENGTHS), max(LENGTHS)
    q, k, v, dout = (torch.randn(total, H, D, generator=g) for _ in range(4))
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    # the same tokens padded: (N, H, longest, D), and where the real ones are
    real = torch.arange(longest).view(1, -1) < torch.tensor(LENGTHS).view(-1, 1)  # (N, longest)

    def padded(x):
        out = x.new_zeros(n, longest, H, D)
        out[real] = x
        return out.transpose(1, 2).contiguous()

    qp, kp, vp, dp = (padded(x) for x in (q, k, v, dout))
    dp = dp * real.view(n, 1, longest, 1)  # the loss covers real tokens only
    mask = None if causal else real.view(n, 1, 1, longest)

    def attnx_step():
        x, y, z = (t.detach().requires_grad_() for t in (q, k, v))
        out = attnx.varlen_attention(x, y, z, cu, cu, is_causal=causal, backend="cpu")
        out.backward(dout)
        return out

    def torch_step():
        x, y, z = (t.detach().requires_grad_() for t in (qp, kp, vp))
        out = F.scaled_dot_product_attention(x, y, z, attn_mask=mask, is_causal=causal)
        out.backward(dp)
        return out

    got = attnx_step()
    want = torch_step().transpose(1, 2)[real]  # a benchmark of wrong answers is worth nothing
    err = (got - want).abs().max().item()
    assert err < 1e-4, f"attnx varlen against torch padded: max error {err}"
    times = {"attnx": [], "torch": []}
    for _ in range(repeats):
        times["torch"].append(timed(torch_step))
        times["attnx"].append(timed(attnx_step))
    pairs = sum(L * L for L in LENGTHS) / (2 if causal else 1)
    flops = 4 * H * D * pairs * 3.5  # forward + backward (2.5x)
    row = {"causal": causal, "flops": flops}
    for name, ts in times.items():
        row[name] = summary(ts)
        row[name]["gflops"] = flops / row[name]["median_s"] / 1e9
    row["speedup"] = row["torch"]["median_s"] / row["attnx"]["median_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, lengths {LENGTHS}, H={H}, D={D}, fp32, "
          f"target >= {TARGET}x torch padded (forward + backward)")
    rows = []
    for causal in (True, False):
        r = case(causal, args.repeats)
        rows.append(r)
        print(f"causal={causal!s:5} | torch padded {r['torch']['median_s'] * 1e3:8.1f} ms "
              f"[{r['torch']['min_s'] * 1e3:.1f}-{r['torch']['max_s'] * 1e3:.1f}] | attnx varlen "
              f"{r['attnx']['median_s'] * 1e3:8.1f} ms [{r['attnx']['min_s'] * 1e3:.1f}-"
              f"{r['attnx']['max_s'] * 1e3:.1f}] | {r['speedup']:.2f}x"
              f"{'' if r['speedup'] >= TARGET else '  MISS'}", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "benchmark": "cpu_varlen_targets", "date": now.isoformat(),
        "machine": machine(),
        "torch": torch.__version__, "attnx": attnx.__version__, "repeats": args.repeats,
        "shape": {"lengths": LENGTHS, "H": H, "D": D, "dtype": "float32"},
        "target_speedup": TARGET, "cases": rows,
    }
    path = args.out or unused_path(os.path.join(HERE, "results", f"cpu-varlen-{now:%Y-%m-%d}.json"))
    write_results(path, result)


if __name__ == "__main__":
    main()

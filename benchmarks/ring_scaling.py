"""Strong scaling of attnx.distributed.ring_attention on CPU processes (gloo, 1 thread each):
the committed results file's run (the measurement itself: attnx/bench/ring_scaling.py, also
behind `attnx bench --world N`).

    python benchmarks/ring_scaling.py [--lengths 8192 16384 32768] [--worlds 1 2 4]

Writes benchmarks/results/ring-scaling-<date>.json and .png and prints a table;
`--plot-only FILE.json` redraws the figure of a results file.
"""

from __future__ import annotations

import argparse
import json
import os

from attnx.bench import report, ring_scaling


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--layouts", nargs="+", choices=ring_scaling.LAYOUTS,
                    default=list(ring_scaling.LAYOUTS))
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-only", metavar="JSON", default=None)
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            png = os.path.splitext(args.plot_only)[0] + ".png"
            ring_scaling.plot(json.load(f), png)
        print(f"wrote {png}")
        return
    try:
        result = ring_scaling.measure(args.lengths, args.worlds, args.layouts, args.heads,
                                      args.dim, args.repeats)
    except ValueError as exc:
        ap.error(str(exc))
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"ring-scaling-{result['date'][:10]}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    report.write_json(out, result)
    print(ring_scaling.table(result))
    png = os.path.splitext(out)[0] + ".png"
    ring_scaling.plot(result, png)
    print(f"wrote {out} and {png}")


if __name__ == "__main__":
    main()

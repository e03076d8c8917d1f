"""The benchmark suite behind `attnx bench`: providers, sweeps, timing, FLOPs, memory, reports."""


def main(argv=None) -> int:
    # Imported when called: the ranks that `attnx bench --world` spawns import
    # attnx.bench.ring_scaling, and need neither the sweep nor matplotlib.
    from .cli import main as run
    return run(argv)


__all__ = ["main"]

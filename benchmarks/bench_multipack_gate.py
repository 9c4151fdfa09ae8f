"""Multipack's repair gate: packing efficiency and packing time on 100k synthetic example lengths, with
the repair pass (finetune.data.batching.packing._fill_gaps) gated at several distances from the lower bound.

The repair is tried only when best-fit decreasing leaves at most 1/gate more rows than the lower bound
ceil(tokens / capacity) (gate 50: 2%, 10: 10%, 1: always). Each length distribution is a seeded normal
or log-normal, rounded and clipped to [8, capacity]. Time: the median of `--repeats` calls of
`pack_multipack` (one group of 100k), one process.

Usage: python benchmarks/bench_multipack_gate.py [--gates 50,20,10,5,1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from _common import machine

import finetune.data.batching.packing as packing

ROWS = 100_000
# (name, sampler(rng) -> raw lengths, capacity)
DISTRIBUTIONS = [
    ("N(60,10)", lambda g: g.normal(60, 10, ROWS), 512),
    ("N(100,15)", lambda g: g.normal(100, 15, ROWS), 512),
    ("N(120,15)", lambda g: g.normal(120, 15, ROWS), 512),
    ("N(120,25)", lambda g: g.normal(120, 25, ROWS), 512),
    ("N(130,10)", lambda g: g.normal(130, 10, ROWS), 512),
    ("N(200,10)", lambda g: g.normal(200, 10, ROWS), 512),
    ("uniform(16,512)", lambda g: g.uniform(16, 512, ROWS), 512),
    ("N(400,60)", lambda g: g.normal(400, 60, ROWS), 2048),
    ("N(450,40)", lambda g: g.normal(450, 40, ROWS), 2048),
    ("lognormal(ln 300, 0.8)", lambda g: g.lognormal(np.log(300), 0.8, ROWS), 2048),
    ("N(900,300)", lambda g: g.normal(900, 300, ROWS), 4096),
]


def measure(lengths: np.ndarray, capacity: int, gate: int, repeats: int) -> tuple[int, float]:
    """(rows, median seconds) of pack_multipack with the repair gated at 1/gate of the bound."""
    saved = packing._REPAIR_GATE
    packing._REPAIR_GATE = gate
    try:
        times, rows = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            rows = len(packing.pack_multipack(lengths, capacity))
            times.append(time.perf_counter() - start)
    finally:
        packing._REPAIR_GATE = saved
    return rows, statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gates", default="50,20,10,5,1", help="comma-separated gate divisors")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gates = [int(g) for g in args.gates.split(",")]
    header = " | ".join(f"gate {g} ({100 / g:.0f}%): eff, s" for g in gates)
    print(f"| lengths | row tokens | greedy rows above bound | {header} |")
    print("|---|---|---|" + "---|" * len(gates))
    for name, sample, capacity in DISTRIBUTIONS:
        lengths = np.clip(np.rint(sample(np.random.default_rng(0))), 8, capacity).astype(np.int64)
        bound = packing.lower_bound_bins(lengths, capacity)
        greedy = len(packing._best_fit_decreasing(lengths, capacity))
        cells = []
        for gate in gates:
            rows, seconds = measure(lengths, capacity, gate, args.repeats)
            cells.append(f"{packing.packing_efficiency(lengths, rows, capacity):.4f}, {seconds:.2f}")
        print(f"| {name} | {capacity} | {100 * (greedy - bound) / bound:.1f}% | " + " | ".join(cells) + " |")
        sys.stdout.flush()
    print(f"\nMachine: {machine(cpu=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

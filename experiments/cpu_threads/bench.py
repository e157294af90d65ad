"""Torch threads on a CPU that other work also uses: a small GEMM's time with 1 and with all cores' threads, on an
idle machine and with one busy process per core started beside it (the load a second run or a test suite makes).

    python experiments/cpu_threads/bench.py [--seconds 3]

Prints each case's microseconds per GEMM and the ratio to 1 thread in the same condition. OpenMP's threads spin
while they wait for each other, so on busy cores a thread that is descheduled holds up the others; what
`mlplat.lightning.strategy.cpu_threads` reads the load average for.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time

CASE = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(64, 512), torch.randn(512, 512)
for _ in range(20): a @ b
start, n = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[2]):
    for _ in range(20): a @ b
    n += 20
print((time.perf_counter() - start) / n * 1e6)
"""


def _burn(stop) -> None:
    while not stop.is_set():
        pass


def _time(threads: int, seconds: float) -> float:
    out = subprocess.run([sys.executable, "-c", CASE, str(threads), str(seconds)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"{cores} cores; a [64, 512] x [512, 512] GEMM, microseconds each")
    print(f"{'machine':<22} {'1 thread':>10} {f'{cores} threads':>11} {'ratio':>7}")
    for loaded in (False, True):
        stop = mp.Event()
        burners = [mp.Process(target=_burn, args=(stop,)) for _ in range(cores if loaded else 0)]
        for p in burners:
            p.start()
        time.sleep(0.5 if loaded else 0)
        one, many = _time(1, args.seconds), _time(cores, args.seconds)
        stop.set()
        for p in burners:
            p.join()
        label = f"{cores} busy processes" if loaded else "idle"
        print(f"{label:<22} {one:>10.0f} {many:>11.0f} {many / one:>6.2f}x")


if __name__ == "__main__":
    main()

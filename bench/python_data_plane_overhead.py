#!/usr/bin/env python3
"""The Python client's own time per data-plane call (issue 7): small score requests (128 x 4096 fp32,
three growing chunks of 256 KiB..1 MiB over 4 sockets) against a server whose engine takes almost
nothing, so that what is measured is the client's and the request path's work, not compute.

  lce_server --backend=cpu --seed-head=64x4096 --head-dtype=fp32 --data-port=0 --port-file=F &
  python3 bench/python_data_plane_overhead.py 127.0.0.1:$(cat F) [ROWS] [CALLS]
"""
import sys
import time

import numpy as np

import lce_client


def main():
    target = sys.argv[1]
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    calls = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    hidden_size = 4096
    client = lce_client.Client(target, data_plane=True, data_plane_sockets=4, chunk_bytes=1 << 20,
                               first_chunk_bytes=256 << 10, grow_chunks=True)
    rng = np.random.default_rng(0)
    h = (rng.standard_normal((rows, hidden_size)) * 0.5).astype(np.float32)
    y = rng.integers(0, 64, rows).astype(np.int32)
    with client:
        for _ in range(5):
            client.score(h, y)
        ms = []
        for _ in range(calls):
            t0 = time.perf_counter()
            client.score(h, y)
            ms.append((time.perf_counter() - t0) * 1e3)
    ms.sort()
    print(f"score {rows}x{hidden_size} fp32 over the data plane: median {ms[len(ms) // 2]:.2f} ms, "
          f"p10 {ms[len(ms) // 10]:.2f}, best {ms[0]:.2f} ({calls} calls)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""This machine's limits for decoding (docs/scaling.md, "Decoding against the machine's limits").

Reads a 1 GiB f32 tensor (torch's multi-threaded sum: the memory read bandwidth a decode step's
weight stream can reach) and multiplies 2,048 x 2,048 f32 matrices (sgemm, torch's MKL/oneDNN),
on as many threads as turnwise uses (RAYON_NUM_THREADS, else the core count). Prints one JSON
line: read GB/s and sgemm GFLOP/s, best of 5 each.
"""
import json
import os
import time

import torch

threads = int(os.environ.get("RAYON_NUM_THREADS", os.cpu_count() or 1))
torch.set_num_threads(threads)
x = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
x.sum()
best = float("inf")
for _ in range(5):
    t = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - t)
read_gbs = x.numel() * 4 / best / 1e9
a = torch.randn(2048, 2048)
b = torch.randn(2048, 2048)
a @ b
best = float("inf")
for _ in range(5):
    t = time.perf_counter()
    a @ b
    best = min(best, time.perf_counter() - t)
gflops = 2 * 2048**3 / best / 1e9
print(json.dumps({"threads": threads, "read_gb_s": round(read_gbs, 2), "sgemm_gflop_s": round(gflops, 1)}))

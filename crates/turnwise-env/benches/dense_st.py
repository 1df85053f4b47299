#!/usr/bin/env python3
"""sentence-transformers side of `cargo bench -p turnwise-env --bench dense`.

Usage: PY crates/turnwise-env/benches/dense_st.py DIR

The Rust bench writes into DIR the passages and queries (JSON lines of strings), the model
folder it uses, the search matrix (`matrix.f32`, rows × dim little-endian f32) and the query
embeddings (`queries.f32`), then runs this script with the same model, texts and vectors on
`torch.set_num_threads(THREADS)` (2 by default). It writes DIR/st.json (timings) and
DIR/st_passages.f32 (its passage embeddings, for the parity check) and the Rust bench prints
both sides with the ratios.

Requires: pip install sentence-transformers (brings torch and numpy).
"""

import json
import os
import sys
import time

import numpy as np
import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    directory = sys.argv[1]
    with open(os.path.join(directory, "meta.json")) as f:
        meta = json.load(f)
    torch.set_num_threads(meta["threads"])
    passages = read_lines(os.path.join(directory, "passages.jsonl"))
    queries = read_lines(os.path.join(directory, "queries.jsonl"))
    dim, rows, k, batch = meta["dim"], meta["rows"], meta["k"], meta["batch_size"]
    matrix = torch.from_numpy(
        np.fromfile(os.path.join(directory, "matrix.f32"), dtype="<f4").reshape(rows, dim)
    )
    qemb = torch.from_numpy(
        np.fromfile(os.path.join(directory, "queries.f32"), dtype="<f4").reshape(-1, dim)
    )

    model = SentenceTransformer(meta["model_dir"], device="cpu")
    model.eval()
    out = {
        "versions": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
        "threads": torch.get_num_threads(),
    }
    with torch.inference_mode():
        model.encode(passages[: 2 * batch], batch_size=batch)  # warm-up
        t = time.perf_counter()
        emb = model.encode(passages, batch_size=batch, convert_to_numpy=True)
        out["encode_passages_per_s"] = len(passages) / (time.perf_counter() - t)
        emb.astype("<f4").tofile(os.path.join(directory, "st_passages.f32"))

        t = time.perf_counter()
        model.encode(queries, batch_size=batch, convert_to_numpy=True)
        out["encode_queries_per_s"] = len(queries) / (time.perf_counter() - t)

        n_single = min(meta["single_queries"], len(qemb))
        torch.topk(matrix @ qemb[0], k)  # warm-up
        t = time.perf_counter()
        for i in range(n_single):
            torch.topk(matrix @ qemb[i], k)
        out["search_single_qps"] = n_single / (time.perf_counter() - t)

        chunk = meta["search_batch"]
        t = time.perf_counter()
        top = []
        for s in range(0, len(qemb), chunk):
            scores = qemb[s : s + chunk] @ matrix.T
            top.append(torch.topk(scores, k, dim=1).indices)
        out["search_batch_qps"] = len(qemb) / (time.perf_counter() - t)
        top = torch.cat(top)
        out["top1"] = top[:, 0].tolist()

    with open(os.path.join(directory, "st.json"), "w") as f:
        json.dump(out, f)
    print(
        f"sentence-transformers: encode {out['encode_passages_per_s']:.1f} passages/s, "
        f"{out['encode_queries_per_s']:.1f} queries/s; search {out['search_single_qps']:.0f} q/s "
        f"(one at a time), {out['search_batch_qps']:.0f} q/s (batches of {chunk})"
    )


if __name__ == "__main__":
    main()

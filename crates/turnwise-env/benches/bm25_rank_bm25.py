#!/usr/bin/env python3
"""rank_bm25 on the data written by `cargo bench -p turnwise-env --bench bm25`.

Usage: python3 crates/turnwise-env/benches/bm25_rank_bm25.py [DIR] [--limit N]

For each corpus NAME in DIR (wiki, world) it reads NAME_corpus.jsonl and NAME_queries.txt,
indexes `title + " " + text` with the same tokenisation as the Rust side (tantivy's default:
split on non-alphanumeric characters, lowercase, drop tokens of 40 bytes or more), scores the
first N queries with rank_bm25's BM25Okapi (k1 = 1.2, b = 0.75), takes the top k (k from
NAME_rust.json) with positive scores, and prints queries/s, the ratio to the Rust figures and
the top-1 agreement with the Rust results. rank_bm25's IDF is ln((N - n + 0.5) / (n + 0.5)) with
an epsilon floor, tantivy's is ln(1 + (N - n + 0.5) / (n + 0.5)), so rankings differ slightly.

Requires: pip install rank_bm25 (brings numpy).
"""

import json
import os
import re
import sys
import tempfile
import time

import numpy as np
from rank_bm25 import BM25Okapi

TOKEN = re.compile(r"[^\W_]+")


def tokenize(text):
    return [t for t in TOKEN.findall(text.lower()) if len(t.encode("utf-8")) < 40]


def indexed_text(contents):
    first, _, rest = contents.partition("\n")
    title = first.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return f"{title} {rest}"


def run(directory, name, limit):
    corpus_path = os.path.join(directory, f"{name}_corpus.jsonl")
    if not os.path.exists(corpus_path):
        print(f"{name}: no {corpus_path}, skipped")
        return
    with open(os.path.join(directory, f"{name}_rust.json")) as f:
        rust = json.load(f)
    k = rust["k"]
    ids, tokenized = [], []
    with open(corpus_path) as f:
        for line in f:
            doc = json.loads(line)
            ids.append(doc["id"])
            tokenized.append(tokenize(indexed_text(doc["contents"])))
    with open(os.path.join(directory, f"{name}_queries.txt")) as f:
        queries = [line.rstrip("\n") for line in f][:limit]
    with open(os.path.join(directory, f"{name}_rust_topk.jsonl")) as f:
        rust_top = [json.loads(line) for line in f][: len(queries)]

    t0 = time.perf_counter()
    bm25 = BM25Okapi(tokenized, k1=1.2, b=0.75)
    build_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    results = []
    for q in queries:
        scores = bm25.get_scores(tokenize(q))
        top = np.argsort(-scores)[:k]
        results.append([ids[i] for i in top if scores[i] > 0])
    elapsed = time.perf_counter() - t0
    qps = len(queries) / elapsed

    agree = sum(
        1 for a, b in zip(results, rust_top) if (a[:1] == b[:1])
    ) / max(1, len(queries))
    ratio = rust["tantivy_qps_1thread"] / qps
    print(
        f"{name}: {len(ids)} docs, {len(queries)} queries, top-{k}: rank_bm25 build {build_s:.2f} s, "
        f"{qps:.1f} q/s; tantivy {rust['tantivy_qps_1thread']:.0f} q/s (1 thread) = {ratio:.0f}x; "
        f"batch {rust['tantivy_qps_batch_all_threads'] / qps:.0f}x; in-memory Rust "
        f"{rust['in_memory_qps_1thread'] / qps:.0f}x; top-1 agreement {agree:.1%}"
    )


def main():
    args = sys.argv[1:]
    limit = 1000
    if "--limit" in args:
        i = args.index("--limit")
        limit = int(args[i + 1])
        del args[i : i + 2]
    directory = args[0] if args else os.path.join(tempfile.gettempdir(), "turnwise-bm25-bench")
    for name in ("wiki", "world"):
        run(directory, name, limit)


if __name__ == "__main__":
    main()

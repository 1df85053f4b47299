#!/usr/bin/env python3
"""PyTorch + transformers reference for benches/rollout.rs: a multi-turn rollout that re-reads
each turn's whole context, as Search-R1's loop does (`generate` on the left-padded contexts).

E = G x R episodes of T turns: each starts from its group's P-token prompt (the Rust bench's
ids); each turn samples exactly N tokens per episode (temperature 1, no top-k or top-p,
`min_new_tokens=N` so that no row stops early), then the context grows by the turn's tokens and
an O-token observation. Each turn calls `model.generate` on the whole contexts, left-padded, with
transformers' KV cache inside the turn. Prints one JSON line {"seconds": median, "info": "..."}
or {"error": "..."}.

Usage: python3 rollout_torch.py --shape G,R,P,T,N,O [--reps K] [--smollm2 FILE]
Without --smollm2: size C of model_torch.py (SmolLM2's shape) with random weights.
Threads: $RAYON_NUM_THREADS if set, else 2.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import transformers
from transformers import Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_torch import SIZES, config  # noqa: E402


def prompt_ids(g, p, vocab):
    return [(g * 7919 + i * 131 + 13) % vocab for i in range(p)]


def observation_ids(e, t, o, vocab):
    return [(((e * 100 + t) * 1000 + k) * 104729 + 7) % vocab for k in range(o)]


@torch.inference_mode()
def rollout_seconds(model, shape, rep):
    g, r, p, turns, new, obs = shape
    vocab = model.config.vocab_size
    pad = 0
    t0 = time.perf_counter()
    contexts = [prompt_ids(e // r, p, vocab) for e in range(g * r)]
    for t in range(turns):
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
        torch.manual_seed(rep * 1000 + t)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad,
            use_cache=True,
        )
        gen = out[:, width:].tolist()
        for e, (c, toks) in enumerate(zip(contexts, gen)):
            assert len(toks) == new, f"episode {e} turn {t}: {len(toks)} tokens"
            c.extend(toks)
            if t + 1 < turns:
                c.extend(observation_ids(e, t, obs, vocab))
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, help="G,R,P,T,N,O")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smollm2", metavar="FILE")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    try:
        if a.smollm2:
            from transformers import AutoModelForCausalLM

            d, f = os.path.split(os.path.abspath(a.smollm2))
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        else:
            torch.manual_seed(0)
            cfg = config(SIZES["C"])
            cfg.max_position_embeddings = max(cfg.max_position_embeddings, 2048)
            model = Qwen2ForCausalLM(cfg).float()
        model.eval()
        # Warm-up: one turn of a smaller rollout, as the Rust side does.
        g, r, p, _, _, obs = shape
        rollout_seconds(model, (g, r, p, 1, 4, obs), 99)
        times = [rollout_seconds(model, shape, rep) for rep in range(a.reps)]
    except Exception as e:  # the PyTorch cells stay empty, with the reason
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return
    info = (
        f"PyTorch: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{threads} threads, rollouts {', '.join(f'{x:.2f}' for x in times)} s"
    )
    print(json.dumps({"seconds": statistics.median(times), "info": info}))


if __name__ == "__main__":
    main()

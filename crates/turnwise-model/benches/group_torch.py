#!/usr/bin/env python3
"""PyTorch + transformers reference for benches/group.rs: one GRPO group's training step.

G rows share a P-token prompt, each with its own R-token response (the token ids of the Rust
bench). One step: the padded forward over the G x (P + R) tokens, the output head on the
response positions only (as the Rust side does), loss = -mean log-prob - 0.001 mean entropy of
the response tokens, backward, global-norm clipping at 1, one torch AdamW step. PyTorch has no
shared-prefix training: this is the padded pass every PyTorch trainer runs. Prints one JSON line
{"A": seconds, "B": seconds, "SmolLM2": seconds or {"error": ...}, "info": "..."}.

Usage: python3 group_torch.py --shape G,P,R [--steps N] [--sizes A,B] [--smollm2 FILE]
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

# The synthetic sizes and their transformers config: model_torch.py's, beside this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_torch import SIZES, config  # noqa: E402


def group_ids(g, p, r, vocab):
    """The Rust bench's tokens: a shared prompt, then each row's own response."""
    prompt = [(i * 7919 + 13) % vocab for i in range(p)]
    rows = []
    for b in range(g):
        resp = [((b * 1000 + k) * 104729 + 7) % vocab for k in range(r)]
        rows.append(prompt + resp)
    return torch.tensor(rows, dtype=torch.long)


def step_seconds(model, shape, steps):
    g, p, r = shape
    ids = group_ids(g, p, r, model.config.vocab_size)
    inputs, targets = ids[:, :-1], ids[:, p:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        hidden = model.model(input_ids=inputs).last_hidden_state[:, p - 1 :]
        logits = model.lm_head(hidden)
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
        loss = -logp.mean() - 1e-3 * ent.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step > 0:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True, help="G,P,R")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sizes", default="A,B")
    ap.add_argument("--smollm2", metavar="FILE")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    out = {}
    for name in [s for s in a.sizes.split(",") if s]:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config(SIZES[name])).float()
        out[name] = step_seconds(model, shape, a.steps)
    if a.smollm2:
        try:
            from transformers import AutoModelForCausalLM

            d, f = os.path.split(os.path.abspath(a.smollm2))
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
            out["SmolLM2"] = step_seconds(model, shape, a.steps)
        except Exception as e:  # the row's cells stay empty, with the reason
            out["SmolLM2"] = {"error": f"{type(e).__name__}: {e}"}
    out["info"] = f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads"
    print(json.dumps(out))


if __name__ == "__main__":
    main()

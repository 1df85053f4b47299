#!/usr/bin/env python3
"""PyTorch + transformers reference figures for benches/model.rs (same models, same work).

Builds the two Qwen2-style sizes of the Rust benchmark with `transformers` (fp32, CPU) and
measures training tokens/s (forward, backward of -mean log-prob - 0.001 mean entropy, global-norm
clipping, one torch AdamW step; batch 8 x 256) and sampling tokens/s (16-token prompts, 64 new
tokens, temperature 1, hand-written KV-cache loop, batch 1 / 8 / 64). With `--smollm2 FILE`, also
SmolLM2-135M-Instruct loaded from that GGUF file (`from_pretrained(dir, gguf_file=...)`, which
dequantizes with the `gguf` package, in fp32): the same work, training on a batch of 4 x 128.
Prints one JSON line:

    {"A": {"train": tok_s, "sample_1": tok_s, ...}, "B": {...}, "SmolLM2": {...}, "info": "..."}

where "SmolLM2" is {"error": "..."} when the model could not be loaded or run.

Usage: python3 model_torch.py [--quick] [--smollm2 FILE [--train-only]] [--device cuda] [--sizes A,B,C].

`--prefill N [--reps R] [--smollm2 FILE]` instead prefills one sequence of N tokens (SmolLM2 from
FILE, else size C with random weights; a DynamicCache, `logits_to_keep=1`, transformers' default
SDPA attention) and prints {"prefill": {"ms", "first_ms", "rss_mib"}}: the median of R warm runs
and the peak RSS growth over the first run (VmHWM reset through /proc/self/clear_refs, minus
VmRSS before it). `--attention 512,1024 [--reps R]` times
`scaled_dot_product_attention(is_causal=True, enable_gqa=True)` alone at SmolLM2's shapes (1 x
9/3 heads x 64), forward (no grad) and forward + backward: {"attention": {"512": {"fwd": ms,
"fwd_bwd": ms}, ...}}.
Threads: $RAYON_NUM_THREADS if set, else 2. On `--device cuda`: sampling with bf16 weights, and
training in PyTorch's usual mixed precision (f32 weights and AdamW, `torch.autocast` to bf16);
size C is SmolLM2-135M's shape with random weights.
"""

import argparse
import copy
import json
import os
import statistics
import time

import torch
import transformers
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

TRAIN_BATCH, TRAIN_LEN = 8, 256
SMOL_TRAIN_BATCH, SMOL_TRAIN_LEN = 4, 128
PROMPT_LEN, NEW_TOKENS = 16, 64
SAMPLE_BATCHES = (1, 8, 64)
SIZES = {
    "A": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, vocab=4096),
    "B": dict(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, vocab=8192),
    "C": dict(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152),
}
DEVICE = torch.device("cpu")


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def config(s):
    return Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_cache=True,
        torch_dtype="float32",
    )


def logp_and_entropy(logits, targets):
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def fresh_model(cfg, dtype=torch.float32):
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device=DEVICE, dtype=dtype)


def train_tok_s(model, steps, batch=TRAIN_BATCH, length=TRAIN_LEN):
    vocab = model.config.vocab_size
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    n = batch * (length + 1)
    toks = torch.tensor([(i * 7919 + 13) % vocab for i in range(n)]).view(batch, length + 1)
    toks = toks.to(DEVICE)
    ids, targets = toks[:, :-1].contiguous(), toks[:, 1:].contiguous()
    times = []
    for step in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=DEVICE.type == "cuda"):
            logits = model(input_ids=ids).logits
        logp, ent = logp_and_entropy(logits.float(), targets)
        loss = -logp.mean() - 1e-3 * ent.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        if step > 0:
            times.append(time.perf_counter() - t0)
    return batch * length / statistics.median(times)


@torch.inference_mode()
def sample_tok_s(model, batch, reps):
    vocab = model.config.vocab_size
    model.eval()
    prompts = torch.tensor(
        [[(b * 131 + i * 17 + 1) % vocab for i in range(PROMPT_LEN)] for b in range(batch)]
    ).to(DEVICE)
    times = []
    for rep in range(reps + 1):
        gen = torch.Generator(device=DEVICE).manual_seed(rep)
        sync()
        t0 = time.perf_counter()
        cache = DynamicCache()
        out = model(input_ids=prompts, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        tokens, logps, ents = [], [], []
        for step in range(NEW_TOKENS):
            # temperature 1: sample from softmax(logits); report log-prob and entropy like turnwise
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            tok = torch.multinomial(logp_all.exp(), 1, generator=gen)
            tokens.append(tok)
            logps.append(logp_all.gather(-1, tok))
            ents.append(-(logp_all.exp() * logp_all).sum(-1))
            if step + 1 == NEW_TOKENS:
                break
            out = model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)
            logits = out.logits[:, -1, :]
        torch.cat(tokens, 1).tolist()
        dt = time.perf_counter() - t0
        if rep > 0:
            times.append(dt)
    return batch * NEW_TOKENS / statistics.median(times)


def proc_status_kb(field):
    """A /proc/self/status field in kB, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def rss_mark():
    """Resets VmHWM to the current RSS and returns the RSS in kB (None where impossible)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_status_kb("VmRSS")


@torch.inference_mode()
def prefill(model, length, reps):
    vocab = model.config.vocab_size
    model.eval()
    ids = torch.tensor([[(i * 7919 + 13) % vocab for i in range(length)]]).to(DEVICE)

    def run():
        out = model(
            input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1
        )
        assert out.logits.shape == (1, 1, vocab)

    base = rss_mark()
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    hwm = proc_status_kb("VmHWM")
    rss = None if base is None or hwm is None else max(hwm - base, 0.0) / 1024
    times = []
    for _ in range(max(reps, 1)):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "first_ms": first * 1e3, "rss_mib": rss}


def attention(lengths, reps):
    import torch.nn.functional as F

    result = {}
    for t in lengths:
        torch.manual_seed(0)
        q = (torch.randn(1, 9, t, 64) / 8).requires_grad_()
        k = torch.randn(1, 3, t, 64).requires_grad_()
        v = torch.randn(1, 3, t, 64).requires_grad_()

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def fwd_bwd():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            y.sum().backward()

        r = {}
        for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            f()
            times = []
            for _ in range(max(reps, 1)):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            r[name] = statistics.median(times) * 1e3
        result[str(t)] = r
    return result


def smollm2(path, train_steps, reps):
    """The SmolLM2 figures: sampling on the loaded model, training on a copy of it."""
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(os.path.abspath(path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    r = {}
    for b in SAMPLE_BATCHES:
        r[f"sample_{b}"] = sample_tok_s(model, b, reps)
    r["train"] = train_tok_s(copy.deepcopy(model), train_steps, SMOL_TRAIN_BATCH, SMOL_TRAIN_LEN)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smollm2", metavar="FILE", help="SmolLM2-135M-Instruct GGUF file")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--sizes", default="A,B", help="comma-separated sizes of SIZES")
    ap.add_argument("--prefill", type=int, metavar="N", help="prefill N tokens, nothing else")
    ap.add_argument("--attention", metavar="T,..", help="time SDPA alone, nothing else")
    ap.add_argument("--reps", type=int, default=2, help="timed runs of --prefill/--attention")
    ap.add_argument(
        "--train-only", action="store_true", help="with --smollm2: its training figure alone"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    sample_dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    threads = int(os.environ.get("RAYON_NUM_THREADS") or 2)
    torch.set_num_threads(threads)
    train_steps, reps = (2, 1) if args.quick else (5, 3)
    info = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads, "
        f"CPU kernels {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.attention:
        lengths = [int(t) for t in args.attention.split(",")]
        print(json.dumps({"attention": attention(lengths, args.reps), "info": info}))
        return
    if args.train_only:
        from transformers import AutoModelForCausalLM

        d, name = os.path.split(os.path.abspath(args.smollm2))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        tr = train_tok_s(model, train_steps, SMOL_TRAIN_BATCH, SMOL_TRAIN_LEN)
        print(json.dumps({"SmolLM2": {"train": tr}, "info": info}))
        return
    if args.prefill:
        if args.smollm2:
            from transformers import AutoModelForCausalLM

            d, name = os.path.split(os.path.abspath(args.smollm2))
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        else:
            model = fresh_model(config(SIZES["C"]))
        r = prefill(model, args.prefill, args.reps)
        attn = model.config._attn_implementation
        print(json.dumps({"prefill": r, "info": f"{info}, attention {attn}"}))
        return
    result = {}
    for name in args.sizes.split(","):
        cfg = config(SIZES[name])
        r = {"train": train_tok_s(fresh_model(cfg), train_steps)}
        for b in SAMPLE_BATCHES:
            r[f"sample_{b}"] = sample_tok_s(fresh_model(cfg, sample_dtype), b, reps)
        result[name] = r
    if args.smollm2:
        try:
            result["SmolLM2"] = smollm2(args.smollm2, train_steps, reps)
        except Exception as e:  # noqa: BLE001 - reported in the table instead of failing the run
            result["SmolLM2"] = {"error": f"{type(e).__name__}: {e}"}
    result["info"] = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{threads} threads, {DEVICE}, "
        + ("bf16 autocast training, bf16 sampling" if DEVICE.type == "cuda" else "fp32")
        + f", attention {cfg._attn_implementation}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Prefill time and peak RSS of `turnwise serve` on SmolLM2 (one request, max_tokens 1) with
chunked and whole-prompt prefill, and transformers on the same GGUF (one forward, no_grad).

    python3 scripts/serve-prefill-bench.py target/release/turnwise 1000,2000,4000 turnwise
    python3 scripts/serve-prefill-bench.py - 1000,2000,4000 torch ~/.cache/turnwise/SmolLM2-135M-Instruct.Q4_1.gguf

The torch mode needs torch, transformers, gguf and accelerate. One JSON line per measurement.
"""
import json, os, subprocess, sys, time, threading, urllib.request

BIN = sys.argv[1]
SIZES = [int(x) for x in sys.argv[2].split(",")]
MODE = sys.argv[3]  # "turnwise" or "torch"

def rss_peak(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024

def serve(flags):
    p = subprocess.Popen([BIN, "serve", "--model", "smollm2-135m-instruct", "--addr", "127.0.0.1:0", *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if "listening on" in line:
            url = line.split("listening on ")[1].strip()
            break
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    return p, url

def post(url, body, timeout=3600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)

if MODE == "turnwise":
    for chunk in ["512", "0"]:
        for n in SIZES:
            p, url = serve(["--prefill-chunk-tokens", chunk])
            base = rss_peak(p.pid)
            t = time.time()
            out = post(f"{url}/v1/completions", {"prompt": "hello " * (n - 1), "max_tokens": 1, "temperature": 0})
            dt = time.time() - t
            print(json.dumps({"engine": "turnwise", "chunk": int(chunk), "prompt_tokens": out["usage"]["prompt_tokens"],
                              "seconds": round(dt, 2), "peak_rss_mib": rss_peak(p.pid), "rss_before_mib": base}), flush=True)
            p.kill(); p.wait()
else:
    import torch, resource
    from transformers import AutoModelForCausalLM
    gguf = sys.argv[4]
    torch.set_num_threads(2)
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), torch_dtype=torch.float32)
    m.eval()
    for n in SIZES:
        ids = torch.full((1, n), 28120)
        t = time.time()
        with torch.no_grad():
            m(ids)
        print(json.dumps({"engine": "torch", "prompt_tokens": n, "seconds": round(time.time() - t, 2),
                          "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}), flush=True)

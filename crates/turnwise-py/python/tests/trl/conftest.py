"""Fixtures of the TRL integration tests: a Search-R1 retrieval server over a tiny corpus, and
a tiny Llama policy with a word-level tokenizer, both built here (no hub downloads).

The retrieval server is turnwise's own (`turnwise index` + `turnwise serve-retriever`) when the
binary is found: $TURNWISE_BIN, else target/debug/turnwise or target/release/turnwise of this
checkout (`cargo test`/`cargo build` build it). Without it, or with
TURNWISE_TRL_FAKE_RETRIEVER=1, an in-process Python HTTP server speaking the same protocol
(`POST /retrieve` → `{"result": [[{"document": {"id", "contents"}, "score"}]]}`, word-overlap
scores) stands in. TURNWISE_TRL_REQUIRE_BINARY=1 makes a missing binary an error.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[5]

CORPUS = [
    {"id": "0", "contents": "France\nparis is the capital of france ."},
    {"id": "1", "contents": "Germany\nberlin is the capital of germany ."},
    {"id": "2", "contents": "Italy\nrome is the capital of italy ."},
    {"id": "3", "contents": "Spain\nmadrid is the capital of spain ."},
    {"id": "4", "contents": "Rivers\nthe seine flows through paris and the tiber through rome ."},
]

QUESTIONS = [
    ("question : what is the capital of france ?", "paris", "capital of france"),
    ("question : what is the capital of germany ?", "berlin", "capital of germany"),
    ("question : what is the capital of italy ?", "rome", "capital of italy"),
    ("question : what is the capital of spain ?", "madrid", "capital of spain"),
]

TAGS = ["<think>", "</think>", "<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(base: str, proc: "subprocess.Popen | None" = None, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"retrieval server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"retrieval server at {base} not healthy after {timeout} s")


def _binary() -> "Path | None":
    env = os.environ.get("TURNWISE_BIN")
    if env:
        return Path(env)
    for p in (REPO / "target" / "debug" / "turnwise", REPO / "target" / "release" / "turnwise"):
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


class _FakeRetriever(BaseHTTPRequestHandler):
    """Search-R1 protocol over CORPUS, scored by word overlap (the stand-in server)."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self._reply(200, {"status": "ok"} if self.path == "/health" else {"error": "not found"})

    def do_POST(self):
        if self.path != "/retrieve":
            return self._reply(404, {"error": "not found"})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        k = body.get("topk") or 3
        result = []
        for q in body["queries"]:
            words = set(re.findall(r"\w+", q.lower()))
            scored = [(len(words & set(re.findall(r"\w+", d["contents"].lower()))), d) for d in CORPUS]
            scored.sort(key=lambda t: -t[0])
            result.append([{"document": d, "score": float(s)} for s, d in scored[:k]])
        self._reply(200, {"result": result})

    def _reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="session")
def retriever(tmp_path_factory):
    """`(url, kind)`: the base URL of a running retrieval server and "turnwise" or "python"."""
    binary = None if os.environ.get("TURNWISE_TRL_FAKE_RETRIEVER") == "1" else _binary()
    if binary is None and os.environ.get("TURNWISE_TRL_REQUIRE_BINARY") == "1":
        pytest.fail("TURNWISE_TRL_REQUIRE_BINARY=1 but no turnwise binary (set TURNWISE_BIN)")
    if binary is not None:
        d = tmp_path_factory.mktemp("retriever")
        corpus = d / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
        subprocess.run(
            [str(binary), "index", "--quiet", "--corpus", str(corpus), "--out", str(d / "index")], check=True
        )
        port = _free_port()
        proc = subprocess.Popen(
            [str(binary), "serve-retriever", "--quiet", "--index", str(d / "index"),
             "--addr", f"127.0.0.1:{port}", "--topk", "2"]
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_health(base, proc)
            yield base, "turnwise"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    else:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeRetriever)
        t = threading.Thread(target=server.serve_forever, daemon=True)
        t.start()
        base = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            _wait_health(base)
            yield base, "python"
        finally:
            server.shutdown()


def _words(text: str):
    for piece in re.split(r"(</?[a-z]+>)", text):
        if piece in TAGS:
            continue
        yield from re.findall(r"\w+|[^\w\s]+", piece)


def _trajectory(question: str, gold: str, query: str, docs_text: str) -> "tuple[str, str, str]":
    first = f"<think> i need to search </think> <search> {query} </search>"
    info = f"\n\n<information>{docs_text}</information>\n\n"
    final = f"<think> i found it </think> <answer> {gold} </answer>"
    return first, info, final


@pytest.fixture(scope="session")
def tiny_policy(retriever):
    """`(model, tokenizer)`: a 2-layer Llama (random init) with a word-level tokenizer, warm
    started by a few dozen SFT steps on search-then-answer trajectories so that its samples
    (temperature 1) are multi-turn: search, observation, answer, sometimes wrong."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from turnwise.trl import RetrieverClient, format_information

    client = RetrieverClient(retriever[0], topk=2)
    texts = [d["contents"] for d in CORPUS] + [q for q, _, _ in QUESTIONS]
    texts += ["i need to search i found it Doc 1 2 3 ( Title : ) . ? wrong"]
    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for t in texts:
        for w in _words(t):
            vocab.setdefault(w, len(vocab))
    for tag in TAGS:
        vocab.setdefault(tag, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_tokens([AddedToken(t, single_word=False, normalized=False) for t in TAGS])
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=None, eos_token_id=2, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)

    # SFT warm start: model tokens are trained, observation tokens are not
    rows = []
    for q, gold, query in QUESTIONS:
        docs = format_information(client.retrieve([query])[0])
        first, info, final = _trajectory(q, gold, query, docs)
        p = tok(q)["input_ids"]
        a = tok(first, add_special_tokens=False)["input_ids"]
        o = tok(info, add_special_tokens=False)["input_ids"]
        f = tok(final, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = p + a + o + f
        labels = [-100] * len(p) + a + [-100] * len(o) + f
        rows.append((ids, labels))
    width = max(len(r[0]) for r in rows)
    ids = torch.tensor([r[0] + [0] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    att = (torch.arange(width)[None, :] < torch.tensor([len(r[0]) for r in rows])[:, None]).long()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return model, tok, float(loss.detach())

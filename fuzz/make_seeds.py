#!/usr/bin/env python3
"""Writes the seed inputs of every fuzz target into fuzz/corpus/<target>/ (seed-*), and the
dictionaries fuzz/dict/<target>.dict are kept by hand. The committed corpora are these seeds
plus what libFuzzer found, minimised with `cargo fuzz cmin` (README: "Fuzzing").

Run from the repository root: python3 fuzz/make_seeds.py (needs pyarrow for the Parquet seeds).
"""
import io
import json
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
FIX = os.path.join(ROOT, "crates", "turnwise-env", "tests", "fixtures", "questions")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


# tags: response \0 gold \0 gold ...
TURNS = {
    "sr1-search": "<think>I need the capital.</think>\n<search> capital of France </search>",
    "sr1-answer": "<think>done</think>\n<answer> Paris </answer>\x00Paris\x00paris city",
    "sr1-seq": "<think>a</think><search>q</search>\n\n<information>Doc 1(Title: x) y</information>\n\n"
    "<think>b</think><answer>y</answer>\x00y",
    "boxed": "<think>t</think><search>q</search> <result>\nr\n</result><think>u</think>"
    "<answer>So \\boxed{42}.</answer>\x0042",
    "t2po": "<think>go</think>\n<action><search>who founded x</search></action>\n\n"
    "<think>ok</think><action><answer>Ada</answer></action>\x00Ada",
    "verifiers": "<reasoning>r</reasoning>\n<tool>{\"name\": \"search\", \"args\": {\"q\": \"x\"}}</tool>"
    "\n\n<answer>x</answer>\x00x",
    "mt-ppo": "<think>a</think>\n<answer>the answer</answer><|answer_split|>b\x00answer",
    "empty": "",
}
for k, v in TURNS.items():
    put("tags", k, v)

# qa_jsonl: JSON-lines question (and corpus) files.
for name in ("train.jsonl", "test.jsonl"):
    with open(os.path.join(FIX, "nq_search", name), "rb") as f:
        lines = f.read().split(b"\n")
    put("qa_jsonl", "nq-" + name, b"\n".join(lines[:3]) + b"\n")
put("qa_jsonl", "plain", '{"id": "a", "question": "who wrote hamlet?", "golden_answers": ["Shakespeare"]}\n'
    '{"question": "capital of France", "answer": "Paris", "level": 2}\n')
put("qa_jsonl", "verl", json.dumps({"prompt": [{"role": "user", "content": "Question: who?"}],
                                    "reward_model": {"ground_truth": {"target": ["x", 2]}},
                                    "extra_info": {"split": "train", "index": 4}}) + "\n")
put("qa_jsonl", "bom-crlf", "\ufeff" + '{"question": "q", "golden_answers": ["a"]}\r\n')
put("qa_jsonl", "corpus", '{"id": "1", "contents": "\\"Paris\\"\\nParis is the capital."}\n'
    '{"id": 2, "contents": "Berlin\\nBerlin is a city."}\n')
put("qa_jsonl", "metadata", '{"id": 7, "question": "q", "golden_answers": "a", "metadata": {"hops": 2}}\n')

# qa_parquet: the fixtures, and a few small files written here.
for rel in ("raw_nq.parquet", "verl_columns_zstd.parquet", "corpus_title_text.parquet",
            "corpus.parquet", "bad/question_int.parquet", "bad/no_rows.parquet",
            "bad/null_answers.parquet"):
    with open(os.path.join(FIX, rel), "rb") as f:
        put("qa_parquet", rel.replace("/", "-"), f.read())
try:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parquet(name, table, **kw):
        buf = io.BytesIO()
        pq.write_table(table, buf, **kw)
        put("qa_parquet", name, buf.getvalue())

    parquet("float-answers", pa.table({"question": ["q1", "q2"], "golden_answers": [[2.0], [2.5]]}),
            compression="NONE")
    parquet("int-answers", pa.table({"question": ["q"], "answer": [7]}), compression="NONE")
    parquet("ids", pa.table({"id": [1, 2], "question": ["a", "b"], "golden_answers": [["x"], ["y"]]}),
            compression="NONE")
    parquet("corpus-min", pa.table({"id": ["1"], "contents": ["\"T\"\ntext"]}), compression="NONE")
except ImportError:
    pass

# serve_http: a route byte (0 /generate, 1 /v1/completions, 2 /v1/chat/completions) then the body.
HTTP = {
    "gen-text": (0, {"text": "Once upon", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
    "gen-ids": (0, {"input_ids": [[1, 2, 3], [4, 5]], "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": 3, "n": 2, "stop": ["a"], "sampling_seed": 1}}),
    "cmpl": (1, {"model": "m", "prompt": "Hello", "max_tokens": 4, "n": 2, "logprobs": 2, "seed": 3,
                 "stop": "\n", "temperature": 0.7, "top_p": 0.9}),
    "cmpl-batch": (1, {"prompt": [[1, 2], "hi"], "max_tokens": 2, "echo": False}),
    "chat": (2, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                 "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    "chat-choice": (2, {"messages": [{"role": "user", "content": "yes or no?"}],
                        "guided_choice": ["yes", "no"], "max_tokens": 8}),
    "chat-continue": (2, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                          "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 2}),
}
for k, (route, body) in HTTP.items():
    put("serve_http", k, bytes([route]) + json.dumps(body).encode())

# serve_retriever: /retrieve bodies.
RETR = {
    "basic": {"queries": ["capital of France"], "topk": 2, "return_scores": True},
    "plain": {"queries": ["Rada Cradovel born", "Tarsk"]},
    "null": {"queries": [], "topk": None, "return_scores": None},
    "big-topk": {"queries": ["x"], "topk": 100},
}
for k, v in RETR.items():
    put("serve_retriever", k, json.dumps(v))

# serve_env: mode 0 = WebSocket messages (NUL-separated), 1 = /reset body, 2 = /mcp body.
def ws(*msgs):
    return b"\x00" + b"\x00".join(json.dumps(m).encode() for m in msgs)


put("serve_env", "episode", ws({"type": "reset", "data": {"split": "test", "index": 0}},
                               {"type": "step", "data": {"message": "<think>a</think>\n<search> capital </search>"}},
                               {"type": "state"},
                               {"type": "step", "data": {"message": "<think>b</think>\n<answer> x </answer>"}},
                               {"type": "step", "data": {"message": "again"}}))
put("serve_env", "reset-close", ws({"type": "reset", "data": {"seed": 3, "episode_id": "e"}}, {"type": "close"}))
put("serve_env", "errors", ws({"type": "step", "data": {}}, {"type": "nope"}, {"type": "reset", "data": {"split": "dev"}}))
put("serve_env", "http-reset", b"\x01" + json.dumps({"split": "train", "index": 1}).encode())
put("serve_env", "http-mcp", b"\x02" + json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode())

# chat_template: a mode byte (even: conversation; odd: tokenizer_config.json), then NUL-separated
# pieces: the config (or nothing), then role, content, role, content ...
def conv(*pairs):
    return b"\x00" + b"\x00".join(s.encode() for p in pairs for s in p)


put("chat_template", "conv", b"\x00" + conv(("system", "be brief"), ("user", "hi"), ("assistant", " hello "), ("user", "bye")))
put("chat_template", "tool", b"\x00" + conv(("user", "q"), ("assistant", ""), ("tool", "result"), ("tool", "r2")))
cfg = {"chat_template": "{{ bos_token }}{% if messages %}{{ messages[0]['content'] | upper }}{% endif %}"
                        "{{ raise_exception('x') if messages|length > 3 }}",
       "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
put("chat_template", "config", b"\x01" + json.dumps(cfg).encode() + conv(("user", "hi")))
cfg2 = {"chat_template": [{"name": "default", "template": "{{ messages | tojson(indent=2) }}"}]}
put("chat_template", "config-list", b"\x01" + json.dumps(cfg2).encode() + conv(("user", "a\"b")))

"""A search agent written against the `openai` client, trained by turnwise's harness backend.

It plays one episode: the task's prompt, then turns of the model's text; a <search>query</search>
turn gets the passages of turnwise's retrieval server (Search-R1's /retrieve), an <answer> ends
the episode. turnwise runs it once per episode with the task and the policy server in the
environment (TURNWISE_*, OPENAI_BASE_URL) and trains on the tokens its server recorded for the
session named in the X-Session-Id header. See README.md beside it.
"""

import json
import os
import re
import urllib.request

from openai import OpenAI

env = os.environ
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between "
           "<search> and </search>. If I want to give the final answer, I should put the answer "
           "between <answer> and </answer>. Let me try again.\n")
client = OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"],
                default_headers={"X-Session-Id": env["TURNWISE_SESSION_ID"]}, max_retries=0)


def search(query: str) -> str:
    """Search-R1's observation: one `Doc i(Title: …) …` line per passage."""
    body = json.dumps({"queries": [query], "topk": int(env["TURNWISE_TOPK"]),
                       "return_scores": True}).encode()
    request = urllib.request.Request(env["TURNWISE_RETRIEVER_URL"], body,
                                     {"Content-Type": "application/json"})
    hits = json.load(urllib.request.urlopen(request, timeout=60))["result"][0]
    lines = []
    for i, hit in enumerate(hits):
        title, _, text = hit["document"]["contents"].partition("\n")
        lines.append(f"Doc {i + 1}(Title: {title}) {text}")
    passages = "\n".join(lines).strip()
    if env.get("TURNWISE_FORMAT") == "boxed":
        return f" <result>\n{passages}\n</result>"
    return f"\n\n<information>{passages}</information>\n\n"


BOXED = env.get("TURNWISE_FORMAT") == "boxed"


def action(text: str):
    """The turn's action as the task's format reads it: ("search", q), ("answer", a) or None.
    Search-R1: the first block; boxed (A2TGPO, AT2PO): the last <search> before the first
    </search>, and an empty query is no action."""
    s = re.search(r"<search>((?:(?!<search>).)*?)</search>" if BOXED else r"<search>(.*?)</search>",
                  text, re.S)
    a = re.search(r"<answer>(.*?)</answer>", text, re.S)
    if s and (not a or (s.end() <= a.end() if BOXED else s.start() < a.start())):
        return ("search", s[1].strip()) if s[1].strip() or not BOXED else None
    return ("answer", a[1].strip()) if a else None


prompt = env["TURNWISE_PROMPT"]
for turn in range(int(env["TURNWISE_MAX_TURNS"])):
    choice = client.completions.create(
        model=env["TURNWISE_MODEL"], prompt=prompt, max_tokens=int(env["TURNWISE_MAX_TOKENS"]),
        temperature=float(env["TURNWISE_TEMPERATURE"]), top_p=float(env["TURNWISE_TOP_P"]),
        stop=json.loads(env["TURNWISE_STOP"]),
        # The turn's text as sampled: its stop string and special tokens kept.
        extra_body={"top_k": int(env["TURNWISE_TOP_K"]) or -1,
                    "stop_token_ids": json.loads(env["TURNWISE_STOP_TOKEN_IDS"]),
                    "skip_special_tokens": False, "include_stop_str_in_output": True},
    ).choices[0]
    prompt += choice.text
    act = action(choice.text)
    if act and act[0] == "answer":
        break
    prompt += search(act[1]) if act else INVALID

"""Question sets in Search-R1's JSON-lines format (``{"id", "question", "golden_answers"}``, as
``turnwise data world`` writes them) as verl's RL dataset: parquet rows with ``prompt`` (chat
messages), ``data_source``, ``ability``, ``reward_model.ground_truth.target`` (the accepted
answers, where :mod:`turnwise.verl.trainer` finds the ground truth for its IG probes),
``extra_info`` and ``agent_name = "tool_agent"`` (verl's multi-turn tool loop).

    python -m turnwise.verl.data train.jsonl train.parquet
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["DATA_SOURCE", "INSTRUCTION", "verl_rows", "write_parquet", "main"]

#: ``data_source`` of the rows (verl's reward manager passes it to ``compute_score``).
DATA_SOURCE = "turnwise_search"

#: The user message around each question: Search-R1's instruction, with the search tool called
#: through the chat template's tool calls (verl's tool agent loop) instead of ``<search>`` tags.
INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    "every time you get new information. After reasoning, if you find you lack some knowledge, "
    "you can call the search tool with a query, and it returns the top searched results. You "
    "can search as many times as you want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}"
)


def verl_rows(path: str, split: Optional[str] = None, instruction: str = INSTRUCTION) -> List[Dict[str, Any]]:
    """The verl rows of one JSON-lines question file (errors name the file and line)."""
    rows = []
    split = split or Path(path).stem
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            for key in ("question", "golden_answers"):
                if key not in q:
                    raise ValueError(f"{path}:{n}: missing `{key}`")
            answers = q["golden_answers"]
            if isinstance(answers, str):
                answers = [answers]
            if not answers:
                raise ValueError(f"{path}:{n}: `golden_answers` is empty")
            question = str(q["question"]).strip()
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": instruction.format(question=question)}],
                    "ability": "search",
                    "reward_model": {"style": "rule", "ground_truth": {"target": [str(a) for a in answers]}},
                    "extra_info": {"split": split, "index": len(rows), "id": str(q.get("id", len(rows))), "question": question},
                    "agent_name": "tool_agent",
                }
            )
    if not rows:
        raise ValueError(f"{path}: no questions")
    return rows


def write_parquet(src: str, dst: str, split: Optional[str] = None) -> int:
    """Writes :func:`verl_rows` of ``src`` to the parquet file ``dst``; returns the row count."""
    import pandas as pd

    rows = verl_rows(src, split)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(dst)
    return len(rows)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m turnwise.verl.data", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="Search-R1 JSON-lines questions (turnwise data world's train.jsonl)")
    ap.add_argument("dst", help="parquet file to write")
    ap.add_argument("--split", default=None, help="extra_info.split (default: the file's stem)")
    args = ap.parse_args(argv)
    n = write_parquet(args.src, args.dst, args.split)
    print(f"{args.dst}: {n} rows")


if __name__ == "__main__":
    main()

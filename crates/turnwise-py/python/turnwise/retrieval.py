"""A client of Search-R1's retrieval protocol (``turnwise serve-retriever``, or Search-R1's own
server) and Search-R1's rendering of the documents it returns; used by :mod:`turnwise.trl`'s
rollouts and by the verl recipe's search tool (recipes/verl/search_tool.py). Standard library
only."""

from __future__ import annotations

import json
import urllib.request
from typing import Any, Dict, List, Sequence

__all__ = ["RetrieverClient", "format_information"]


class RetrieverClient:
    """Client of a Search-R1 retrieval server: ``POST {url}`` with ``{"queries": [...], "topk":
    k, "return_scores": true}`` → ``{"result": [[{"document": {"contents": ...}, "score": ...},
    ...], ...]}`` (one list per query). ``url`` may be the base URL or the ``/retrieve`` route."""

    def __init__(self, url: str, topk: int = 3, timeout: float = 30.0):
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.topk = topk
        self.timeout = timeout

    def retrieve(self, queries: Sequence[str]) -> List[List[Dict[str, Any]]]:
        if not queries:
            return []
        body = json.dumps({"queries": list(queries), "topk": self.topk, "return_scores": True})
        req = urllib.request.Request(
            self.url, data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            result = json.loads(resp.read())["result"]
        if len(result) != len(queries):
            raise RuntimeError(f"retriever answered {len(result)} result lists for {len(queries)} queries")
        return result


def format_information(docs: Sequence[Dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: first line) rest`` per document."""
    out = []
    for i, hit in enumerate(docs):
        doc = hit.get("document", hit)
        contents = doc.get("contents", "") if isinstance(doc, dict) else str(doc)
        title, _, text = contents.partition("\n")
        out.append(f"Doc {i + 1}(Title: {title}) {text}\n")
    return "".join(out)

"""The search tool of the verl recipe (examples/verl/search_r1.sh): a verl function tool
(``actor_rollout_ref.rollout.multi_turn.function_tool_path``) that sends the model's query to a
Search-R1 retrieval server (``turnwise serve-retriever``) and returns Search-R1's rendering of
the top documents. The server's URL comes from ``TURNWISE_RETRIEVER_URL`` (default
``http://127.0.0.1:8000/retrieve``), its depth from ``TURNWISE_RETRIEVER_TOPK`` (default 3).
"""

import os

from verl.tools.function_tool import function_tool

from turnwise.retrieval import RetrieverClient, format_information

_client = RetrieverClient(
    os.environ.get("TURNWISE_RETRIEVER_URL", "http://127.0.0.1:8000/retrieve"),
    topk=int(os.environ.get("TURNWISE_RETRIEVER_TOPK", "3")),
)


@function_tool
def search(query: str) -> str:
    """Searches the corpus and returns the most relevant passages.

    Args:
        query: What to search for, in a few words.
    """
    return format_information(_client.retrieve([query])[0])

"""The reward of the verl recipe (``reward.custom_reward_function.path``): exact match of the
last ``<answer>…</answer>`` of the response against the accepted answers, with Search-R1's
answer normalisation (turnwise.em), and 0 when the response has no answer."""

import re

from turnwise import em

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """verl's custom reward signature; ``ground_truth`` is ``{"target": [answers]}`` (rows
    written by ``python -m turnwise.verl.data``), a list of answers or one answer."""
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target", [])
    golds = [ground_truth] if isinstance(ground_truth, str) else [str(g) for g in ground_truth]
    answers = _ANSWER.findall(solution_str or "")
    if not answers or not golds:
        return 0.0
    return float(em(answers[-1].strip(), golds))

"""Agent tag grammars (spec §1.3): parse one agent turn into an action and format checks, and
run the whole-response format validators of the reward rules. Computed in Rust."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from . import _native

__all__ = ["FORMATS", "VALIDATORS", "parse_turn", "validate"]

#: Agent formats: ``search_r1`` (Search-R1, MT-PPO, ST-PPO, Tree-GRPO), ``boxed`` (A2TGPO,
#: AT2PO), ``t2po`` (T2PO, GiGPO / verl-agent), ``verifiers`` (two-turn MT-GRPO).
FORMATS: List[str] = list(_native.formats())

#: Whole-response validators of :func:`validate`, with what each checks.
VALIDATORS: List[Tuple[str, str]] = list(_native.validators())


def parse_turn(format: str, text: str, script: Optional[str] = None) -> Dict[str, Any]:
    """Parses one agent turn written in ``format``.

    Returns a dict with ``action`` (``{"kind": "search", "query": ...}``, ``{"kind": "answer",
    "text": ...}`` or ``{"kind": "invalid", "reason": ...}``), ``valid`` (every format check
    passed), ``checks`` (``[{"rule": ..., "passed": ..., "reason": ...}]``) and
    ``final_answer`` (the string EM/F1 score for an answer turn: the ``\\boxed{}`` content for
    ``boxed``). ``script`` (``"english"`` default or ``"any"``) applies to ``t2po`` only.

    >>> parse_turn("search_r1", "<think>hm</think><search> capital of France </search>")["action"]
    {'kind': 'search', 'query': 'capital of France'}
    """
    parsed = json.loads(_native.parse_turn(format, text, script))
    checks = [
        {
            "rule": c["rule"],
            "passed": c["violation"] is None,
            "reason": None if c["violation"] is None else c["violation"]["reason"],
        }
        for c in parsed["verdict"]["checks"]
    ]
    return {
        "action": parsed["action"],
        "valid": all(c["passed"] for c in checks),
        "checks": checks,
        "final_answer": parsed["final_answer"],
    }


def validate(rule: str, text: str, script: Optional[str] = None) -> Optional[str]:
    """Runs the whole-response validator ``rule`` (see :data:`VALIDATORS`); ``None`` when the
    text passes, else the reason (e.g. ``"unclosed <think> at byte 17"``)."""
    v = _native.validate(rule, text, script)
    return None if v is None else v[0]

"""Agent grammars and rewards against docs/algorithms.md §2 vectors and turnwise-core's own
grammar tests."""

import pytest

import turnwise as tw


# --------------------------------------------------------------------------- grammar


def test_formats_and_validators_listed():
    assert tw.FORMATS == ["search_r1", "boxed", "t2po", "verifiers"]
    assert [n for n, _ in tw.VALIDATORS] == [
        "search_r1_sequence", "boxed_format", "boxed_tags", "mt_ppo_final",
        "mt_ppo_intermediate", "t2po_strict",
    ]


def test_parse_turn_search_r1():
    p = tw.parse_turn("search_r1", "<think>need</think><search> eiffel tower </search>")
    assert p["action"] == {"kind": "search", "query": "eiffel tower"}
    assert p["valid"] and p["final_answer"] is None
    p = tw.parse_turn("search_r1", "<think>ok</think><answer> Paris </answer>")
    assert p["action"] == {"kind": "answer", "text": "Paris"}
    assert p["final_answer"] == "Paris"
    p = tw.parse_turn("search_r1", "<think>hmm</think><search>abc")
    assert p["action"]["kind"] == "invalid" and not p["valid"]
    assert "unclosed <search> at byte 18" in [c["reason"] for c in p["checks"]]
    p = tw.parse_turn("search_r1", "<answer>a</answer><search>q</search>")
    assert p["action"] == {"kind": "answer", "text": "a"}
    single = [c for c in p["checks"] if c["rule"] == "single_action"]
    assert single and single[0]["passed"] is False


def test_parse_turn_boxed():
    p = tw.parse_turn("boxed", "<think>t</think><search>a <search> q2 </search>")
    assert p["action"] == {"kind": "search", "query": "q2"}
    p = tw.parse_turn("boxed", "<think>t</think><answer>It is \\boxed{Paris}.</answer>")
    assert p["action"] == {"kind": "answer", "text": "It is \\boxed{Paris}."}
    assert p["final_answer"] == "Paris" and p["valid"]
    p = tw.parse_turn("boxed", "<think>t</think><answer>Paris</answer>")
    assert p["final_answer"] is None and not p["valid"]
    assert "answer is missing \\boxed{} at byte 16" in [c["reason"] for c in p["checks"]]
    p = tw.parse_turn("boxed", "<think>t</think><search>  </search>")
    assert p["action"]["kind"] == "invalid"


def test_parse_turn_t2po_and_verifiers():
    p = tw.parse_turn("t2po", "<think>plan</think>\n<action><search>who</search></action>")
    assert p["action"] == {"kind": "search", "query": "who"} and p["valid"]
    p = tw.parse_turn("t2po", "<think>计划</think>\n<action><search>who</search></action>", script="english")
    assert not p["valid"]
    p = tw.parse_turn("t2po", "<think>计划</think>\n<action><search>who</search></action>", script="any")
    assert p["valid"]
    p = tw.parse_turn(
        "verifiers",
        '<reasoning>r</reasoning>\n<tool>{"name": "search", "args": {"query": "q"}}</tool>',
    )
    assert p["action"] == {"kind": "search", "query": "q"}


def test_validate():
    assert tw.validate("mt_ppo_final", "<think>a</think> <answer>b</answer>") is None
    assert tw.validate("mt_ppo_final", "<answer>b</answer><think>a</think>") == "<answer> out of order at byte 0"
    inter = "<think>a</think><search>q</search>\n\n<information>Doc</information>\n\n"
    assert tw.validate("mt_ppo_intermediate", inter) is None
    assert tw.validate("search_r1_sequence", "<think>a</think><answer>c</answer>") is None
    assert tw.validate("t2po_strict", "<think>a</think>x<action>b</action>") == (
        "text between </think> and <action> at byte 16"
    )
    assert tw.validate("boxed_format", "<think>x</think><answer>Beatles</answer>") is not None


def test_grammar_errors():
    with pytest.raises(ValueError, match="`format`: unknown agent format \"xml\""):
        tw.parse_turn("xml", "x")
    with pytest.raises(ValueError, match="`script`"):
        tw.parse_turn("search_r1", "x", script="any")
    with pytest.raises(ValueError, match="`script`: unknown target script"):
        tw.parse_turn("t2po", "x", script="klingon")
    with pytest.raises(ValueError, match="`rule`: unknown validator"):
        tw.validate("nope", "x")


# --------------------------------------------------------------------------- text metrics


def test_normalize_and_em_vectors():
    assert tw.normalize_answer("  The Eiffel   Tower! ") == "eiffel tower"
    assert tw.normalize_answer("U.S. Army") == "us army"
    assert tw.normalize_answer("A Tale of Two Cities") == "tale of two cities"
    assert tw.normalize_answer("theater") == "theater"
    assert tw.em("the Beatles.", ["Beatles", "The Fab Four"]) == 1.0
    assert tw.em("Beatles band", ["Beatles"]) == 0.0
    assert tw.em("Beatles", "beatles") == 1.0
    assert tw.sub_em("Beatles band", ["Beatles"]) == 1.0


def test_f1_vectors():
    assert tw.f1("Peter Schmeichel goalkeeper", ["Peter Schmeichel"]) == pytest.approx(0.8)
    assert tw.f1("no", ["yes"]) == 0.0
    assert tw.f1("yes it is", ["yes"]) == 0.0
    assert tw.f1("the cat the cat", ["cat"]) == pytest.approx(0.666667, abs=1e-6)
    assert tw.igpo_f1("U.S. Army", ["US Army"]) == pytest.approx(0.4)
    assert tw.f1("U.S. Army", ["US Army"]) == pytest.approx(1.0)
    assert tw.igpo_f1("cat cat cat", ["cat dog"]) == pytest.approx(0.666667, abs=1e-6)
    assert tw.f1("cat cat cat", ["cat dog"]) == pytest.approx(0.4)


# --------------------------------------------------------------------------- rewards

BOXED_CASES = [
    (
        [
            ("<think>x</think><search>q</search>", " <result>\nr\n</result>"),
            ("<think>y</think><answer>The answer is \\boxed{The Beatles}</answer>", None),
        ],
        1.0,
    ),
    ("<think>x</think><answer>Beatles</answer>", -1.0),
    ("<think>x</think><answer>\\boxed{Rolling Stones}</answer>", 0.0),
    ("<think>x</think><search>q</search><think>y</think><answer>\\boxed{Beatles}</answer>", -1.0),
]


@pytest.mark.parametrize("response,want", BOXED_CASES)
def test_boxed_em_spec_vectors(response, want):
    out = tw.score("boxed_em", response, ["Beatles"])
    assert out["score"] == want
    assert out["format_ok"] == (want != -1.0)
    if want == -1.0:
        assert out["reason"]


def test_score_settings_and_turn_rewards():
    out = tw.score("boxed_em", "<think>x</think><answer>Beatles</answer>", ["Beatles"], format_failure=0.0)
    assert out["score"] == 0.0
    out = tw.score("em", "<think>x</think><answer>Paris</answer>", "Paris")
    assert out["score"] == 1.0 and out["em"] == 1.0
    turns = [
        ("<think>a</think><search>paris</search>", "\n\n<information>Doc 1(Title: Paris) capital</information>\n\n"),
        ("<think>b</think><answer>Paris</answer>", None),
    ]
    out = tw.score("mt_ppo_turn", turns, ["Paris"])
    assert len(out["turn_rewards"]) == 2
    assert out["score"] == out["turn_rewards"][-1]
    assert set(tw.REWARDS) >= {"boxed_em", "search_r1_em", "mt_ppo_turn", "f1", "igpo_f1"}


def test_score_errors():
    with pytest.raises(ValueError, match="unknown reward"):
        tw.score("bleu", "x", ["y"])
    with pytest.raises(ValueError, match="reward"):
        tw.score("boxed_em", "x", ["y"], bogus_setting=1)
    with pytest.raises(ValueError, match="format_failure"):
        tw.score("boxed_em", "x", ["y"], format_failure=float("inf"))
    with pytest.raises(ValueError, match="name"):
        tw.score("em", "x", ["y"], name="f1")

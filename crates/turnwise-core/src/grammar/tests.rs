//! Unit and property tests of the grammars.

use proptest::prelude::*;

use super::search_r1::AnswerRule;
use super::*;

fn search(q: &str) -> Action {
    Action::Search {
        query: q.to_owned(),
    }
}

fn answer(t: &str) -> Action {
    Action::Answer { text: t.to_owned() }
}

// ---------------------------------------------------------------- Search-R1 (§1.3, §2.1, §2.4)

#[test]
fn search_r1_turns() {
    let p = parse_turn(
        Format::SearchR1,
        "<think>need</think><search> eiffel tower </search>",
    );
    assert_eq!(p.action, search("eiffel tower"));
    assert!(p.verdict.is_valid(), "{:?}", p.verdict);

    let p = parse_turn(
        Format::SearchR1,
        "<think>ok</think><answer> Paris </answer>",
    );
    assert_eq!(p.action, answer("Paris"));
    assert_eq!(p.final_answer.as_deref(), Some("Paris"));

    // No action: invalid, with the reason naming the unclosed tag.
    let p = parse_turn(Format::SearchR1, "<think>hmm</think><search>abc");
    assert!(p.action.is_invalid());
    assert_eq!(
        p.verdict.first_failure().unwrap().reason,
        "unclosed <search> at byte 18"
    );

    // `</search>` wins over an earlier `</answer>` (SR1 `_postprocess_responses`), then the
    // leftmost block of the cut text is the action.
    let p = parse_turn(Format::SearchR1, "<answer>a</answer><search>q</search>");
    assert_eq!(p.action, answer("a"));
    assert_eq!(p.verdict.passed(rules::SINGLE_ACTION), Some(false));

    let p = parse_turn(
        Format::SearchR1,
        "<think>x<answer>a</answer><answer>b</answer>",
    );
    assert_eq!(p.action, answer("a"));
    let reasons: Vec<String> = p
        .verdict
        .failures()
        .map(|c| c.violation.clone().unwrap().reason)
        .collect();
    assert_eq!(
        reasons,
        vec![
            "unclosed <think> at byte 0".to_owned(),
            "2 <answer> blocks".to_owned()
        ]
    );
}

#[test]
fn search_r1_answer_extraction() {
    let t = "<answer> a </answer> text <answer> b </answer>";
    assert_eq!(
        search_r1::extract_answer(t, AnswerRule::LastMatch),
        Some("b")
    );
    assert_eq!(
        search_r1::extract_answer(t, AnswerRule::LastOfAtLeastTwo),
        Some("b")
    );
    let one = "<answer>x</answer>";
    assert_eq!(
        search_r1::extract_answer(one, AnswerRule::LastMatch),
        Some("x")
    );
    assert_eq!(
        search_r1::extract_answer(one, AnswerRule::LastOfAtLeastTwo),
        None
    );
    assert_eq!(
        search_r1::extract_answer("none", AnswerRule::LastMatch),
        None
    );
}

#[test]
fn search_r1_sequence_state_machine() {
    let ok = "<think>a</think>\n<search>q</search>\n\n<information>Doc 1</information>\n\n\
              <think>b</think><answer>c</answer>\n";
    assert_eq!(search_r1::validate_sequence(ok), Ok(()));
    assert!(search_r1::validate_sequence("<think>a</think><answer>c</answer>").is_ok());

    let cases = [
        (
            "<think>a</think><answer>c</answer> trailing",
            "unexpected content between tags (state end) at byte 35",
        ),
        (
            "<think>a</think>x<answer>c</answer>",
            "unexpected content between tags (state after_think) at byte 16",
        ),
        (
            "<answer>c</answer>",
            "unexpected tag <answer> in state start at byte 0",
        ),
        (
            "<think>a</think><search>q</search><think>b</think><answer>c</answer>",
            "unexpected tag <think> in state after_search at byte 34",
        ),
        (
            "<think>a</think><answer>c",
            "mismatch in answer tags: 1 opening vs 0 closing",
        ),
        (
            "<think>a</think>",
            "incomplete sequence, ended in state after_think",
        ),
    ];
    for (text, reason) in cases {
        assert_eq!(
            search_r1::validate_sequence(text).unwrap_err().reason,
            reason,
            "{text}"
        );
    }
}

#[test]
fn search_r1_information_and_feedback() {
    assert_eq!(
        search_r1::information_blocks(
            "<information> a </information>x<information>b</information>"
        ),
        vec!["a", "b"]
    );
    assert_eq!(
        search_r1::format_observation(" d \n"),
        "\n\n<information>d</information>\n\n"
    );
    assert!(search_r1::INVALID_ACTION_FEEDBACK.starts_with("\nMy previous action is invalid."));
    assert!(search_r1::INVALID_ACTION_FEEDBACK.ends_with("Let me try again.\n"));
    assert_eq!(Format::SearchR1.stop_strings(), &["</search>", "</answer>"]);
    assert_eq!(Format::T2po.stop_strings(), &["</action>"]);
}

// ---------------------------------------------------------------- Boxed (§2.3)

#[test]
fn boxed_validate_format_reasons() {
    let ok = "<think>x</think><search>q</search> <result>\nr\n</result><think>y</think>\
              <answer>The answer is \\boxed{The Beatles}</answer>";
    assert_eq!(boxed::validate_format(ok), Ok(()));
    let cases = [
        (
            "<think>x</think><answer>Beatles</answer>",
            "answer is missing \\boxed{} format at byte 16",
        ),
        (
            "<think>x</think><search>q</search><think>y</think><answer>\\boxed{B}</answer>",
            "search/result tags are incomplete at byte 16",
        ),
        (
            "<think>x<answer>\\boxed{B}</answer>",
            "<think> </think> not paired (1 vs 0)",
        ),
        (
            "<answer>\\boxed{B}</answer>",
            "<think> or </think> not found",
        ),
        (
            "<think>x</think><answer>\\boxed{B}</answer><answer>",
            "expected exactly one <answer> and one </answer>, found 2 and 1",
        ),
        (
            "<think>x</think></answer><answer>\\boxed{B}",
            "<answer> must be before </answer> at byte 16",
        ),
        (
            "<think>x</think><result>r</result><search>q</search><answer>\\boxed{B}</answer>",
            "search/result tags are incomplete at byte 34",
        ),
        (
            "<think>x</think><search><result>q</search></result><answer>\\boxed{B}</answer>",
            "search/result tags are nested in the wrong order at byte 16",
        ),
    ];
    for (text, reason) in cases {
        assert_eq!(
            boxed::validate_format(text).unwrap_err().reason,
            reason,
            "{text}"
        );
    }
}

#[test]
fn boxed_extraction() {
    assert_eq!(
        boxed::extract_boxed("so \\boxed{a} then \\boxed{b{c}d}."),
        Some("b{c}d")
    );
    assert_eq!(boxed::extract_boxed("\\boxed 42$ rest"), Some("42"));
    assert_eq!(boxed::extract_boxed("\\fbox{x}"), Some("x"));
    assert_eq!(boxed::extract_boxed("\\boxed{unclosed"), None);
    assert_eq!(boxed::extract_boxed("\\boxed{a} \\boxed"), None); // last \boxed has no braces
    assert_eq!(boxed::extract_boxed("no box"), None);
    // First <answer>, then its last \boxed{}.
    let r = " <answer>\\boxed{A} \\boxed{B}</answer><answer>\\boxed{C}</answer>";
    assert_eq!(boxed::extract_answer(r), Some("B"));
    assert_eq!(
        boxed::extract_search_query("<search>a</search> <search> b </search>"),
        Some("b")
    );
    assert_eq!(boxed::extract_search_query("<search> </search>"), None);
}

#[test]
fn boxed_turns() {
    let p = parse_turn(
        Format::Boxed,
        "<think>t</think><search>a <search> q2 </search>",
    );
    assert_eq!(p.action, search("q2"));
    let p = parse_turn(Format::Boxed, "<think>t</think><search>  </search>");
    assert!(p.action.is_invalid());
    assert_eq!(p.verdict.passed(rules::NON_EMPTY_QUERY), Some(false));
    let p = parse_turn(
        Format::Boxed,
        "<think>t</think><answer>It is \\boxed{Paris}.</answer>",
    );
    assert_eq!(p.action, answer("It is \\boxed{Paris}."));
    assert_eq!(p.final_answer.as_deref(), Some("Paris"));
    assert!(p.verdict.is_valid());
    let p = parse_turn(Format::Boxed, "<think>t</think><answer>Paris</answer>");
    assert!(p.action.is_answer());
    assert_eq!(p.final_answer, None);
    assert_eq!(
        p.verdict.first_failure().unwrap().reason,
        "answer is missing \\boxed{} at byte 16"
    );
}

// ---------------------------------------------------------------- MT-PPO (§2.4)

#[test]
fn mt_ppo_formats() {
    assert_eq!(
        mt_ppo::final_turn_format("<think>a</think> <answer>b</answer>"),
        Ok(())
    );
    assert_eq!(
        mt_ppo::final_turn_format("<answer>b</answer><think>a</think>")
            .unwrap_err()
            .reason,
        "<answer> out of order at byte 0"
    );
    assert_eq!(
        mt_ppo::final_turn_format("<think>a</think><answer>b</answer><answer>c</answer>")
            .unwrap_err()
            .reason,
        "2 <answer> and 2 </answer> tags, expected exactly one each"
    );
    assert_eq!(
        mt_ppo::final_turn_format("<think>a</think><search>q</search><answer>b</answer>")
            .unwrap_err()
            .reason,
        "unexpected tag <search> at byte 16"
    );
    let inter = "<think>a</think><search>q</search>\n\n<information>Doc</information>\n\n";
    assert_eq!(mt_ppo::intermediate_turn_format(inter), Ok(()));
    assert!(
        mt_ppo::intermediate_turn_format("<search>q</search><information>d</information>").is_err()
    );
}

// ---------------------------------------------------------------- T2PO (§2.6)

#[test]
fn t2po_strict_relaxed_and_projection() {
    let s = "<think>plan</think>\n<action><search>who</search></action>";
    assert_eq!(t2po::v_strict(s, t2po::TargetScript::English), Ok(()));
    let p = parse_turn(Format::T2po, s);
    assert_eq!(p.action, search("who"));
    assert!(p.verdict.is_valid());

    let cases = [
        (
            "<think>a</think>x<action>b</action>",
            "text between </think> and <action> at byte 16",
        ),
        (
            "<think>a</think><action>b</action><action>",
            "2 <action> tags, expected exactly one",
        ),
        (
            "<think>a</think><action>b</action> tail",
            "output does not end with </action>",
        ),
        (
            "<think>计划</think><action>b</action>",
            "non-target-language character '计' at byte 7",
        ),
    ];
    for (text, reason) in cases {
        assert_eq!(
            t2po::v_strict(text, t2po::TargetScript::English)
                .unwrap_err()
                .reason,
            reason
        );
    }
    assert!(
        t2po::v_strict(
            "<think>计划</think><action>b</action>",
            t2po::TargetScript::Any
        )
        .is_ok()
    );

    // Relaxed: first <action>, unclosed allowed.
    assert_eq!(
        t2po::relaxed_action("x <action><answer>A</answer>"),
        Some("<answer>A</answer>")
    );
    let p = parse_turn(Format::T2po, "oops <action><answer> A </answer>");
    assert_eq!(p.action, answer("A"));
    assert_eq!(p.verdict.passed(rules::T2PO_STRICT), Some(false));
    assert_eq!(p.verdict.passed(rules::ACTION_VALID), Some(true));

    // verl-agent projection: case-insensitive, both tags → invalid but extracted.
    let pr = t2po::project_search_action("<SEARCH> q </Search><answer>a</answer>");
    assert_eq!(pr.action, Some(search("q")));
    assert_eq!(
        pr.validity.unwrap_err().reason,
        "both <search> and <answer> present"
    );
    let pr = t2po::project_search_action("<answer>a</answer><answer>b</answer>");
    assert_eq!(pr.action, Some(answer("a")));
    assert_eq!(pr.validity.unwrap_err().reason, "2 <answer> blocks");
    let pr = t2po::project_search_action("<think>nothing</think>");
    assert_eq!(pr.action, None);
    assert!(pr.validity.is_err());
    // Without <action>, the whole text is the payload (verl-agent search prompt).
    let p = parse_turn(Format::T2po, "<think>t</think><search>q</search>");
    assert_eq!(p.action, search("q"));
    assert_eq!(p.verdict.passed(rules::T2PO_STRICT), Some(false));
}

#[test]
fn format_names_round_trip() {
    for f in Format::ALL {
        assert_eq!(f.name().parse::<Format>(), Ok(f));
        assert_eq!(
            serde_json::to_string(&f).unwrap(),
            format!("\"{}\"", f.name())
        );
    }
    let err = "searchr1".parse::<Format>().unwrap_err();
    assert!(
        err.to_string()
            .contains("unknown agent format \"searchr1\"")
    );
    let a: Action = serde_json::from_str(r#"{"kind":"search","query":"q"}"#).unwrap();
    assert_eq!(a, search("q"));
}

// ---------------------------------------------------------------- properties

/// Exercises every parser and validator on `s`; they must neither panic nor loop.
fn run_all(s: &str) {
    for f in Format::ALL {
        let p = parse_turn(f, s);
        let _ = p.verdict.is_valid();
    }
    let _ = search_r1::validate_sequence(s);
    let _ = search_r1::extract_answer(s, AnswerRule::LastMatch);
    let _ = search_r1::extract_answer(s, AnswerRule::LastOfAtLeastTwo);
    let _ = search_r1::information_blocks(s);
    let _ = boxed::validate_format(s);
    let _ = boxed::extract_answer(s);
    let _ = boxed::extract_search_query(s);
    let _ = mt_ppo::final_turn_format(s);
    let _ = mt_ppo::intermediate_turn_format(s);
    let _ = t2po::v_strict(s, t2po::TargetScript::English);
    let _ = t2po::project_search_action(s);
    let _ = scan::any_tags(s);
}

const FRAGMENTS: &[&str] = &[
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
    "<result>",
    "</result>",
    "<action>",
    "</action>",
    "<python>",
    "</python>",
    "\\boxed{",
    "\\boxed ",
    "\\fbox{",
    "{",
    "}",
    "$",
    "<",
    ">",
    "/",
    " ",
    "\n",
    "é",
    "计",
    "a",
    "The Beatles",
    "<think",
    "</",
    "\u{1c}",
];

fn fragment_soup() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(FRAGMENTS), 0..40).prop_map(|v| v.concat())
}

/// Text that cannot contain `<` (so it cannot fake a tag) and has no surrounding whitespace.
fn plain() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9é计][a-zA-Z0-9 é计?.,]{0,20}[a-zA-Z0-9]".prop_map(|s| s)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_panic_on_arbitrary_strings(s in any::<String>()) {
        run_all(&s);
    }

    #[test]
    fn no_panic_on_tag_soup(s in fragment_soup()) {
        run_all(&s);
    }

    #[test]
    fn no_panic_on_lossy_bytes(b in prop::collection::vec(any::<u8>(), 0..200)) {
        run_all(&String::from_utf8_lossy(&b));
    }

    #[test]
    fn search_r1_round_trip(think in plain(), q in plain(), is_answer in any::<bool>()) {
        let (text, want) = if is_answer {
            (format!("<think>{think}</think>\n<answer> {q} </answer>"), answer(&q))
        } else {
            (format!("<think>{think}</think>\n<search> {q} </search>"), search(&q))
        };
        let p = parse_turn(Format::SearchR1, &text);
        prop_assert_eq!(p.action, want);
        prop_assert!(p.verdict.is_valid());
    }

    #[test]
    fn boxed_round_trip(think in plain(), q in plain(), x in "[a-zA-Z0-9 ]{1,12}") {
        let p = parse_turn(Format::Boxed, &format!("<think>{think}</think><search>{q}</search>"));
        prop_assert_eq!(p.action, search(&q));
        let text = format!("<think>{think}</think><answer>So \\boxed{{{x}}}.</answer>");
        let p = parse_turn(Format::Boxed, &text);
        prop_assert_eq!(p.final_answer.as_deref(), Some(x.as_str()));
        prop_assert!(p.verdict.is_valid());
        let full = format!("<think>{think}</think><search>{q}</search> <result>\nr\n</result>{text}");
        prop_assert_eq!(boxed::validate_format(&full), Ok(()));
        prop_assert_eq!(boxed::extract_answer(&full), Some(x.as_str()));
    }

    #[test]
    fn t2po_round_trip(think in "[a-zA-Z0-9 ]{0,20}", q in "[a-zA-Z0-9][a-zA-Z0-9 ]{0,10}[a-zA-Z0-9]", is_answer in any::<bool>()) {
        let (inner, want) = if is_answer {
            (format!("<answer>{q}</answer>"), answer(&q))
        } else {
            (format!("<search>{q}</search>"), search(&q))
        };
        let p = parse_turn(Format::T2po, &format!("<think>{think}</think>\n<action>{inner}</action>"));
        prop_assert_eq!(p.action, want);
        prop_assert!(p.verdict.is_valid());
    }

    #[test]
    fn search_r1_generated_sequence_is_valid(turns in prop::collection::vec((plain(), plain(), plain()), 0..4), a in plain()) {
        let mut s = String::new();
        for (t, q, info) in &turns {
            s.push_str(&format!("<think>{t}</think><search>{q}</search>"));
            s.push_str(&search_r1::format_observation(info));
        }
        s.push_str(&format!("<think>t</think><answer>{a}</answer>"));
        prop_assert_eq!(search_r1::validate_sequence(&s), Ok(()));
        prop_assert_eq!(search_r1::extract_answer(&s, AnswerRule::LastMatch), Some(a.as_str()));
    }
}

/// Adversarial long inputs (≈ 200 KB each): a quadratic scan would take minutes here, the
/// linear scanners take milliseconds.
#[test]
fn long_adversarial_inputs_are_linear() {
    let n = 25_000;
    let inputs = [
        "<think>".repeat(n),
        "<search>".repeat(n) + "</search>",
        "<search></search><result>".repeat(n),
        "\\boxed{".repeat(n),
        "<answer>{".repeat(n) + "</answer>",
        "<".repeat(8 * n),
        "<action><search>x".repeat(n),
        "<think>a</think><search>q</search> <result>\nr\n</result>".repeat(n / 4),
    ];
    let start = std::time::Instant::now();
    for s in &inputs {
        run_all(s);
    }
    assert!(start.elapsed().as_secs() < 20, "took {:?}", start.elapsed());
}

//! The tag grammars, their validators and the rewards.
//!
//! Input: `response \0 gold \0 gold …` (lossy UTF-8). The response is parsed in every format;
//! it is also split into turns at each `\n\n` for the turn-level rewards.
//!
//! Invariants beyond "no panic":
//! - parsing is deterministic, and a violation's byte offset lies inside the text;
//! - a search query and an answer text are trimmed, and a search query is non-empty unless the
//!   verdict says so (`non_empty_query`);
//! - round trip: an extracted query or answer without `<`/`>`, rendered back in the format's
//!   canonical shape, parses to the same action (valid, for `search_r1`);
//! - every reward is finite.

use turnwise_core::grammar::{self, Action, Format, boxed, mt_ppo, search_r1, t2po};
use turnwise_core::reward::{self, RewardConfig, RewardInput, TurnText, two_turn};

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let response = parts.next().unwrap_or("");
    let golds: Vec<String> = parts.map(str::to_owned).collect();

    for format in Format::ALL {
        let parsed = grammar::parse_turn(format, response);
        assert_eq!(
            parsed,
            grammar::parse_turn(format, response),
            "{format:?}: parsing is not deterministic"
        );
        for check in &parsed.verdict.checks {
            if let Some(v) = &check.violation
                && let Some(at) = v.at
            {
                assert!(
                    at <= response.len(),
                    "{format:?}: {} at byte {at} of a {}-byte text",
                    v.reason,
                    response.len()
                );
            }
        }
        match &parsed.action {
            Action::Search { query } => {
                assert_eq!(query.trim(), query, "{format:?}: untrimmed query");
                if query.is_empty() {
                    assert_ne!(
                        parsed.verdict.passed(grammar::rules::NON_EMPTY_QUERY),
                        Some(true),
                        "{format:?}: an empty query passed non_empty_query"
                    );
                }
            }
            Action::Answer { text } => {
                assert_eq!(text.trim(), text, "{format:?}: untrimmed answer");
            }
            Action::Invalid { .. } => {}
        }
        round_trip(format, &parsed.action);
    }

    let _ = search_r1::validate_sequence(response);
    let _ = search_r1::extract_answer(response, search_r1::AnswerRule::LastMatch);
    let _ = search_r1::extract_answer(response, search_r1::AnswerRule::LastOfAtLeastTwo);
    let _ = search_r1::information_blocks(response);
    let cut = search_r1::truncate_at_stop(response);
    assert!(
        response.starts_with(cut),
        "truncate_at_stop is not a prefix"
    );
    let _ = boxed::validate_format(response);
    let _ = boxed::extract_answer(response);
    let _ = boxed::extract_search_query(response);
    let _ = mt_ppo::final_turn_format(response);
    let _ = mt_ppo::intermediate_turn_format(response);
    let _ = t2po::v_strict(response, t2po::TargetScript::English);
    let _ = t2po::relaxed_action(response);
    let _ = t2po::project_search_action(response);

    let pieces: Vec<&str> = response.split("\n\n").collect();
    let turns: Vec<TurnText<'_>> = pieces
        .chunks(2)
        .map(|c| TurnText {
            generated: c[0],
            observation: c.get(1).copied(),
        })
        .collect();
    for name in RewardConfig::NAMES {
        let cfg = RewardConfig::from_name(name).expect("every name in NAMES is known");
        let input = RewardInput::from_turns(&turns, &golds);
        if let Ok(out) = cfg.score(&input) {
            assert!(
                out.score.is_finite() && out.turn_rewards.iter().all(|r| r.is_finite()),
                "reward {name}: {out:?}"
            );
        }
    }
    let _ = reward::normalize_answer(response);
    let f1 = reward::squad_f1(response, &golds);
    assert!((0.0..=1.0).contains(&f1), "squad_f1 {f1}");
    let _ = reward::igpo_f1(response, &golds);
    let msgs: Vec<two_turn::Message<'_>> = pieces
        .iter()
        .enumerate()
        .map(|(i, c)| two_turn::Message {
            role: if i % 2 == 0 {
                two_turn::Role::Assistant
            } else {
                two_turn::Role::User
            },
            content: c,
        })
        .collect();
    let _ = two_turn::TwoTurnRewards::compute(&msgs, &golds);
}

/// Renders `action` in `format`'s canonical shape and checks that it parses back to itself.
fn round_trip(format: Format, action: &Action) {
    let (is_search, content) = match action {
        Action::Search { query } => (true, query.as_str()),
        Action::Answer { text } => (false, text.as_str()),
        Action::Invalid { .. } => return,
    };
    if content.is_empty() || content.contains(['<', '>', '\\', '{', '}']) {
        return;
    }
    let (tag, expected) = if is_search {
        ("search", action.clone())
    } else {
        ("answer", action.clone())
    };
    let text = match format {
        Format::SearchR1 => format!("<think>x</think>\n<{tag}> {content} </{tag}>"),
        Format::T2po => format!("<think>x</think>\n<action><{tag}>{content}</{tag}></action>"),
        Format::Boxed if is_search => format!("<think>x</think><search>{content}</search>"),
        // A boxed answer is the last `\boxed{}`, not the block: not a round trip of the text.
        Format::Boxed | Format::Verifiers => return,
    };
    let again = grammar::parse_turn(format, &text);
    assert_eq!(
        again.action, expected,
        "{format:?}: {action:?} rendered as {text:?} parses back differently"
    );
    if format == Format::SearchR1 {
        assert!(
            again.verdict.is_valid(),
            "{format:?}: the canonical rendering {text:?} is not valid: {:?}",
            again.verdict.first_failure()
        );
    }
}

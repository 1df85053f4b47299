//! Fuzz target: arbitrary bytes (lossy UTF-8) through every grammar parser and validator and
//! every reward. Nothing may panic or hang.
//!
//! Input layout: `response \0 gold \0 gold …`; the response is also split into agent turns at
//! each `\n\n` (odd pieces are observations) to exercise the turn-level rewards.

#![no_main]

use libfuzzer_sys::fuzz_target;
use turnwise_core::grammar::{self, Format, boxed, mt_ppo, search_r1, t2po};
use turnwise_core::reward::{self, RewardConfig, RewardInput, TurnText, two_turn};

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let response = parts.next().unwrap_or("");
    let golds: Vec<String> = parts.map(str::to_owned).collect();

    // Grammars.
    for format in Format::ALL {
        let parsed = grammar::parse_turn(format, response);
        let _ = parsed.verdict.is_valid();
    }
    let _ = search_r1::validate_sequence(response);
    let _ = search_r1::extract_answer(response, search_r1::AnswerRule::LastMatch);
    let _ = search_r1::extract_answer(response, search_r1::AnswerRule::LastOfAtLeastTwo);
    let _ = search_r1::information_blocks(response);
    let _ = search_r1::truncate_at_stop(response);
    let _ = boxed::validate_format(response);
    let _ = boxed::extract_answer(response);
    let _ = boxed::extract_search_query(response);
    let _ = mt_ppo::final_turn_format(response);
    let _ = mt_ppo::intermediate_turn_format(response);
    let _ = t2po::v_strict(response, t2po::TargetScript::English);
    let _ = t2po::relaxed_action(response);
    let _ = t2po::project_search_action(response);

    // Rewards.
    let pieces: Vec<&str> = response.split("\n\n").collect();
    let turns: Vec<TurnText<'_>> = pieces
        .chunks(2)
        .map(|c| TurnText {
            generated: c[0],
            observation: c.get(1).copied(),
        })
        .collect();
    for name in RewardConfig::NAMES {
        let cfg = RewardConfig::from_name(name).expect("known name");
        let input = RewardInput::from_turns(&turns, &golds);
        let _ = cfg.score(&input);
    }
    let _ = reward::normalize_answer(response);
    let _ = reward::squad_f1(response, &golds);
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
});

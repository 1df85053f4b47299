//! Rewards read only what the agent wrote, end to end: the world's demonstrations in each agent
//! format earn the full reward of the rewards presets use for that format (also after the
//! tokenizer's encode/decode round trip a trained model's text goes through), and a model
//! that writes garbage gets no answer and no format credit from the environment's notices.

use turnwise::config::{AgentFormatName, TaskConfig, TokenizerKind, TrainConfig};
use turnwise::task::{Demonstration, TaskSet};
use turnwise::trainer::{Trainer, reward_turns};
use turnwise_core::grammar::search_r1::INVALID_ACTION_FEEDBACK;
use turnwise_core::grammar::{Format, scan};
use turnwise_core::reward::{AnswerMetricConfig, RewardConfig, RewardInput, TurnText};
use turnwise_env::env::Environment;
use turnwise_env::world::{QuestionConfig, Split, WorldConfig};

mod common;
use common::tiny_overrides;

fn task(format: AgentFormatName) -> TaskSet {
    TaskSet::build(&TaskConfig {
        world: WorldConfig {
            countries: 4,
            cities: 10,
            companies: 8,
            persons: 24,
            questions: QuestionConfig {
                train: 60,
                validation: 8,
                test: 8,
                ..QuestionConfig::default()
            },
            ..WorldConfig::default()
        },
        format,
        ..TaskConfig::default()
    })
    .unwrap()
}

/// A demonstration's response as turns: each agent segment with the environment segment
/// after it.
fn demo_turns(demo: &Demonstration) -> Vec<(String, Option<String>)> {
    let mut turns: Vec<(String, Option<String>)> = Vec::new();
    for (text, agent) in &demo.segments {
        if *agent {
            turns.push((text.clone(), None));
        } else {
            let last = turns
                .last_mut()
                .expect("a demonstration starts with the agent");
            last.1.get_or_insert_with(String::new).push_str(text);
        }
    }
    turns
}

fn views(turns: &[(String, Option<String>)]) -> Vec<TurnText<'_>> {
    turns
        .iter()
        .map(|(g, o)| TurnText {
            generated: g,
            observation: o.as_deref(),
        })
        .collect()
}

/// Each format's demonstrations score what the environment says they earn (EM of the
/// oracle's answer) under the rewards of that format, with every format rule passed, as
/// written and after the word-level tokenizer's round trip. For `boxed` this is what makes
/// `boxed_em` usable by the presets.
#[test]
fn demonstrations_earn_full_reward_in_their_format() {
    let em_boxed = RewardConfig::Em(AnswerMetricConfig {
        format: Format::Boxed,
        ..Default::default()
    });
    let cases: Vec<(AgentFormatName, Vec<RewardConfig>)> = vec![
        (
            AgentFormatName::SearchR1,
            [
                "em",
                "f1",
                "sub_em",
                "search_r1_em",
                "search_r1_format",
                "igpo_f1",
                "mt_ppo_turn",
            ]
            .iter()
            .map(|n| RewardConfig::from_name(n).unwrap())
            .collect(),
        ),
        (
            AgentFormatName::Boxed,
            vec![RewardConfig::from_name("boxed_em").unwrap(), em_boxed],
        ),
        (
            AgentFormatName::T2po,
            ["t2po_em", "em"]
                .iter()
                .map(|n| RewardConfig::from_name(n).unwrap())
                .collect(),
        ),
    ];
    for (format, rewards) in cases {
        let task = task(format);
        let demos = task.demonstrations(Split::Train, 0.0, 0).unwrap();
        let questions = task.questions(Split::Train);
        assert_eq!(demos.len(), questions.len());
        let tok = task
            .train_tokenizer(TokenizerKind::WordLevel, 4000, &demos)
            .unwrap();
        let mut correct = 0usize;
        for (demo, q) in demos.iter().zip(&questions) {
            // What the environment pays for this transcript.
            let mut env = task.env().unwrap();
            env.reset(&TaskSet::env_task(q)).unwrap();
            let turns = demo_turns(demo);
            let mut env_reward = 0.0;
            for (text, obs) in &turns {
                let step = env.step(text).unwrap();
                env_reward += step.reward;
                assert_eq!(
                    step.observation.text.is_empty(),
                    obs.is_none(),
                    "{format:?} {}: the environment answers as the demonstration shows",
                    q.id
                );
            }
            correct += usize::from(env_reward == 1.0);
            // The agent text a model that learned the demonstration writes: its tokens decoded.
            let decoded: Vec<(String, Option<String>)> = turns
                .iter()
                .map(|(g, o)| {
                    let ids = tok.encode(g).unwrap();
                    (tok.decode(&ids, false).unwrap(), o.clone())
                })
                .collect();
            for reward in &rewards {
                for (what, t) in [("written", &turns), ("decoded", &decoded)] {
                    let v = views(t);
                    let out = reward
                        .score(&RewardInput::from_turns(&v, &q.golden_answers))
                        .unwrap();
                    assert!(
                        out.format_ok,
                        "{format:?} {} {what} {}: format rejected ({}): {t:?}",
                        reward.name(),
                        q.id,
                        out.reason
                    );
                    assert_eq!(
                        out.em,
                        env_reward,
                        "{format:?} {} {what} {}: {t:?}",
                        reward.name(),
                        q.id
                    );
                    if env_reward == 1.0 && reward.name() != "mt_ppo_turn" {
                        assert_eq!(out.score, 1.0, "{format:?} {} {what}", reward.name());
                    }
                }
            }
        }
        // The oracle fails only where retrieval fails: most demonstrations are correct, so
        // the checks above are about real answers.
        assert!(
            correct * 10 >= demos.len() * 8,
            "{format:?}: {correct}/{} correct",
            demos.len()
        );
    }
}

/// A policy that never warm-started writes garbage: no answer block of its own, so no answer
/// and no format credit, although its rollouts are full of the invalid-action notice (which
/// spells `<answer> and </answer>`).
#[test]
fn garbage_policy_gets_no_answer_from_notices() {
    for (preset, reward, no_answer) in [("grpo", "f1", 0.0), ("igpo", "igpo_f1", -2.0)] {
        let mut sets = tiny_overrides();
        sets.extend([
            "sft.steps=0".to_string(),
            "task.format=\"search_r1\"".to_string(),
            format!("reward.name=\"{reward}\""),
            "rollout.prompts_per_step=4".to_string(),
            "rollout.group_size=4".to_string(),
        ]);
        let cfg = TrainConfig::resolve(Some(preset), None, &sets).unwrap();
        let mut t = Trainer::new(cfg).unwrap();
        t.freeze_reference().unwrap();
        let out = t.rl_step().unwrap();
        let eps = &out.episodes;
        let with_notice = eps
            .iter()
            .filter(|e| {
                e.turn_texts
                    .iter()
                    .any(|(_, o)| o.as_deref() == Some(INVALID_ACTION_FEEDBACK))
            })
            .count();
        assert!(
            with_notice > eps.len() / 2,
            "{preset}: {with_notice}/{}",
            eps.len()
        );
        let answered = |e: &turnwise::rollout::Episode| {
            e.turn_texts
                .iter()
                .any(|(g, _)| scan::first_block(g, "<answer>", "</answer>").is_some())
        };
        let own = eps.iter().filter(|e| answered(e)).count();
        let format_ok = out.metrics["train/format_ok"];
        assert_eq!(format_ok, own as f64 / eps.len() as f64, "{preset}");
        assert!(format_ok < 0.5, "{preset}: train/format_ok {format_ok}");
        for e in eps.iter().filter(|e| !answered(e)) {
            assert_eq!(
                e.trajectory.outcome_reward,
                Some(no_answer),
                "{preset} {}: {:?}",
                e.trajectory.id,
                e.turn_texts
            );
            let turns = reward_turns(e);
            let input = RewardInput::from_turns(&turns, &[]);
            assert_eq!(input.answer(Format::SearchR1, Default::default()), None);
        }
    }
}

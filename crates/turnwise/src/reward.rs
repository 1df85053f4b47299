//! The reward stage: an episode's score, between the rollout that produced it and the advantage
//! that reads it. A game's (and an OpenEnv server's) episode is scored by the environment's
//! return ([`game_reward`]); every other task's by its `reward` config over the agent's turns.
//! The LLM judge's turn rewards are in `trainer/judge.rs`.
//!
//! `TaskSet::score_episode` is defined here, not in `task/`, so that the task stage does not
//! import the rollout's types (the pipeline reads task → rollout → reward).

use anyhow::{Context, Result};
use turnwise_core::reward::{RewardConfig, RewardInput, RewardOutput};

use crate::rollout::{Episode, reward_turns};
use crate::task::TaskSet;

impl TaskSet {
    /// The episode reward of `ep` under `reward`: for a game the environment's return
    /// ([`game_reward`]), else `reward` scoring the agent's turns against
    /// `golds`.
    pub fn score_episode(
        &self,
        reward: &RewardConfig,
        ep: &Episode,
        golds: &[String],
    ) -> Result<RewardOutput> {
        if self.scored_by_return() {
            return Ok(game_reward(ep));
        }
        let turns = reward_turns(ep);
        reward
            .score(&RewardInput::from_turns(&turns, golds))
            .with_context(|| format!("scoring {}", ep.trajectory.id))
    }
}

/// The reward of a game episode, whatever `reward.name` says (configs refuse `t2po_em`, which
/// scores search actions): the environment's return (GiGPO's episode reward, the sum of its
/// step rewards: 1 when the game is won), success as `em`, and the format verdict of every
/// turn. GiGPO and T2PO read the step rewards from the turns' environment rewards, with
/// `advantage.invalid_action_penalty` on every move the game could not parse (spec §10).
pub fn game_reward(ep: &Episode) -> RewardOutput {
    let turns = &ep.trajectory.turns;
    let bad = turns.iter().filter(|t| !t.format_ok).count();
    RewardOutput {
        score: ep.env_return,
        turn_rewards: Vec::new(),
        em: f64::from(u8::from(ep.won)),
        format_ok: bad == 0 && !turns.is_empty(),
        parts: Vec::new(),
        reason: match (bad, turns.is_empty()) {
            (_, true) => "no turn".to_owned(),
            (0, false) => String::new(),
            (n, false) => {
                format!("{n} turn(s) failed the <think>…</think><action>…</action> format")
            }
        },
    }
}

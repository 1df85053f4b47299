//! What an estimator reads, implies and reports: its contract with the trainer.
//!
//! The registry ([`super::AdvantageConfig`]) answers "compute this"; the methods of
//! [`super::Estimator`] that return the types below answer everything else the trainer, the
//! config validator and the report need to know about an estimator. They read these
//! declarations and never test an estimator's name (tantivy's `Query::query_terms` pattern:
//! the searcher prepares what a query declares).

use std::collections::BTreeMap;

use super::kernels::mean;
use super::{AdvantageBatch, AdvantageOutput, Rollout, role_group};

/// The inputs an estimator reads beyond the prompt groups, turn ids and outcomes of its
/// rollouts. The trainer prepares them and the config validator requires their sources.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Needs {
    /// Critic values per response token ([`Rollout::values`]): GAE. The config requires
    /// `critic.enabled`.
    pub critic_values: bool,
    /// Information gain per process turn ([`Rollout::info_gain`]): IGPO, A2TGPO. The config
    /// requires `rollout.info_gain`.
    pub info_gain: bool,
    /// Rollout trees ([`AdvantageBatch::trees`], [`Rollout::tree`]): AT2PO, Tree-GRPO. The
    /// config requires a tree rollout strategy.
    pub trees: bool,
    /// Per-turn rewards ([`Rollout::turn_rewards`]): MT-GRPO in both forms. (GAE reads them
    /// when the reward gives them, MT-PPO.)
    pub turn_rewards: bool,
    /// Step rewards and the anchor state of every step ([`Rollout::step_rewards`],
    /// [`Rollout::anchors`]): GiGPO, T2PO.
    pub step_rewards: bool,
    /// The final reward `R^F` through the outcome only, when it also reads per-turn rewards
    /// (GAE with MT-PPO's rewards, eq. 10): the reward's last turn entry is `R^F` itself, and
    /// the trainer takes it out of the turn rewards so that it is counted once.
    pub final_reward_in_outcome: bool,
}

/// Where KL in the reward (spec §5.8) is subtracted for an estimator that supports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlPlacement {
    /// From the per-token rewards, at each token (GAE: the turn rewards and the outcome placed
    /// at their tokens, or the explicit token rewards).
    TokenRewards,
    /// From the outcome, as the sum over the rollout's tokens (verl's GRPO scores the sum of
    /// the token-level rewards).
    Outcome,
}

/// What makes a prompt group informative for DAPO's zero-variance filter (spec §6.4) when its
/// rollouts' filter values (by default their accuracies) are tied. Any estimator's group is
/// also informative when one of its rollouts has a non-zero information gain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupSignal {
    /// Nothing else: a group of tied values carries no signal.
    Outcome,
    /// Per-turn rewards that differ between the group's rollouts.
    TurnRewards,
    /// Step rewards that differ between the group's rollouts.
    StepRewards,
    /// Every group is informative (GAE: the critic's values give tied rollouts non-zero
    /// advantages, and the critic needs their returns).
    EveryGroup,
}

/// How a step-sample estimator (GiGPO, T2PO) scores and groups the steps of its rollouts: what
/// the trainer reads to place step rewards and penalties, and the trajectory viewer to show the
/// anchor groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepSamples {
    /// verl-agent's invalid-action penalty: taken off the step reward and the episode score of
    /// every step whose action was invalid (GiGPO's 0.1, spec §10), when the reward does not
    /// place its own per-step penalties.
    pub invalid_action_penalty: f64,
    /// Anchor states are grouped by similarity at this threshold (`None`: identical anchors).
    pub similarity: Option<f64>,
    /// The episode term normalises over the step samples' scores ([`Rollout::step_scores`],
    /// by default the episode's summed step rewards), not over the rollouts' outcomes.
    pub pooled_step_scores: bool,
}

/// One metric an estimator logs to show its defining mechanism at work, with its label in the
/// run report's "Mechanism at work" table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricDoc {
    /// The key in `metrics.jsonl` (e.g. `a2tgpo/clip_scale/max`).
    pub key: &'static str,
    /// The report's row label.
    pub label: &'static str,
}

/// Metrics of an estimator, by key.
pub type Metrics = BTreeMap<String, f64>;

/// Size statistics of the groups formed by `keys`: `{prefix}/groups`,
/// `{prefix}/group_size/mean` and `{prefix}/singleton_share` (the share of members alone in
/// their group, with no peer to be compared with: the estimator's singleton rule gives such a
/// member a term of 0 (A2TGPO's turn groups, GiGPO's anchor groups) or its raw score (VERL's
/// GRPO rule, used by MT-GRPO's turn groups), never a comparison).
pub(crate) fn group_stats<K: Ord>(prefix: &str, keys: impl Iterator<Item = K>) -> Metrics {
    let mut sizes: BTreeMap<K, usize> = BTreeMap::new();
    for k in keys {
        *sizes.entry(k).or_default() += 1;
    }
    let mut m = Metrics::new();
    if sizes.is_empty() {
        return m;
    }
    let members: usize = sizes.values().sum();
    let singletons = sizes.values().filter(|&&n| n == 1).count();
    m.insert(format!("{prefix}/groups"), sizes.len() as f64);
    m.insert(
        format!("{prefix}/group_size/mean"),
        members as f64 / sizes.len() as f64,
    );
    m.insert(
        format!("{prefix}/singleton_share"),
        singletons as f64 / members as f64,
    );
    m
}

/// The report rows of [`info_gain_per_turn`].
pub(crate) const INFO_GAIN_DOCS: [MetricDoc; 2] = [
    MetricDoc {
        key: "info_gain/turn_0/mean",
        label: "IG of turn 0",
    },
    MetricDoc {
        key: "info_gain/turn_1/mean",
        label: "IG of turn 1",
    },
];

/// `info_gain/turn_{t}/mean` for the first four process turns: the batch mean of the
/// information gain of turn `t` over the rollouts that have it (IGPO, A2TGPO).
pub(crate) fn info_gain_per_turn(rs: &[Rollout]) -> Metrics {
    let mut m = Metrics::new();
    let max_t = rs.iter().map(|r| r.info_gain.len()).max().unwrap_or(0);
    for t in 0..max_t.min(4) {
        let v: Vec<f64> = rs
            .iter()
            .filter_map(|r| r.info_gain.get(t).copied())
            .collect();
        m.insert(format!("info_gain/turn_{t}/mean"), mean(&v));
    }
    m
}

/// MT-GRPO's turn groups (one per prompt group and turn role, [`role_group`]).
pub(crate) fn mt_grpo_metrics(batch: &AdvantageBatch) -> Metrics {
    group_stats(
        "mt_grpo/turn_group",
        batch
            .rollouts
            .iter()
            .flat_map(|r| (0..r.num_turns).map(move |k| role_group(r.group, k, r.num_turns))),
    )
}

/// The two-turn code's turn term: the first turn's advantage minus the answer turn's
/// (`c·A_turn`) on episodes with a tool result (the others get the combined reward), and the
/// share of episodes without one.
pub(crate) fn mt_grpo_code_metrics(batch: &AdvantageBatch, out: &AdvantageOutput) -> Metrics {
    let rs = &batch.rollouts;
    let mut m = Metrics::new();
    let credit: Vec<f64> = rs
        .iter()
        .zip(&out.rollouts)
        .filter(|(r, _)| r.num_turns >= 2)
        .map(|(_, o)| (o.turns[0] - o.turns[1]).abs())
        .collect();
    m.insert("mt_grpo/turn_credit/abs_mean".into(), mean(&credit));
    let single = rs.iter().filter(|r| r.num_turns < 2).count();
    m.insert(
        "mt_grpo/no_tool_result_share".into(),
        single as f64 / rs.len().max(1) as f64,
    );
    m
}

/// GiGPO's anchor groups (exact anchors within their scopes, [`Rollout::anchor_scopes`]):
/// `gigpo/anchor_group/groups` and `…/group_size/mean` over every step sample, and
/// `…/singleton_share`, the share of the step samples after the first step that are alone in
/// their anchor group (a step-0 sample is never counted: its anchor, the prompt or the starting
/// board, is shared by the whole prompt group). It is 1 when no later state repeats, and the
/// step term is then 0 for every later step.
pub(crate) fn anchor_group_metrics(batch: &AdvantageBatch) -> Metrics {
    fn key(r: &Rollout, k: usize) -> (usize, &str, &str) {
        let scope = r.anchor_scopes.get(k).map_or("", String::as_str);
        (r.group, scope, r.anchors[k].as_str())
    }
    let rs = &batch.rollouts;
    let mut sizes: BTreeMap<(usize, &str, &str), usize> = BTreeMap::new();
    for r in rs {
        for k in 0..r.anchors.len() {
            *sizes.entry(key(r, k)).or_default() += 1;
        }
    }
    let mut m = Metrics::new();
    if sizes.is_empty() {
        return m;
    }
    let members: usize = sizes.values().sum();
    m.insert("gigpo/anchor_group/groups".into(), sizes.len() as f64);
    m.insert(
        "gigpo/anchor_group/group_size/mean".into(),
        members as f64 / sizes.len() as f64,
    );
    let later: Vec<usize> = rs
        .iter()
        .flat_map(|r| (1..r.anchors.len()).map(|k| sizes[&key(r, k)]))
        .collect();
    if !later.is_empty() {
        let alone = later.iter().filter(|&&n| n == 1).count();
        m.insert(
            "gigpo/anchor_group/singleton_share".into(),
            alone as f64 / later.len() as f64,
        );
    }
    m
}

/// MT-PPO's turn rewards as GAE placed them: the number of non-zero per-turn rewards.
pub(crate) fn gae_metrics(batch: &AdvantageBatch) -> Metrics {
    let placed = batch
        .rollouts
        .iter()
        .flat_map(|r| r.turn_rewards.iter().copied())
        .filter(|x| *x != 0.0)
        .count();
    Metrics::from([("mt_ppo/turn_rewards_placed".to_string(), placed as f64)])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::{AdvantageConfig, Channel, ESTIMATORS, Estimator};

    /// Every key an estimator logs on a batch that exercises it is documented with a report
    /// label (so the report can show it), and every documented key is one it can log.
    #[test]
    fn documented_metrics_are_the_logged_ones() {
        for (name, _) in ESTIMATORS {
            let cfg = AdvantageConfig::default_for(name).unwrap();
            for doc in cfg.metric_docs() {
                assert!(!doc.label.is_empty(), "{name}: {}", doc.key);
                assert!(doc.key.contains('/'), "{name}: {}", doc.key);
            }
        }
        let r =
            |g: usize, ig: Vec<f64>| Rollout::new(g, vec![0, -1, 1, -1, 2], 1.0).with_info_gain(ig);
        let batch = AdvantageBatch::new(vec![r(0, vec![0.2, 0.1]), r(0, vec![0.0, 0.3])]);
        let cfg = AdvantageConfig::default_for("a2tgpo").unwrap();
        let out = cfg.estimate(&batch).unwrap();
        let m = cfg.metrics(&batch, &out);
        for doc in cfg.metric_docs() {
            assert!(m.contains_key(doc.key), "a2tgpo logs {}: {m:?}", doc.key);
        }
        assert!((m["info_gain/turn_1/mean"] - 0.2).abs() < 1e-12, "{m:?}");
        assert_eq!(m["a2tgpo/turn_group/group_size/mean"], 2.0);
    }

    /// The declarations the trainer and the config read, per estimator (the table the trainer
    /// used to hold as matches on names).
    #[test]
    fn declarations() {
        let get = |n: &str| AdvantageConfig::default_for(n).unwrap();
        assert!(get("gae").needs().critic_values);
        assert_eq!(get("gae").group_signal(), GroupSignal::EveryGroup);
        assert!(get("gae").needs().final_reward_in_outcome);
        let in_outcome: Vec<&str> = ESTIMATORS
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| get(n).needs().final_reward_in_outcome)
            .collect();
        assert_eq!(in_outcome, ["gae"]);
        for n in ["igpo", "a2tgpo"] {
            assert!(get(n).needs().info_gain, "{n}");
        }
        for n in ["at2po", "tree_grpo"] {
            assert!(get(n).needs().trees && !get(n).filterable(), "{n}");
        }
        for n in ["mt_grpo", "mt_grpo_code"] {
            assert_eq!(get(n).group_signal(), GroupSignal::TurnRewards, "{n}");
        }
        for n in ["gigpo", "t2po"] {
            assert_eq!(get(n).group_signal(), GroupSignal::StepRewards, "{n}");
            assert!(get(n).step_samples().is_some(), "{n}");
        }
        assert_eq!(get("gigpo").step_samples().unwrap().similarity, None);
        assert_eq!(get("t2po").step_samples().unwrap().similarity, Some(0.9));
        let kl: Vec<&str> = ESTIMATORS
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| get(n).kl_placement().is_some())
            .collect();
        assert_eq!(kl, ["grpo", "dr_grpo", "rloo", "gae"]);
        assert_eq!(get("gae").kl_placement(), Some(KlPlacement::TokenRewards));
        let emitting: Vec<&str> = ESTIMATORS
            .iter()
            .map(|(n, _)| *n)
            .filter(|n| !get(n).emits().is_empty())
            .collect();
        assert_eq!(emitting, ["a2tgpo", "gigpo", "t2po"]);
        assert_eq!(
            get("gigpo").emits(),
            [Channel::StepGroup, Channel::StepGroupSize]
        );
        assert_eq!(
            get("a2tgpo").emits(),
            [Channel::NormalizedInfoGain, Channel::ClipScale]
        );
        assert_eq!(get("grpo").needs(), Needs::default());
        assert_eq!(get("grpo").group_signal(), GroupSignal::Outcome);
    }
}

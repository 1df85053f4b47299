//! Episodes → the core's [`AdvantageBatch`] → per-token training rows.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use turnwise_core::advantage::{
    AdvantageBatch, Channels, Estimator, GroupSignal, KlPlacement, Rollout, broadcast_turns,
    place_turn_rewards,
};
use turnwise_core::control::filter_groups;
use turnwise_core::metric_keys as mk;
use turnwise_model::loss::policy::PolicyLossKind;
use turnwise_model::loss::{KlEstimator, apply_kl_in_reward};

use super::sampling::ScoredEpisode;
use crate::config::TrainConfig;
use crate::rollout::Episode;
use crate::rollout::tree::TreeBatch;
use crate::update::Row;

/// Training rows and advantage metrics of a batch.
pub struct AdvantageRows {
    /// One row per episode, in the episodes' order (DAPO's group filter ran before, in
    /// `Trainer::sample_batch`: every episode given is trained on).
    pub rows: Vec<Row>,
    /// `critic/advantages/*` and friends.
    pub metrics: BTreeMap<String, f64>,
    /// With KL in the reward: the batch mean of the per-rollout masked-mean KL (verl
    /// `actor/reward_kl_penalty`, the adaptive controller's input).
    pub reward_kl: Option<f64>,
    /// What the estimator computed for each episode, in row order (for the step's samples).
    pub details: Vec<EpisodeAdvantage>,
}

/// What the estimator computed for one episode, beside its per-token advantages: what the
/// trajectory viewer shows (`samples/step-N.jsonl`).
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeAdvantage {
    /// Per agent turn: the turn's advantage (for the estimators whose advantage varies within
    /// a turn, GAE and IGPO's code form, the one at its first token).
    pub turns: Vec<f64>,
    /// The channels the estimator emitted for the episode ([`Channel`]: e.g. A2TGPO's clip
    /// scale per agent turn and normalised information gain per process turn).
    pub channels: Channels,
    /// The score the estimator read (the episode's outcome, after KL in the reward).
    pub score: f64,
    /// The prompt group's id in the step.
    pub group: usize,
    /// Rollouts of the group in the trained batch.
    pub group_size: usize,
    /// Mean of the scores the estimator normalised in the group: the rollouts' scores, or, for
    /// GiGPO's episode term over step samples (`cross_steps`, its default), the step samples'.
    pub group_mean: f64,
    /// Sample (unbiased) standard deviation of the same scores; 0 for one score.
    pub group_std: f64,
}

/// Count, mean and sample (unbiased) standard deviation of `values` (std 0 below two values).
pub fn mean_std(values: &[f64]) -> (usize, f64, f64) {
    let n = values.len();
    if n == 0 {
        return (0, 0.0, 0.0);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let std = match n {
        1 => 0.0,
        _ => (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt(),
    };
    (n, mean, std)
}

/// KL in the reward (spec §5.8, verl `apply_kl_penalty`): per episode, the behaviour and
/// reference log-probs of its response tokens (the row's tokens), and β.
pub struct KlInReward<'a> {
    /// Behaviour log-probs (the rollout weights), one row per episode.
    pub old_logp: &'a [Vec<f32>],
    /// Reference-model log-probs, one row per episode.
    pub ref_logp: &'a [Vec<f32>],
    /// The coefficient β of this step.
    pub beta: f64,
    /// The per-token KL estimator.
    pub estimator: KlEstimator,
}

/// DAPO's group filter (spec §6.4): the prompt groups that carry a learning signal.
///
/// Each episode's value of `rollout.filter_metric` is what the filter compares
/// ([`ScoredEpisode::filter_value`]: by default its accuracy, as verl's DAPO recipe, so that an
/// all-wrong group whose overlong penalties differ is not informative). A group is informative
/// when its values differ (population std > 0) or it holds a single rollout (DAPO keeps those,
/// `turnwise_core::control::filter_groups`); or, whatever the values, when any of its rollouts
/// has a non-zero information gain (IGPO/A2TGPO turn signal); or as the estimator's
/// [`GroupSignal`] declares: when its per-turn rewards differ between the group's rollouts
/// (MT-GRPO), when its step rewards differ (GiGPO, T2PO: the environment's, or the reward's own
/// when it [gives step rewards](turnwise_core::reward::RewardConfig::gives_step_rewards)), or
/// always (GAE: the critic's values give tied rollouts non-zero advantages, and the critic
/// needs their returns). Returns the informative group ids.
pub fn informative_groups(cfg: &TrainConfig, episodes: &[ScoredEpisode]) -> BTreeSet<usize> {
    let groups: Vec<usize> = episodes.iter().map(|e| e.group).collect();
    let group_signal = cfg.advantage.group_signal();
    if group_signal == GroupSignal::EveryGroup {
        return groups.into_iter().collect();
    }
    let metric = cfg.rollout.filter_metric;
    let values: Vec<f64> = episodes.iter().map(|e| e.filter_value(metric)).collect();
    let mut keep: BTreeSet<usize> = match filter_groups(&groups, &values) {
        Ok(f) => f.kept_uids.into_iter().collect(),
        // Lengths always match here (one value per episode).
        Err(_) => groups.iter().copied().collect(),
    };
    let reward_steps = cfg.reward.gives_step_rewards();
    let signal = |e: &ScoredEpisode| -> Vec<f64> {
        match group_signal {
            GroupSignal::TurnRewards => e.turn_rewards.clone(),
            GroupSignal::StepRewards if reward_steps => e.turn_rewards.clone(),
            GroupSignal::StepRewards => e
                .episode
                .trajectory
                .turns
                .iter()
                .map(|t| t.env_reward.unwrap_or(0.0))
                .collect(),
            GroupSignal::Outcome | GroupSignal::EveryGroup => Vec::new(),
        }
    };
    let mut by_group: BTreeMap<usize, Vec<&ScoredEpisode>> = BTreeMap::new();
    for e in episodes {
        by_group.entry(e.group).or_default().push(e);
    }
    for (g, members) in by_group {
        if keep.contains(&g) {
            continue;
        }
        let ig_signal = members.iter().any(|e| {
            e.info_gain
                .as_ref()
                .is_some_and(|ig| ig.iter().any(|x| x.abs() > 1e-9))
        });
        let first = signal(members[0]);
        let differs = members[1..].iter().any(|e| {
            let v = signal(e);
            (0..v.len().max(first.len())).any(|k| {
                let a = first.get(k).copied().unwrap_or(0.0);
                let b = v.get(k).copied().unwrap_or(0.0);
                (a - b).abs() > 1e-12
            })
        });
        if ig_signal || differs {
            keep.insert(g);
        }
    }
    keep
}

/// The estimator input of one episode.
pub fn rollout_of(
    ep: &Episode,
    group: usize,
    score: f64,
    turn_rewards: &[f64],
    info_gain: Option<&[f64]>,
) -> Rollout {
    let flat = ep.trajectory.flatten(true);
    let num_turns = ep.trajectory.num_turns();
    let mut r = Rollout::new(group, flat.turn_id, score);
    r.num_turns = r.num_turns.max(num_turns);
    if !turn_rewards.is_empty() {
        let mut tr = turn_rewards.to_vec();
        tr.resize(r.num_turns, 0.0);
        r.turn_rewards = tr;
    }
    // As given, never padded: a gain list that is not one per process turn is an error of the
    // estimator's length guard (and of `compute`'s check), not a gain of 0.
    if let Some(ig) = info_gain {
        r.info_gain = ig.to_vec();
    }
    let step_rewards: Vec<f64> = ep
        .trajectory
        .turns
        .iter()
        .map(|t| t.env_reward.unwrap_or(0.0))
        .collect();
    let anchors: Vec<String> = ep
        .trajectory
        .turns
        .iter()
        .enumerate()
        .map(|(i, t)| {
            // The state a step acts in, as the rollout recorded it: the observation before it,
            // for step 0 the environment's first one (a game's starting board, which later
            // steps may return to). A first step whose state is the question itself (the
            // search world) is anchored by the prompt.
            match &t.anchor {
                Some(a) => a.clone(),
                None if i == 0 => format!("prompt:{}", ep.trajectory.prompt_uid),
                None => t.index.to_string(),
            }
        })
        .collect();
    let mut step_rewards = step_rewards;
    step_rewards.resize(r.num_turns, 0.0);
    let mut anchors = anchors;
    anchors.resize(r.num_turns, String::new());
    r.with_steps(step_rewards, anchors)
}

/// GiGPO's anchor scope of every step of an episode (spec §3.7, [`Rollout::anchor_scopes`]),
/// from its `anchors` ([`rollout_of`]'s: the observation each step acted on). Two steps share an
/// anchor group only when their scopes are equal (and their anchors equal, or similar with
/// `enable_similarity`).
///
/// - A game (`task.env = "frozen_lake" | "sokoban"`): one scope (none is returned). The board is
///   the whole state (the moves and rewards depend on it alone), so a board seen again at
///   another step is the same state, and GiGPO's anchor groups gather every occurrence of a
///   state "from different trajectories and time steps" (T2PO §4.4 on GiGPO; verl-agent anchors
///   Sokoban by its board alone).
/// - The search world (and any other task): the last observation is not the state. The agent
///   acts on everything retrieved so far, and the same text (the constant invalid-action
///   feedback, the tool-limit notice, the same passages) comes back at other depths after other
///   histories. Step `k`'s scope is its depth and a hash of the observations before its own
///   (`anchors[1..k]`; step 0's anchor is the prompt): two steps share a group only at the same
///   depth after the same observations, with the last one compared as the anchor (exactly, or
///   by similarity as verl-agent's search scripts do). The agent's own text is its action, not
///   the state, and is left out, as a game's reasoning is.
pub fn anchor_scopes(cfg: &TrainConfig, anchors: &[String]) -> Vec<String> {
    use std::hash::{Hash, Hasher};
    if matches!(
        cfg.task.env,
        crate::config::TaskEnv::FrozenLake | crate::config::TaskEnv::Sokoban
    ) {
        return Vec::new();
    }
    (0..anchors.len())
        .map(|k| {
            let earlier = anchors.get(1..k).unwrap_or_default();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            earlier.hash(&mut h);
            format!("step {k} after {:016x}", h.finish())
        })
        .collect()
}

/// Places the reward where the estimator of `cfg` reads it (spec §2.4, §2.6, §3.3, §3.7), so
/// that every reward is counted once and every penalty lands on its own step:
///
/// - An estimator that
///   [takes the final reward from the outcome](turnwise_core::advantage::Needs::final_reward_in_outcome)
///   (GAE) with turn rewards (MT-PPO, eq. 10): `R^I_k` at the end of every process turn and
///   `R^F` once, at the last agent token. The reward's last turn entry is `R^F` itself (it must
///   equal the outcome; an error otherwise), so it is taken out of `turn_rewards` and placed
///   through the outcome only.
/// - An estimator over [step samples](Estimator::step_samples) (GiGPO, T2PO) with a reward
///   that places its own [step penalties](turnwise_core::reward::RewardConfig::step_penalties)
///   (`t2po_em`): the step rewards are the reward's per-step values (EM minus the format
///   penalty of each step). With the per-invalid-step placement the penalty is verl-agent's
///   invalid-action penalty, applied after discounting (spec §3.7): the step rewards are the
///   unpenalised ones, step `k`'s penalty is taken off its own discounted return only
///   ([`Rollout::step_penalties`](turnwise_core::advantage::Rollout)), and the episode score of
///   step sample `k` is the episode's EM minus step `k`'s own penalty; no earlier step's return
///   or score loses anything. With the final-reward placement (the paper's) the penalty is
///   part of the reward and is discounted like it.
/// - An estimator over step samples with another reward: the environment's step rewards, with
///   the estimator's `invalid_action_penalty` taken, after discounting, off the return and the
///   episode score of every step whose action was invalid, that step's only (GiGPO's −0.1,
///   spec §10).
///
/// Returns the number of steps whose sample was penalised (logged as
/// `gigpo/penalised_steps`).
pub fn place_rewards(cfg: &TrainConfig, ep: &Episode, r: &mut Rollout) -> Result<usize> {
    let mut penalised = 0;
    let id = &ep.trajectory.id;
    if cfg.advantage.needs().final_reward_in_outcome && !r.turn_rewards.is_empty() {
        let last = r.turn_rewards.len() - 1;
        let final_reward = r.turn_rewards[last];
        if (final_reward - r.outcome).abs() > 1e-9 {
            bail!(
                "{id}: the reward's last turn reward {final_reward} is not its final reward \
                 {}; GAE would count the final reward twice or lose it",
                r.outcome
            );
        }
        r.turn_rewards[last] = 0.0;
    }
    if let Some(samples) = cfg.advantage.step_samples() {
        let n = r.num_turns;
        let steps: Vec<&str> = ep.turn_texts.iter().map(|(g, _)| g.as_str()).collect();
        if let Some(own) = cfg.reward.step_penalties(&steps) {
            let mut step_rewards = r.turn_rewards.clone();
            step_rewards.resize(n, 0.0);
            let mut pen = own.penalties;
            pen.resize(n, 0.0);
            penalised = pen.iter().filter(|&&p| p > 0.0).count();
            if own.own_step_only {
                // verl-agent: returns from the unpenalised rewards, then each penalty off its own
                // step's return and episode score.
                for (s, p) in step_rewards.iter_mut().zip(&pen) {
                    *s += p;
                }
                let raw: f64 = step_rewards.iter().sum();
                r.step_scores = Some(pen.iter().map(|p| raw - p).collect());
                r.step_penalties = pen;
            }
            r.step_rewards = step_rewards;
        } else {
            let p = samples.invalid_action_penalty;
            if !(p >= 0.0 && p.is_finite()) {
                bail!("advantage.invalid_action_penalty must be ≥ 0, got {p}");
            }
            if p > 0.0 {
                let invalid: Vec<bool> = (0..n)
                    .map(|k| {
                        ep.trajectory.turns.get(k).is_some_and(|t| {
                            matches!(
                                t.action,
                                turnwise_core::trajectory::TurnAction::Invalid { .. }
                            )
                        })
                    })
                    .collect();
                let raw: f64 = r.step_rewards.iter().sum();
                penalised = invalid.iter().filter(|&&b| b).count();
                // After discounting, that step's return only (verl-agent).
                r.step_penalties = invalid
                    .iter()
                    .map(|&bad| if bad { p } else { 0.0 })
                    .collect();
                r.step_scores = Some(
                    invalid
                        .iter()
                        .map(|&bad| raw - if bad { p } else { 0.0 })
                        .collect(),
                );
            }
        }
    }
    Ok(penalised)
}

/// Computes the advantages of `episodes` (with the tree bookkeeping of tree rollouts, the
/// critic's values of each episode's response tokens, and KL in the reward, `kl`, spec §5.8,
/// subtracted from the rewards before the estimator) and builds their training rows, one per
/// episode in order.
pub fn compute(
    cfg: &TrainConfig,
    episodes: &[ScoredEpisode],
    trees: Option<&TreeBatch>,
    values: Option<&[Vec<f32>]>,
    kl: Option<&KlInReward<'_>>,
) -> Result<AdvantageRows> {
    let name = cfg.advantage.name();
    if cfg.advantage.needs().critic_values && values.is_none() {
        bail!("the {name} estimator needs critic values: set critic.enabled = true");
    }
    let mut metrics = BTreeMap::new();
    if episodes.is_empty() {
        metrics.insert(mk::critic::ADVANTAGES_MEAN.into(), 0.0);
        return Ok(AdvantageRows {
            rows: Vec::new(),
            metrics,
            reward_kl: None,
            details: Vec::new(),
        });
    }
    check_info_gains(episodes)?;
    let (mut rollouts, penalised) = estimator_rollouts(cfg, episodes, values)?;
    let reward_kl = match kl {
        Some(k) => Some(subtract_reward_kl(cfg, episodes, &mut rollouts, k)?),
        None => None,
    };
    // verl's `critic/rewards/*`: each rollout's reward as the estimator receives it (the sum of
    // its token rewards, KL in the reward included; else its outcome plus its turn rewards).
    let rewards: Vec<f64> = rollouts
        .iter()
        .map(|r| match &r.token_rewards {
            Some(t) => t.iter().sum(),
            None => r.outcome + r.turn_rewards.iter().sum::<f64>(),
        })
        .collect();
    insert_mean_max_min(
        &mut metrics,
        [
            mk::critic::REWARDS_MEAN,
            mk::critic::REWARDS_MAX,
            mk::critic::REWARDS_MIN,
        ],
        &rewards,
    );
    let batch = advantage_batch(rollouts, trees, episodes)?;
    let out = cfg
        .advantage
        .estimate(&batch)
        .with_context(|| format!("estimator {name}"))?;
    let details = episode_details(cfg, &batch, &out);
    let (rows, trained) = training_rows(cfg, episodes, &batch, &out)?;
    insert_mean_max_min(
        &mut metrics,
        [
            mk::critic::ADVANTAGES_MEAN,
            mk::critic::ADVANTAGES_MAX,
            mk::critic::ADVANTAGES_MIN,
        ],
        &trained,
    );
    metrics.extend(cfg.advantage.metrics(&batch, &out));
    if cfg.advantage.step_samples().is_some() {
        metrics.insert(mk::gigpo::PENALISED_STEPS.into(), penalised as f64);
    }
    Ok(AdvantageRows {
        rows,
        metrics,
        reward_kl,
        details,
    })
}

/// The mean, largest and smallest of `values` under `keys` in that order (verl's `critic/*`
/// statistics), nothing when there are none.
fn insert_mean_max_min(metrics: &mut BTreeMap<String, f64>, keys: [&str; 3], values: &[f64]) {
    if values.is_empty() {
        return;
    }
    let n = values.len() as f64;
    metrics.insert(keys[0].into(), values.iter().sum::<f64>() / n);
    metrics.insert(
        keys[1].into(),
        values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    );
    metrics.insert(
        keys[2].into(),
        values.iter().copied().fold(f64::INFINITY, f64::min),
    );
}

/// Information gains come for every episode of a batch or for none, and each episode's have
/// one entry per process turn.
fn check_info_gains(episodes: &[ScoredEpisode]) -> Result<()> {
    if episodes.iter().any(|e| e.info_gain.is_some()) {
        for (index, e) in episodes.iter().enumerate() {
            let gains = e.info_gain.as_deref().with_context(|| {
                format!(
                    "episode {index} ({}) has no information gains while others of its batch do",
                    e.episode.trajectory.id
                )
            })?;
            crate::rollout::info_gain::check_episode_gains(index, &e.episode, gains)?;
        }
    }
    Ok(())
}

/// The estimator's view of each episode ([`rollout_of`], its anchor scopes, its rewards placed
/// by [`place_rewards`] and the critic's `values`), and how many step samples were penalised.
fn estimator_rollouts(
    cfg: &TrainConfig,
    episodes: &[ScoredEpisode],
    values: Option<&[Vec<f32>]>,
) -> Result<(Vec<Rollout>, usize)> {
    let mut penalised = 0usize;
    let rollouts = episodes
        .iter()
        .enumerate()
        .map(|(i, e)| -> Result<Rollout> {
            let mut r = rollout_of(
                &e.episode,
                e.group,
                e.score,
                &e.turn_rewards,
                e.info_gain.as_deref(),
            );
            r.anchor_scopes = anchor_scopes(cfg, &r.anchors);
            penalised += place_rewards(cfg, &e.episode, &mut r)?;
            Ok(match values {
                Some(v) => r.with_values(v[i].iter().map(|&x| f64::from(x)).collect()),
                None => r,
            })
        })
        .collect::<Result<_>>()?;
    Ok((rollouts, penalised))
}

/// The estimator's batch: the rollouts, and with tree rollouts each rollout labelled with its
/// own tree (Tree-GRPO's intra-tree group; AT2PO's tree index) and leaf, the leaves carrying
/// the episode scores (AT2PO's leaf values).
fn advantage_batch(
    mut rollouts: Vec<Rollout>,
    trees: Option<&TreeBatch>,
    episodes: &[ScoredEpisode],
) -> Result<AdvantageBatch> {
    let Some(t) = trees else {
        return Ok(AdvantageBatch::new(rollouts));
    };
    for (r, &(tree, leaf)) in rollouts.iter_mut().zip(&t.leaf_of) {
        r.tree = Some(tree);
        r.leaf = Some(leaf);
    }
    let scores: Vec<f64> = episodes.iter().map(|e| e.score).collect();
    let rewarded = t
        .with_leaf_rewards(&scores)
        .context("writing the episode scores into the tree leaves")?;
    Ok(AdvantageBatch::with_trees(rollouts, rewarded))
}

/// One training row per episode with the estimator's advantages, value targets and the
/// channels the policy loss reads spread over its tokens (the others stay per turn, in the
/// episode details the samples show); and the advantages of every loss token, in order.
fn training_rows(
    cfg: &TrainConfig,
    episodes: &[ScoredEpisode],
    batch: &AdvantageBatch,
    out: &turnwise_core::advantage::AdvantageOutput,
) -> Result<(Vec<Row>, Vec<f64>)> {
    let name = cfg.advantage.name();
    let reads = cfg
        .actor
        .policy
        .policy_loss
        .parse::<PolicyLossKind>()
        .map_or(&[][..], PolicyLossKind::reads);
    let mut rows = Vec::with_capacity(episodes.len());
    let mut trained = Vec::new();
    for ((e, ro), adv) in episodes.iter().zip(&batch.rollouts).zip(&out.rollouts) {
        let trajectory = &e.episode.trajectory;
        let mut row = Row::from_trajectory(trajectory, cfg.rollout.train_on_forced);
        if adv.tokens.len() != row.response.len() {
            bail!(
                "estimator {name} returned {} token advantages for {} tokens of {}",
                adv.tokens.len(),
                row.response.len(),
                trajectory.id
            );
        }
        row.advantages = adv.tokens.iter().map(|&a| a as f32).collect();
        if let Some(ret) = &adv.returns {
            row.returns = ret.iter().map(|&x| x as f32).collect();
        }
        for (&c, per_turn) in adv.channels.iter().filter(|(c, _)| reads.contains(c)) {
            let tokens = broadcast_turns(&ro.turn_id, per_turn, c.fill());
            row.channels
                .insert(c, tokens.into_iter().map(|x| x as f32).collect());
        }
        for (k, &m) in row.loss_mask.iter().enumerate() {
            if m > 0 {
                trained.push(adv.tokens[k]);
            }
        }
        rows.push(row);
    }
    Ok((rows, trained))
}

/// [`EpisodeAdvantage`] of every rollout of `batch`.
fn episode_details(
    cfg: &TrainConfig,
    batch: &AdvantageBatch,
    out: &turnwise_core::advantage::AdvantageOutput,
) -> Vec<EpisodeAdvantage> {
    let rs = &batch.rollouts;
    let samples = cfg.advantage.step_samples();
    // GiGPO's episode term over step samples: the score of step sample k is its
    // `step_scores[k]`, by default the episode's summed step rewards.
    let step_scores = samples.is_some_and(|s| s.pooled_step_scores);
    let mut scores: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut sizes: BTreeMap<usize, usize> = BTreeMap::new();
    for r in rs {
        *sizes.entry(r.group).or_default() += 1;
        let pool = scores.entry(r.group).or_default();
        match (step_scores, &r.step_scores) {
            (true, Some(v)) => pool.extend(v),
            (true, None) => pool.extend(std::iter::repeat_n(
                r.step_rewards.iter().sum::<f64>(),
                r.step_rewards.len(),
            )),
            (false, _) => pool.push(r.outcome),
        }
    }
    let stats: BTreeMap<usize, (usize, f64, f64)> = scores
        .iter()
        .map(|(&g, v)| {
            let (_, mean, std) = mean_std(v);
            (g, (sizes[&g], mean, std))
        })
        .collect();
    rs.iter()
        .zip(&out.rollouts)
        .map(|(r, a)| {
            let (group_size, group_mean, group_std) = stats[&r.group];
            EpisodeAdvantage {
                turns: a.turns.clone(),
                channels: a.channels.clone(),
                score: r.outcome,
                group: r.group,
                group_size,
                group_mean,
                group_std,
            }
        })
        .collect()
}

/// Subtracts `β · k(old, ref)` from the rewards of `rollouts` (those of `episodes`) on their
/// loss tokens (spec §5.8): from the token rewards for `gae` (the turn rewards and the outcome
/// placed at their tokens, spec §3.3, or the explicit token rewards), from the outcome for the
/// outcome estimators (the sum over the rollout's tokens; verl's GRPO scores the sum of the
/// token-level rewards). Returns the batch mean of the per-rollout masked-mean KL.
fn subtract_reward_kl(
    cfg: &TrainConfig,
    episodes: &[ScoredEpisode],
    rollouts: &mut [Rollout],
    kl: &KlInReward<'_>,
) -> Result<f64> {
    let name = cfg.advantage.name();
    let placement = cfg.advantage.kl_placement();
    let to_f64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let masks: Vec<Vec<f64>> = episodes
        .iter()
        .map(|e| {
            let f = e.episode.trajectory.flatten(cfg.rollout.train_on_forced);
            f.loss_mask.iter().map(|&m| f64::from(m)).collect()
        })
        .collect();
    let old: Vec<Vec<f64>> = kl.old_logp.iter().map(|v| to_f64(v)).collect();
    let reference: Vec<Vec<f64>> = kl.ref_logp.iter().map(|v| to_f64(v)).collect();
    let mut penalty: Vec<Vec<f64>> = masks.iter().map(|m| vec![0.0; m.len()]).collect();
    let mean_kl = apply_kl_in_reward(
        &mut penalty,
        &old,
        &reference,
        &masks,
        kl.beta,
        kl.estimator,
    )
    .context("KL in the reward")?;
    for ((r, p), e) in rollouts.iter_mut().zip(penalty).zip(episodes) {
        let id = &e.episode.trajectory.id;
        match placement {
            Some(KlPlacement::TokenRewards) => {
                let mut tokens = match r.token_rewards.take() {
                    Some(t) => t,
                    None => place_turn_rewards(&r.turn_id, &r.turn_rewards, r.outcome)
                        .map_err(|e| anyhow::anyhow!("rewards of {id}: {e}"))?,
                };
                if tokens.len() != p.len() {
                    bail!(
                        "{id}: {} token rewards for {} response tokens",
                        tokens.len(),
                        p.len()
                    );
                }
                for (t, q) in tokens.iter_mut().zip(&p) {
                    *t += q;
                }
                r.token_rewards = Some(tokens);
            }
            Some(KlPlacement::Outcome) => r.outcome += p.iter().sum::<f64>(),
            None => bail!("KL in the reward does not apply to the {name} estimator"),
        }
    }
    Ok(mean_kl)
}

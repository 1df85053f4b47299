//! Episodes → the core's [`AdvantageBatch`] → per-token training rows.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, Result, bail};
use turnwise_core::advantage::{
    AdvantageBatch, Estimator, Rollout, broadcast_turns, place_turn_rewards,
};
use turnwise_core::control::filter_groups;
use turnwise_model::loss::{KlEstimator, apply_kl_in_reward};

use crate::config::TrainConfig;
use crate::rollout::Episode;
use crate::rollout::tree::TreeBatch;
use crate::update::Row;

/// Training rows and advantage metrics of a batch.
pub struct AdvantageRows {
    /// One row per kept episode.
    pub rows: Vec<Row>,
    /// Episodes kept (every episode given: DAPO's group filter runs before, in
    /// `Trainer::sample_batch`).
    pub kept: usize,
    /// Indices (into the episodes) of the kept rows, in row order.
    pub kept_index: Vec<usize>,
    /// `critic/advantages/*` and friends.
    pub metrics: BTreeMap<String, f64>,
    /// With KL in the reward: the batch mean of the per-rollout masked-mean KL (verl
    /// `actor/reward_kl_penalty`, the adaptive controller's input).
    pub reward_kl: Option<f64>,
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
/// A group is informative when its scores differ (population std > 0) or it holds a single
/// rollout (DAPO keeps those, `turnwise_core::control::filter_groups`); or, whatever the scores,
/// when any of its rollouts has a non-zero information gain (IGPO/A2TGPO turn signal); or when
/// the estimator reads per-turn rewards (`mt_grpo`, `mt_grpo_code`) and those differ between
/// its rollouts; or when the estimator reads step rewards (`gigpo`, `t2po`: the environment's,
/// or `t2po_em`'s per-step rewards) and those differ. With `gae` every group is informative:
/// the critic's values give tied rollouts non-zero advantages, and the critic needs their
/// returns. Returns the informative group ids.
pub fn informative_groups(
    cfg: &TrainConfig,
    episodes: &[Episode],
    groups: &[usize],
    scores: &[f64],
    turn_rewards: &[Vec<f64>],
    info_gain: Option<&[Vec<f64>]>,
) -> BTreeSet<usize> {
    let name = cfg.advantage.name();
    if name == "gae" {
        return groups.iter().copied().collect();
    }
    let mut keep: BTreeSet<usize> = match filter_groups(groups, scores) {
        Ok(f) => f.kept_uids.into_iter().collect(),
        // Lengths always match here (one score per episode).
        Err(_) => groups.iter().copied().collect(),
    };
    let t2po_steps = matches!(cfg.reward, turnwise_core::reward::RewardConfig::T2poEm(_));
    let signal = |i: usize| -> Vec<f64> {
        match name {
            "mt_grpo" | "mt_grpo_code" => turn_rewards[i].clone(),
            "gigpo" | "t2po" if t2po_steps => turn_rewards[i].clone(),
            "gigpo" | "t2po" => episodes[i]
                .trajectory
                .turns
                .iter()
                .map(|t| t.env_reward.unwrap_or(0.0))
                .collect(),
            _ => Vec::new(),
        }
    };
    let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &g) in groups.iter().enumerate() {
        by_group.entry(g).or_default().push(i);
    }
    for (g, idx) in by_group {
        if keep.contains(&g) {
            continue;
        }
        let ig_signal = info_gain
            .map(|ig| idx.iter().any(|&i| ig[i].iter().any(|x| x.abs() > 1e-9)))
            .unwrap_or(false);
        let first = signal(idx[0]);
        let differs = idx[1..].iter().any(|&i| {
            let v = signal(i);
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
    if let Some(ig) = info_gain {
        let mut g = ig.to_vec();
        g.resize(r.num_turns.saturating_sub(1), 0.0);
        r.info_gain = g;
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
            // The state a step acts in: the observation before it (the question for step 0).
            if i == 0 {
                format!("prompt:{}", ep.trajectory.prompt_uid)
            } else {
                ep.trajectory.turns[i - 1]
                    .anchor
                    .clone()
                    .unwrap_or_else(|| t.index.to_string())
            }
        })
        .collect();
    let mut step_rewards = step_rewards;
    step_rewards.resize(r.num_turns, 0.0);
    let mut anchors = anchors;
    anchors.resize(r.num_turns, String::new());
    r.with_steps(step_rewards, anchors)
}

/// Computes advantages for `episodes` and builds their training rows.
#[allow(clippy::too_many_arguments)]
pub fn compute(
    cfg: &TrainConfig,
    episodes: &[Episode],
    groups: &[usize],
    scores: &[f64],
    turn_rewards: &[Vec<f64>],
    info_gain: Option<&[Vec<f64>]>,
    trees: Option<&TreeBatch>,
    values: Option<&[Vec<f32>]>,
) -> Result<AdvantageRows> {
    compute_with_kl(
        cfg,
        episodes,
        groups,
        scores,
        turn_rewards,
        info_gain,
        trees,
        values,
        None,
    )
}

/// [`compute`] with KL in the reward (`kl`, spec §5.8) subtracted from the rewards before the
/// estimator.
#[allow(clippy::too_many_arguments)]
pub fn compute_with_kl(
    cfg: &TrainConfig,
    episodes: &[Episode],
    groups: &[usize],
    scores: &[f64],
    turn_rewards: &[Vec<f64>],
    info_gain: Option<&[Vec<f64>]>,
    trees: Option<&TreeBatch>,
    values: Option<&[Vec<f32>]>,
    kl: Option<&KlInReward<'_>>,
) -> Result<AdvantageRows> {
    let name = cfg.advantage.name();
    if name == "gae" && values.is_none() {
        bail!("the gae estimator needs critic values: set critic.enabled = true");
    }
    // Every episode given is trained on: DAPO's group filter ran in `Trainer::sample_batch`.
    let kept: Vec<usize> = (0..episodes.len()).collect();
    let steps_from_reward = matches!(cfg.reward, turnwise_core::reward::RewardConfig::T2poEm(_));
    let mut metrics = BTreeMap::new();
    if kept.is_empty() {
        metrics.insert("critic/advantages/mean".into(), 0.0);
        return Ok(AdvantageRows {
            rows: Vec::new(),
            kept: 0,
            kept_index: Vec::new(),
            metrics,
            reward_kl: None,
        });
    }
    let mut rollouts: Vec<Rollout> = kept
        .iter()
        .map(|&i| {
            let mut r = rollout_of(
                &episodes[i],
                groups[i],
                scores[i],
                &turn_rewards[i],
                info_gain.map(|g| g[i].as_slice()),
            );
            // A per-step reward (T2PO's EM with the format penalty on invalid steps, spec
            // §2.6) replaces the environment's step rewards that GiGPO-style estimators read.
            if steps_from_reward && !turn_rewards[i].is_empty() {
                let mut steps = turn_rewards[i].clone();
                steps.resize(r.num_turns, 0.0);
                r.step_rewards = steps;
            }
            match values {
                Some(v) => r.with_values(v[i].iter().map(|&x| f64::from(x)).collect()),
                None => r,
            }
        })
        .collect();
    let reward_kl = match kl {
        Some(k) => Some(subtract_reward_kl(cfg, episodes, &kept, &mut rollouts, k)?),
        None => None,
    };
    let batch = match trees {
        Some(t) => {
            for (r, &i) in rollouts.iter_mut().zip(&kept) {
                let (tree, leaf) = t.leaf_of[i];
                r.tree = Some(tree);
                r.leaf = Some(leaf);
            }
            AdvantageBatch::with_trees(rollouts, t.trees.clone())
        }
        None => AdvantageBatch::new(rollouts),
    };
    let out = cfg
        .advantage
        .estimate(&batch)
        .with_context(|| format!("estimator {name}"))?;
    let mut rows = Vec::with_capacity(kept.len());
    let mut all = Vec::new();
    for ((&i, ro), adv) in kept.iter().zip(&batch.rollouts).zip(&out.rollouts) {
        let ep = &episodes[i];
        let flat = ep.trajectory.flatten(cfg.rollout.train_on_forced);
        let mut row = Row::new(
            ep.trajectory.prompt_ids.clone(),
            flat.ids.clone(),
            flat.loss_mask.clone(),
            flat.turn_id.clone(),
        );
        if adv.tokens.len() != flat.ids.len() {
            bail!(
                "estimator {name} returned {} token advantages for {} tokens of {}",
                adv.tokens.len(),
                flat.ids.len(),
                ep.trajectory.id
            );
        }
        row.advantages = adv.tokens.iter().map(|&a| a as f32).collect();
        if let Some(ret) = &adv.returns {
            row.returns = ret.iter().map(|&x| x as f32).collect();
        }
        if let Some(c) = &adv.clip_scale {
            row.clip_scale = broadcast_turns(&ro.turn_id, c, 1.0)
                .into_iter()
                .map(|x| x as f32)
                .collect();
        }
        for (k, &m) in flat.loss_mask.iter().enumerate() {
            if m > 0 {
                all.push(adv.tokens[k]);
            }
        }
        rows.push(row);
    }
    if !all.is_empty() {
        let n = all.len() as f64;
        metrics.insert("critic/advantages/mean".into(), all.iter().sum::<f64>() / n);
        metrics.insert(
            "critic/advantages/max".into(),
            all.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
        metrics.insert(
            "critic/advantages/min".into(),
            all.iter().copied().fold(f64::INFINITY, f64::min),
        );
    }
    Ok(AdvantageRows {
        rows,
        kept: kept.len(),
        kept_index: kept,
        metrics,
        reward_kl,
    })
}

/// Subtracts `β · k(old, ref)` from the rewards of `rollouts` (episodes `kept`) on their loss
/// tokens (spec §5.8): from the token rewards for `gae` (the turn rewards and the outcome placed
/// at their tokens, spec §3.3, or the explicit token rewards), from the outcome for the
/// outcome estimators (the sum over the rollout's tokens; verl's GRPO scores the sum of the
/// token-level rewards). Returns the batch mean of the per-rollout masked-mean KL.
fn subtract_reward_kl(
    cfg: &TrainConfig,
    episodes: &[Episode],
    kept: &[usize],
    rollouts: &mut [Rollout],
    kl: &KlInReward<'_>,
) -> Result<f64> {
    let name = cfg.advantage.name();
    let to_f64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    let masks: Vec<Vec<f64>> = kept
        .iter()
        .map(|&i| {
            let f = episodes[i].trajectory.flatten(cfg.rollout.train_on_forced);
            f.loss_mask.iter().map(|&m| f64::from(m)).collect()
        })
        .collect();
    let old: Vec<Vec<f64>> = kept.iter().map(|&i| to_f64(&kl.old_logp[i])).collect();
    let reference: Vec<Vec<f64>> = kept.iter().map(|&i| to_f64(&kl.ref_logp[i])).collect();
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
    for (k, (r, p)) in rollouts.iter_mut().zip(penalty).enumerate() {
        let id = &episodes[kept[k]].trajectory.id;
        match name {
            "gae" => {
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
            "grpo" | "dr_grpo" | "rloo" => r.outcome += p.iter().sum::<f64>(),
            other => bail!("KL in the reward does not apply to the {other} estimator"),
        }
    }
    Ok(mean_kl)
}

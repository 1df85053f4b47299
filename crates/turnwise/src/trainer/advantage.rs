//! Episodes → the core's [`AdvantageBatch`] → per-token training rows.

use std::collections::BTreeMap;

use anyhow::{Context, Result, bail};
use turnwise_core::advantage::{AdvantageBatch, Estimator, Rollout, broadcast_turns};

use crate::config::TrainConfig;
use crate::rollout::Episode;
use crate::rollout::tree::TreeBatch;
use crate::update::Row;

/// Training rows and advantage metrics of a batch.
pub struct AdvantageRows {
    /// One row per kept episode.
    pub rows: Vec<Row>,
    /// Episodes kept after group filtering.
    pub kept: usize,
    /// Indices (into the episodes) of the kept rows, in row order.
    pub kept_index: Vec<usize>,
    /// `critic/advantages/*` and friends.
    pub metrics: BTreeMap<String, f64>,
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

/// Places the reward where the estimator of `cfg` reads it (spec §2.4, §2.6, §3.3, §3.7), so
/// that every reward is counted once and every penalty lands on its own step:
///
/// - `gae` with turn rewards (MT-PPO, eq. 10): `R^I_k` at the end of every process turn and
///   `R^F` once, at the last agent token. The reward's last turn entry is `R^F` itself (it must
///   equal the outcome; an error otherwise), so it is taken out of `turn_rewards` and placed
///   through the outcome only.
/// - `gigpo` / `t2po` with the `t2po_em` reward: the step rewards are the reward's per-step
///   values (EM minus the format penalty of each step); with the per-invalid-step placement the
///   episode score of step sample `k` is the episode's EM minus step `k`'s own penalty, so the
///   penalty lowers only the invalid step (verl-agent), not every step of the trajectory.
/// - `gigpo` / `t2po` with another reward: the environment's step rewards, with the
///   estimator's `invalid_action_penalty` taken off the step reward and the episode score of
///   every step whose action was invalid (GiGPO's −0.1, spec §10).
///
/// Returns the number of steps whose sample was penalised (logged as
/// `gigpo/penalised_steps`).
pub fn place_rewards(cfg: &TrainConfig, ep: &Episode, r: &mut Rollout) -> Result<usize> {
    let mut penalised = 0;
    use turnwise_core::advantage::AdvantageConfig;
    use turnwise_core::reward::RewardConfig;
    let id = &ep.trajectory.id;
    match &cfg.advantage {
        AdvantageConfig::Gae(_) if !r.turn_rewards.is_empty() => {
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
        AdvantageConfig::Gigpo(_) | AdvantageConfig::T2po(_) => {
            let n = r.num_turns;
            if let RewardConfig::T2poEm(c) = &cfg.reward {
                let steps: Vec<&str> = ep.turn_texts.iter().map(|(g, _)| g.as_str()).collect();
                let penalties =
                    turnwise_core::reward::t2po::step_penalties(&steps, &[] as &[&str], c);
                let mut step_rewards = r.turn_rewards.clone();
                step_rewards.resize(n, 0.0);
                let mut pen = penalties;
                pen.resize(n, 0.0);
                penalised = pen.iter().filter(|&&p| p > 0.0).count();
                if c.placement == turnwise_core::reward::t2po::PenaltyPlacement::PerInvalidStep {
                    let raw: f64 = step_rewards.iter().zip(&pen).map(|(s, p)| s + p).sum();
                    r.step_scores = Some(pen.iter().map(|p| raw - p).collect());
                }
                r.step_rewards = step_rewards;
            } else {
                let p = match &cfg.advantage {
                    AdvantageConfig::Gigpo(g) => g.invalid_action_penalty,
                    AdvantageConfig::T2po(t) => t.invalid_action_penalty,
                    _ => 0.0,
                };
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
                    for (k, &bad) in invalid.iter().enumerate() {
                        if bad {
                            r.step_rewards[k] -= p;
                        }
                    }
                    r.step_scores = Some(
                        invalid
                            .iter()
                            .map(|&bad| raw - if bad { p } else { 0.0 })
                            .collect(),
                    );
                }
            }
        }
        _ => {}
    }
    Ok(penalised)
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
    let name = cfg.advantage.name();
    if name == "gae" && values.is_none() {
        bail!("the gae estimator needs critic values: set critic.enabled = true");
    }
    // DAPO dynamic sampling: drop groups whose scores all equal (they carry no signal for
    // group-normalised estimators).
    let group_based = !matches!(name, "at2po" | "tree_grpo");
    let mut keep = vec![true; episodes.len()];
    if cfg.rollout.filter_zero_variance_groups && group_based {
        let mut by_group: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, &g) in groups.iter().enumerate() {
            by_group.entry(g).or_default().push(i);
        }
        for idx in by_group.values() {
            let first = scores[idx[0]];
            let ig_signal = info_gain
                .map(|ig| idx.iter().any(|&i| ig[i].iter().any(|x| x.abs() > 1e-9)))
                .unwrap_or(false);
            if idx.iter().all(|&i| (scores[i] - first).abs() < 1e-12) && !ig_signal {
                for &i in idx {
                    keep[i] = false;
                }
            }
        }
    }
    let kept: Vec<usize> = (0..episodes.len()).filter(|&i| keep[i]).collect();
    let mut metrics = BTreeMap::new();
    if kept.is_empty() {
        metrics.insert("critic/advantages/mean".into(), 0.0);
        return Ok(AdvantageRows {
            rows: Vec::new(),
            kept: 0,
            kept_index: Vec::new(),
            metrics,
        });
    }
    let mut penalised = 0usize;
    let mut rollouts: Vec<Rollout> = kept
        .iter()
        .map(|&i| -> Result<Rollout> {
            let mut r = rollout_of(
                &episodes[i],
                groups[i],
                scores[i],
                &turn_rewards[i],
                info_gain.map(|g| g[i].as_slice()),
            );
            penalised += place_rewards(cfg, &episodes[i], &mut r)?;
            Ok(match values {
                Some(v) => r.with_values(v[i].iter().map(|&x| f64::from(x)).collect()),
                None => r,
            })
        })
        .collect::<Result<_>>()?;
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
    metrics.extend(mechanism_metrics(cfg, &batch, &out));
    if matches!(name, "gigpo" | "t2po") {
        metrics.insert("gigpo/penalised_steps".into(), penalised as f64);
    }
    Ok(AdvantageRows {
        rows,
        kept: kept.len(),
        kept_index: kept,
        metrics,
    })
}

/// Size statistics of the groups formed by `keys`: `{prefix}/groups`,
/// `{prefix}/group_size/mean` and `{prefix}/singleton_share` (the share of members alone in
/// their group, whose group-normalised term is 0).
fn group_stats<K: Ord>(prefix: &str, keys: impl Iterator<Item = K>) -> BTreeMap<String, f64> {
    let mut sizes: BTreeMap<K, usize> = BTreeMap::new();
    for k in keys {
        *sizes.entry(k).or_default() += 1;
    }
    let mut m = BTreeMap::new();
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

/// Metrics that show each estimator's defining mechanism at work (spec §7): A2TGPO's turn
/// groups and the range of its clip scales, IG per turn, MT-GRPO's turn groups, GiGPO's anchor
/// groups (exact anchors) and the step rewards' invalid-action penalties.
pub fn mechanism_metrics(
    cfg: &TrainConfig,
    batch: &AdvantageBatch,
    out: &turnwise_core::advantage::AdvantageOutput,
) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    let rs = &batch.rollouts;
    let name = cfg.advantage.name();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    if matches!(name, "igpo" | "a2tgpo") {
        let max_t = rs.iter().map(|r| r.info_gain.len()).max().unwrap_or(0);
        for t in 0..max_t.min(4) {
            let v: Vec<f64> = rs
                .iter()
                .filter_map(|r| r.info_gain.get(t).copied())
                .collect();
            m.insert(format!("info_gain/turn_{t}/mean"), mean(&v));
        }
    }
    if name == "a2tgpo" {
        // Turn groups G_{q,t}: rollouts of prompt q with T_i > t (spec §3.5).
        m.extend(group_stats(
            "a2tgpo/turn_group",
            rs.iter()
                .flat_map(|r| (0..r.num_turns.saturating_sub(1)).map(move |t| (r.group, t))),
        ));
        let scales: Vec<f64> = out
            .rollouts
            .iter()
            .filter_map(|o| o.clip_scale.as_ref())
            .flatten()
            .copied()
            .collect();
        if !scales.is_empty() {
            m.insert(
                "a2tgpo/clip_scale/min".into(),
                scales.iter().copied().fold(f64::INFINITY, f64::min),
            );
            m.insert(
                "a2tgpo/clip_scale/max".into(),
                scales.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            );
            m.insert("a2tgpo/clip_scale/mean".into(), mean(&scales));
        }
    }
    if name == "mt_grpo" {
        m.extend(group_stats(
            "mt_grpo/turn_group",
            rs.iter()
                .flat_map(|r| (0..r.num_turns).map(move |k| (r.group, k, k + 1 == r.num_turns))),
        ));
    }
    if matches!(name, "gigpo" | "t2po") {
        m.extend(group_stats(
            "gigpo/anchor_group",
            rs.iter()
                .flat_map(|r| r.anchors.iter().map(move |a| (r.group, a.as_str()))),
        ));
    }
    if name == "gae" {
        let placed: Vec<f64> = rs
            .iter()
            .flat_map(|r| r.turn_rewards.iter().copied())
            .filter(|x| *x != 0.0)
            .collect();
        m.insert("mt_ppo/turn_rewards_placed".into(), placed.len() as f64);
    }
    m
}

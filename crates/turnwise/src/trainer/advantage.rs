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
    let steps_from_reward = matches!(cfg.reward, turnwise_core::reward::RewardConfig::T2poEm(_));
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
    let batch = match trees {
        Some(t) => {
            // Each rollout is labelled with its own tree (Tree-GRPO's intra-tree group; AT2PO's
            // tree index) and leaf; the leaves carry the episode scores (AT2PO's leaf values).
            for (r, &i) in rollouts.iter_mut().zip(&kept) {
                let (tree, leaf) = t.leaf_of[i];
                r.tree = Some(tree);
                r.leaf = Some(leaf);
            }
            let rewarded = t
                .with_leaf_rewards(scores)
                .context("writing the episode scores into the tree leaves")?;
            AdvantageBatch::with_trees(rollouts, rewarded)
        }
        None => AdvantageBatch::new(rollouts),
    };
    let out = cfg
        .advantage
        .estimate(&batch)
        .with_context(|| format!("estimator {name}"))?;
    // AT2PO node values (the turn credit): their size shows whether credit reaches the loss.
    let node_values: Vec<f64> = batch
        .trees
        .iter()
        .zip(&out.trees)
        .flat_map(|(tree, v)| {
            tree.nodes
                .iter()
                .zip(&v.values)
                .filter(|(n, _)| n.parent.is_some())
                .map(|(_, x)| x.abs())
        })
        .collect();
    if !node_values.is_empty() {
        metrics.insert(
            "tree/node_value/abs_mean".into(),
            node_values.iter().sum::<f64>() / node_values.len() as f64,
        );
    }
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
    })
}

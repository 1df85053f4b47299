//! Tree rollouts through the trainer's glue (spec §3.6, §3.8, §6.1): `run_trees` → scoring →
//! `trainer::advantage::compute` → per-token row advantages, for AT2PO and Tree-GRPO.

mod common;

use turnwise::config::TrainConfig;
use turnwise::rollout::tree::{TreeRollout, run_trees};
use turnwise::rollout::{Decoding, Episode, EpisodeSpec};
use turnwise::task::{TaskSet, prompt_text};
use turnwise::trainer::Trainer;
use turnwise::trainer::advantage::{AdvantageRows, compute};
use turnwise_core::reward::RewardInput;

/// The tiny world and model of `common::tiny_overrides`, with `rollout.group_size` set to the
/// leaves per prompt of the tree shape (`AT2PO_LEAVES` or `TREE_GRPO_LEAVES`), then `extra`.
fn overrides(group_size: usize, extra: &[&str]) -> Vec<String> {
    let mut sets = common::tiny_overrides();
    sets.push(format!("rollout.group_size={group_size}"));
    sets.extend(extra.iter().map(|s| s.to_string()));
    sets
}

/// AT2PO preset: M + L·K = 2 + 2·3 leaves per prompt.
const AT2PO_LEAVES: usize = 8;
/// Tree-GRPO preset: m·k = 2·3 leaves per prompt.
const TREE_GRPO_LEAVES: usize = 6;

fn leaves_of(preset: &str) -> usize {
    if preset == "at2po" {
        AT2PO_LEAVES
    } else {
        TREE_GRPO_LEAVES
    }
}

/// A warm-started tiny trainer for `preset` and one tree rollout over `prompts` training
/// questions, with the golds of every episode.
struct Fixture {
    trainer: Trainer,
    out: TreeRollout,
    golds: Vec<Vec<String>>,
}

fn fixture(preset: &str, extra: &[&str], prompts: usize, seed: u64) -> Fixture {
    let cfg =
        TrainConfig::resolve(Some(preset), None, &overrides(leaves_of(preset), extra)).unwrap();
    let mut trainer = Trainer::new(cfg.clone()).unwrap();
    trainer.warm_start(&mut |_, _, _| {}).unwrap();
    let r = &cfg.rollout;
    let qs = trainer.task.rl_questions();
    let mut specs = Vec::new();
    let mut prompt_golds = Vec::new();
    for (g, q) in qs.iter().take(prompts).enumerate() {
        let prompt_ids = trainer.tokenizer.encode(&prompt_text(&q.text)).unwrap();
        prompt_golds.push(TaskSet::env_task(q).answers.clone());
        for k in 0..r.group_size {
            specs.push(EpisodeSpec {
                id: format!("p{g}-{k}"),
                prompt_uid: format!("{g}:{}", q.id),
                prompt_ids: prompt_ids.clone(),
                task: TaskSet::env_task(q),
                seed: seed.wrapping_add((g * r.group_size + k) as u64),
            });
        }
    }
    let decoding = Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: r.max_turn_tokens,
        max_response_tokens: r.max_response_tokens,
    };
    let out = {
        let policy = trainer.rollout_policy();
        let env = || Ok(Box::new(trainer.task.env()?) as Box<dyn turnwise_env::env::Environment>);
        run_trees(&policy, specs, r.group_size, &env, &decoding, r, seed).unwrap()
    };
    let golds = out
        .groups
        .iter()
        .map(|&g| prompt_golds[g].clone())
        .collect();
    Fixture {
        trainer,
        out,
        golds,
    }
}

/// The trainer's scoring of an episode (as in `Trainer::rl_step`): score and turn rewards.
fn score(cfg: &TrainConfig, ep: &Episode, gold: &[String]) -> (f64, Vec<f64>) {
    let turns = turnwise::trainer::reward_turns(ep);
    let out = cfg
        .reward
        .score(&RewardInput::from_turns(&turns, gold))
        .unwrap();
    (out.score, out.turn_rewards)
}

fn advantages(cfg: &TrainConfig, f: &Fixture, scores: &[f64]) -> AdvantageRows {
    let turn_rewards = vec![Vec::new(); scores.len()];
    compute(
        cfg,
        &common::scored(&f.out.episodes, &f.out.groups, scores, &turn_rewards, None),
        Some(&f.out.trees),
        None,
        None,
    )
    .unwrap()
}

/// Advantages on the trained (loss-mask 1) tokens of a row.
fn trained(row: &turnwise::update::Row) -> Vec<f64> {
    row.advantages
        .iter()
        .zip(&row.loss_mask)
        .filter(|(_, m)| **m > 0)
        .map(|(a, _)| f64::from(*a))
        .collect()
}

/// Per episode: its rank among the leaves of its tree.
fn rank_in_tree(out: &TreeRollout) -> Vec<usize> {
    let mut seen = std::collections::HashMap::new();
    out.trees
        .leaf_of
        .iter()
        .map(|&(t, _)| {
            let c = seen.entry(t).or_insert(0usize);
            *c += 1;
            *c - 1
        })
        .collect()
}

/// GRPO of `xs` with the unbiased std + 1e-6 (singleton: raw), written out for the checks.
fn grpo(xs: &[f64]) -> Vec<f64> {
    let n = xs.len() as f64;
    if xs.len() < 2 {
        return xs.to_vec();
    }
    let m = xs.iter().sum::<f64>() / n;
    let s = (xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    xs.iter().map(|x| (x - m) / (s + 1e-6)).collect()
}

/// AT2PO glue: the episode scores become the leaf rewards, the estimator's node values reach
/// the rows, and the advantages are non-zero exactly when a tree's scores differ.
#[test]
fn at2po_leaf_rewards_are_the_episode_scores_and_reach_the_rows() {
    let f = fixture("at2po", &[], 2, 11);
    let cfg = &f.trainer.config;
    let tb = &f.out.trees;
    assert_eq!(f.out.episodes.len(), 2 * 8, "M + L·K = 8 leaves per prompt");

    // The trainer's real scores.
    let (scores, _): (Vec<f64>, Vec<Vec<f64>>) = f
        .out
        .episodes
        .iter()
        .zip(&f.golds)
        .map(|(ep, g)| score(cfg, ep, g))
        .unzip();
    let rewarded = tb.with_leaf_rewards(&scores).unwrap();
    for (i, &(t, n)) in tb.leaf_of.iter().enumerate() {
        assert_eq!(rewarded[t].nodes[n].reward, Some(scores[i]), "episode {i}");
    }
    let adv = advantages(cfg, &f, &scores);
    assert_eq!(adv.rows.len(), scores.len());
    for t in 0..tb.trees.len() {
        let idx: Vec<usize> = (0..scores.len())
            .filter(|&i| tb.leaf_of[i].0 == t)
            .collect();
        let differ = idx.iter().any(|&i| scores[i] != scores[idx[0]]);
        let nonzero = idx
            .iter()
            .any(|&i| trained(&adv.rows[i]).iter().any(|a| a.abs() > 1e-6));
        assert_eq!(
            nonzero,
            differ,
            "tree {t}: scores {:?}",
            idx.iter().map(|&i| scores[i]).collect::<Vec<_>>()
        );
    }

    // Scores that differ in every tree: each row ends on its leaf's normalised reward
    // (r − mean) / (std_p + ε) over the tree's leaves (node_value mode, A(leaf) = V(leaf)).
    let scores: Vec<f64> = (0..scores.len()).map(|i| (i % 2) as f64).collect();
    let adv = advantages(cfg, &f, &scores);
    for t in 0..tb.trees.len() {
        let idx: Vec<usize> = (0..scores.len())
            .filter(|&i| tb.leaf_of[i].0 == t)
            .collect();
        let r: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
        let m = r.iter().sum::<f64>() / r.len() as f64;
        let sp = (r.iter().map(|x| (x - m).powi(2)).sum::<f64>() / r.len() as f64).sqrt();
        for &i in &idx {
            let a = trained(&adv.rows[i]);
            let want = (scores[i] - m) / (sp + 1e-6);
            let last = *a.last().expect("a row trains on its leaf's tokens");
            assert!(want.abs() > 0.5, "the scores differ in tree {t}");
            assert!((last - want).abs() < 1e-5, "episode {i}: {last} vs {want}");
        }
    }
    let v = adv.metrics["tree/node_value/abs_mean"];
    assert!(v > 0.1, "node values reach the metrics: {v}");
}

/// Ablation of AT2PO's defining component on one fixed batch: with the tree credit (node values
/// per turn) the per-token advantages fed to the loss differ from those without it (`vanilla`:
/// GRPO over the tree's leaves, one value per rollout), and vary across the turns of a rollout.
#[test]
fn at2po_tree_credit_changes_the_token_advantages() {
    let f = fixture("at2po", &[], 2, 23);
    let scores: Vec<f64> = (0..f.out.episodes.len()).map(|i| (i % 2) as f64).collect();
    let with_credit = advantages(&f.trainer.config, &f, &scores);
    let mut sets = overrides(AT2PO_LEAVES, &[]);
    sets.push("advantage.node_adv_mode=vanilla".into());
    let vanilla_cfg = TrainConfig::resolve(Some("at2po"), None, &sets).unwrap();
    let without = advantages(&vanilla_cfg, &f, &scores);
    let mut max_diff: f64 = 0.0;
    let mut turn_varying = 0;
    for (a, b) in with_credit.rows.iter().zip(&without.rows) {
        let (a, b) = (trained(a), trained(b));
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            max_diff = max_diff.max((x - y).abs());
        }
        assert!(
            b.iter().all(|y| (y - b[0]).abs() < 1e-6),
            "vanilla is one value per rollout"
        );
        turn_varying += usize::from(a.iter().any(|x| (x - a[0]).abs() > 1e-4));
    }
    assert!(
        max_diff > 1e-2,
        "tree credit changes the advantages ({max_diff})"
    );
    assert!(
        turn_varying > 0,
        "some rollout gets different credit on different turns"
    );
}

/// Tree-GRPO: `tree_count` trees per prompt, each a label of its own with `tree_leaves` sampled
/// leaves (here with pruning: each tree grows 1 + 2·3 = 7 leaves and keeps 3).
#[test]
fn tree_grpo_groups_hold_separate_trees_with_k_sampled_leaves() {
    let f = fixture(
        "tree-grpo",
        &["rollout.tree_iterations=2", "rollout.tree_forks=3"],
        2,
        5,
    );
    let tb = &f.out.trees;
    assert_eq!(tb.trees.len(), 2 * 2, "m = 2 trees per prompt");
    assert_eq!(f.out.episodes.len(), 2 * 6);
    for p in 0..2 {
        let labels: std::collections::BTreeSet<usize> = (0..f.out.groups.len())
            .filter(|&i| f.out.groups[i] == p)
            .map(|i| tb.leaf_of[i].0)
            .collect();
        assert_eq!(labels.len(), 2, "prompt {p} holds two tree labels");
        for &t in &labels {
            assert_eq!(tb.trees[t].group, p);
            let leaves = tb.trees[t].nodes.iter().filter(|n| n.is_leaf).count();
            assert_eq!(leaves, 3, "tree {t} keeps k = 3 leaves, the other 4 pruned");
            let eps = tb.leaf_of.iter().filter(|l| l.0 == t).count();
            assert_eq!(eps, 3, "tree {t} has one episode per kept leaf");
        }
    }
    assert_eq!(
        tb.forks.len(),
        2 * 2 * 2 * 3,
        "prompts × trees × l × n forks"
    );
    assert!(
        tb.forks.iter().any(|fk| fk.node.is_none()),
        "some forked branches were pruned"
    );
    let m = tb.metrics();
    assert_eq!(m["tree/leaves"], 6.0);
    assert_eq!(m["tree/labels_per_group"], 2.0);
}

/// Tree-GRPO expansion continues after the chosen node: the new branch is a child of the chosen
/// node and its tokens start with the chosen node's whole turn, action and observation.
#[test]
fn tree_grpo_forks_continue_after_the_chosen_nodes_observation() {
    let f = fixture("tree-grpo", &[], 3, 7);
    let tb = &f.out.trees;
    let flat: Vec<_> = f
        .out
        .episodes
        .iter()
        .map(|e| e.trajectory.flatten(true))
        .collect();
    let mut checked = 0;
    for fk in &tb.forks {
        let (Some(sel), Some(new)) = (fk.selected, fk.node) else {
            continue;
        };
        let tree = &tb.trees[fk.tree];
        assert_eq!(
            tree.nodes[new].parent,
            Some(sel),
            "a child of the chosen node"
        );
        if sel == 0 {
            assert_eq!(fk.resume_at, 0, "choosing the root starts a new chain");
            continue;
        }
        let end_sel: usize = tree.path_to(sel).iter().map(|&n| tree.nodes[n].span).sum();
        let through = |node: usize| {
            (0..tb.leaf_of.len()).find(|&i| {
                tb.leaf_of[i].0 == fk.tree && tree.path_to(tb.leaf_of[i].1).contains(&node)
            })
        };
        let a = through(new).expect("the new branch ends in a leaf");
        let b = (0..tb.leaf_of.len())
            .find(|&i| {
                let p = tree.path_to(tb.leaf_of[i].1);
                tb.leaf_of[i].0 == fk.tree && p.contains(&sel) && !p.contains(&new)
            })
            .expect("the chosen node's earlier branch ends in a leaf");
        let (fa, fb) = (&flat[a], &flat[b]);
        assert!(
            fk.resume_at > end_sel,
            "the branch starts after the chosen node's action"
        );
        assert_eq!(
            fa.loss_mask[end_sel - 1],
            1,
            "the chosen node's turn ends on its action"
        );
        assert!(
            fa.loss_mask[end_sel..fk.resume_at].iter().all(|&m| m == 0),
            "between the action and the branch lies the observation"
        );
        assert_eq!(
            fa.ids[..fk.resume_at],
            fb.ids[..fk.resume_at],
            "both branches share the chosen node's turn and observation"
        );
        checked += 1;
    }
    assert!(checked > 0, "no fork of a non-root node in this batch");
}

/// Ablation of Tree-GRPO's defining component on one fixed batch: with every leaf labelled by
/// its own tree the advantage is GRPO over the prompt plus GRPO over the tree, which differs
/// from 2·GRPO (what a prompt-wide label would give).
#[test]
fn tree_grpo_differs_from_twice_grpo() {
    let f = fixture("tree-grpo", &[], 2, 3);
    let tb = &f.out.trees;
    // Per tree (3 leaves): the first tree of a prompt [1, 0, 0], the second [1, 1, 0].
    let ranks = rank_in_tree(&f.out);
    let scores: Vec<f64> = (0..ranks.len())
        .map(|i| {
            let pattern = if tb.leaf_of[i].0.is_multiple_of(2) {
                [1.0, 0.0, 0.0]
            } else {
                [1.0, 1.0, 0.0]
            };
            pattern[ranks[i]]
        })
        .collect();
    let tree = advantages(&f.trainer.config, &f, &scores);
    let mut sets = overrides(TREE_GRPO_LEAVES, &[]);
    sets.push("advantage.estimator=grpo".into());
    let grpo_cfg = TrainConfig::resolve(Some("tree-grpo"), None, &sets).unwrap();
    let plain = advantages(&grpo_cfg, &f, &scores);
    let mut max_diff: f64 = 0.0;
    for p in 0..2 {
        let idx: Vec<usize> = (0..scores.len())
            .filter(|&i| f.out.groups[i] == p)
            .collect();
        let s: Vec<f64> = idx.iter().map(|&i| scores[i]).collect();
        let inter = grpo(&s);
        for (k, &i) in idx.iter().enumerate() {
            let same: Vec<usize> = idx
                .iter()
                .copied()
                .filter(|&j| tb.leaf_of[j].0 == tb.leaf_of[i].0)
                .collect();
            let within: Vec<f64> = same.iter().map(|&j| scores[j]).collect();
            let intra = grpo(&within)[same.iter().position(|&j| j == i).unwrap()];
            let want = inter[k] + intra;
            let got = trained(&tree.rows[i]);
            let g = trained(&plain.rows[i]);
            assert!(
                got.iter().all(|x| (x - want).abs() < 1e-4),
                "episode {i}: {got:?} vs {want}"
            );
            assert!((g[0] - inter[k]).abs() < 1e-4, "grpo {}", g[0]);
            max_diff = max_diff.max((got[0] - 2.0 * g[0]).abs());
        }
    }
    assert!(max_diff > 0.1, "tree_grpo equals 2·GRPO ({max_diff})");
}

/// `Trainer::rl_step` reports the tree mechanism (`tree/*`) for both tree presets.
#[test]
fn rl_step_reports_tree_metrics() {
    for (preset, leaves, labels, forks) in [("at2po", 8.0, 1.0, 6.0), ("tree-grpo", 6.0, 2.0, 4.0)]
    {
        let cfg =
            TrainConfig::resolve(Some(preset), None, &overrides(leaves_of(preset), &[])).unwrap();
        let mut t = Trainer::new(cfg).unwrap();
        t.warm_start(&mut |_, _, _| {}).unwrap();
        t.freeze_reference().unwrap();
        let m = t.rl_step().unwrap().metrics;
        assert_eq!(m["tree/leaves"], leaves, "{preset}");
        assert_eq!(m["tree/labels_per_group"], labels, "{preset}");
        assert_eq!(m["tree/forks"], forks, "{preset}");
        assert!(m["tree/depth/mean"] >= 1.0 && m["tree/depth/max"] >= m["tree/depth/mean"]);
        assert!(m["tree/fork_entropy/mean"].is_finite(), "{preset}");
        assert_eq!(
            m.contains_key("tree/node_value/abs_mean"),
            preset == "at2po"
        );
    }
}

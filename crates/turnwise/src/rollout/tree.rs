//! Tree rollouts (spec §6.1, §3.8): per prompt, M initial chains whose turns are tree nodes;
//! then L iterations that each pick K nodes (AT2PO: top-K by entropy with the branching
//! penalty; Tree-GRPO: uniformly at random) and re-sample each picked node's turn as a new
//! sibling, continuing the chain to a leaf. Node bookkeeping and selection are the core's
//! [`ExpansionTree`]; every live chain of every tree is batched at each turn.

use std::collections::HashMap;

use anyhow::{Context, Result};
use turnwise_core::advantage::{RolloutTree, TreeNode};
use turnwise_core::control::SplitMix64;
use turnwise_core::control::tree_expansion::{
    ExpansionMode, ExpansionTree, NodeId, TreeExpansionSettings,
};
use turnwise_env::env::Environment;

use super::{Decoding, Episode, EpisodeSpec, EpisodeState, Policy, step_turn, turn_seed};
use crate::config::{RolloutConfig, RolloutStrategy};

/// Trees of a batch, in the core's advantage layout.
#[derive(Debug, Clone)]
pub struct TreeBatch {
    /// One tree per prompt (node rewards are filled in by the trainer).
    pub trees: Vec<RolloutTree>,
    /// Per episode: `(tree index, leaf node index)`.
    pub leaf_of: Vec<(usize, usize)>,
}

/// The result of [`run_trees`].
pub struct TreeRollout {
    /// Finished episodes (one per leaf).
    pub episodes: Vec<Episode>,
    /// Per episode: its prompt group.
    pub groups: Vec<usize>,
    /// The trees.
    pub trees: TreeBatch,
}

struct Branch {
    tree: usize,
    node: NodeId,
    state: EpisodeState,
}

fn err(e: turnwise_core::control::ControlError) -> anyhow::Error {
    anyhow::anyhow!("tree bookkeeping: {e}")
}

/// Rolls out one tree per prompt. `specs` holds `group_size` consecutive specs per prompt; the
/// first of each is the tree's template.
pub fn run_trees(
    policy: &Policy<'_>,
    specs: Vec<EpisodeSpec>,
    group_size: usize,
    make_env: &dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &Decoding,
    cfg: &RolloutConfig,
    seed: u64,
) -> Result<TreeRollout> {
    let settings = TreeExpansionSettings {
        initial_rollouts: cfg.tree_initial_chains,
        expansion_iterations: cfg.tree_iterations,
        beam_size: cfg.tree_forks,
        branch_penalty: cfg.tree_branch_penalty,
        mode: if cfg.strategy == RolloutStrategy::RandomTree {
            ExpansionMode::Random
        } else {
            ExpansionMode::Entropy
        },
    };
    settings.validate().map_err(err)?;
    let templates: Vec<EpisodeSpec> = specs.into_iter().step_by(group_size.max(1)).collect();
    let mut trees: Vec<ExpansionTree> = Vec::new();
    let mut snapshots: Vec<HashMap<NodeId, EpisodeState>> = Vec::new();
    let mut frontier: Vec<Branch> = Vec::new();
    let mut counter = 0usize;
    for (t, spec) in templates.iter().enumerate() {
        let tree = ExpansionTree::with_initial_rollouts(settings.initial_rollouts);
        let mut snaps = HashMap::new();
        snaps.insert(tree.root(), EpisodeState::start(spec.clone(), make_env()?)?);
        let children = tree.node(tree.root()).map_err(err)?.children.clone();
        for node in children {
            let mut state = snaps[&tree.root()].fork(policy, make_env()?)?;
            state.set_seed(turn_seed(seed ^ spec.seed, counter));
            state.set_id(format!("{}-n{}", spec.id, node.0));
            counter += 1;
            snaps.insert(node, state.fork(policy, make_env()?)?);
            frontier.push(Branch {
                tree: t,
                node,
                state,
            });
        }
        trees.push(tree);
        snapshots.push(snaps);
    }
    let mut leaves: Vec<(usize, NodeId, Episode)> = Vec::new();
    run_frontier(
        policy,
        &mut frontier,
        &mut trees,
        &mut snapshots,
        &mut leaves,
        make_env,
        decoding,
    )?;
    let mut rng = SplitMix64::new(seed ^ 0x7472_6565);
    for _ in 0..settings.expansion_iterations {
        for t in 0..trees.len() {
            let pairs = trees[t].expand(&settings, &mut rng).map_err(err)?;
            for (selected, new) in pairs {
                let snap = snapshots[t]
                    .get(&selected)
                    .context("a selected node has no snapshot")?;
                let mut state = snap.fork(policy, make_env()?)?;
                state.set_seed(turn_seed(seed ^ templates[t].seed, counter));
                state.set_id(format!("{}-n{}", templates[t].id, new.0));
                counter += 1;
                snapshots[t].insert(new, state.fork(policy, make_env()?)?);
                frontier.push(Branch {
                    tree: t,
                    node: new,
                    state,
                });
            }
        }
        run_frontier(
            policy,
            &mut frontier,
            &mut trees,
            &mut snapshots,
            &mut leaves,
            make_env,
            decoding,
        )?;
    }
    // Core advantage layout.
    let mut out_trees: Vec<RolloutTree> = trees
        .iter()
        .enumerate()
        .map(|(t, tree)| {
            let nodes = (0..tree.len())
                .map(|i| {
                    let n = tree.node(NodeId(i)).expect("node in range");
                    let parent_end = n
                        .parent
                        .map(|p| tree.node(p).expect("parent").end)
                        .unwrap_or(0);
                    TreeNode {
                        parent: n.parent.map(|p| p.0),
                        is_leaf: n.is_leaf && !n.pruned,
                        entropy: n.entropy,
                        reward: None,
                        span: if n.parent.is_some() {
                            n.end.saturating_sub(parent_end)
                        } else {
                            0
                        },
                    }
                })
                .collect();
            RolloutTree { group: t, nodes }
        })
        .collect();
    leaves.sort_by_key(|(t, n, _)| (*t, n.0));
    let mut episodes = Vec::with_capacity(leaves.len());
    let mut groups = Vec::with_capacity(leaves.len());
    let mut leaf_of = Vec::with_capacity(leaves.len());
    for (t, node, ep) in leaves {
        groups.push(t);
        leaf_of.push((t, node.0));
        episodes.push(ep);
    }
    for tree in &mut out_trees {
        // Nodes that never finished (cannot happen: every branch runs to its end) stay valueless.
        let _ = tree;
    }
    Ok(TreeRollout {
        episodes,
        groups,
        trees: TreeBatch {
            trees: out_trees,
            leaf_of,
        },
    })
}

#[allow(clippy::too_many_arguments)]
fn run_frontier(
    policy: &Policy<'_>,
    frontier: &mut Vec<Branch>,
    trees: &mut [ExpansionTree],
    snapshots: &mut [HashMap<NodeId, EpisodeState>],
    leaves: &mut Vec<(usize, NodeId, Episode)>,
    make_env: &dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &Decoding,
) -> Result<()> {
    while !frontier.is_empty() {
        let mut refs: Vec<&mut EpisodeState> = frontier.iter_mut().map(|b| &mut b.state).collect();
        step_turn(policy, &mut refs, decoding)?;
        let mut next = Vec::with_capacity(frontier.len());
        for mut b in frontier.drain(..) {
            let tree = &mut trees[b.tree];
            let lps = b.state.last_turn_logprobs();
            // A finished chain's last node ends where its response ends (a length cut may leave
            // an observation after the last agent turn).
            let end = if b.state.is_done() {
                b.state.response_len()
            } else {
                b.state.agent_end()
            };
            tree.record_generation(b.node, &lps, end).map_err(err)?;
            if b.state.is_done() {
                tree.mark_leaf(b.node).map_err(err)?;
                leaves.push((b.tree, b.node, b.state.finish()));
            } else {
                let child = tree
                    .add_tool_child(b.node, b.state.response_len())
                    .map_err(err)?;
                snapshots[b.tree].insert(child, b.state.fork(policy, make_env()?)?);
                b.node = child;
                next.push(b);
            }
        }
        *frontier = next;
    }
    Ok(())
}

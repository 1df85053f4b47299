//! Tree rollouts (spec §6.1, §3.8). Per prompt, `rollout.tree_count` trees; each tree starts
//! from `tree_initial_chains` chains whose turns are tree nodes, then runs `tree_iterations`
//! iterations that each pick `tree_forks` nodes per tree and fork them, continuing every new
//! branch to a leaf:
//!
//! - AT2PO (`strategy = "tree"`): top-K by entropy with the branching penalty; a fork is a new
//!   **sibling** that re-samples the picked node's turn from the node's turn-start state.
//! - Tree-GRPO (`strategy = "random_tree"`): nodes drawn uniformly (root included); a fork is a
//!   new **child** that continues after the picked node's action and observation (picking the
//!   root starts a new chain in that tree), as upstream `gen_action_chain`. Afterwards
//!   `tree_leaves` leaves are sampled per tree and the rest pruned (upstream `sample_leaf`).
//!
//! Node bookkeeping, selection and sampling are the core's [`ExpansionTree`]; every live chain
//! of every tree is batched at each turn. Every tree is its own label: episode `i` belongs to
//! tree `leaf_of[i].0`, whose [`RolloutTree::group`] is the prompt.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use anyhow::{Context, Result, bail, ensure};
use turnwise_core::advantage::{RolloutTree, TreeNode};
use turnwise_core::control::tree_expansion::{ExpansionTree, ForkRule, NodeId};
use turnwise_core::control::{SplitMix64, TreeExpansionSettings};
use turnwise_core::metric_keys as mk;
use turnwise_env::env::Environment;

use super::{Decoding, Episode, EpisodeSpec, EpisodeState, Policy, step_turn, turn_seed};
use crate::config::RolloutConfig;

/// One fork of an expansion iteration, in the node numbering of [`TreeBatch::trees`].
#[derive(Debug, Clone, PartialEq)]
pub struct ForkRecord {
    /// The tree (index into [`TreeBatch::trees`]).
    pub tree: usize,
    /// The node picked for forking (`None` once leaf sampling pruned it).
    pub selected: Option<usize>,
    /// The node the fork created (`None` once leaf sampling pruned it).
    pub node: Option<usize>,
    /// The picked node's entropy estimate when it was picked (the root's is 0).
    pub entropy: f64,
    /// Response tokens the new branch starts from: the picked node's turn start (sibling fork)
    /// or the end of its observation (child continuation).
    pub resume_at: usize,
}

/// Trees of a batch, in the core's advantage layout.
#[derive(Debug, Clone)]
pub struct TreeBatch {
    /// `tree_count` trees per prompt, the trees of a prompt consecutive; `group` is the prompt.
    /// Node rewards are `None`: [`TreeBatch::with_leaf_rewards`] fills the leaves in from the
    /// episode scores. Pruned nodes are left out.
    pub trees: Vec<RolloutTree>,
    /// Per episode: `(tree index, leaf node index)`.
    pub leaf_of: Vec<(usize, usize)>,
    /// Every fork of every expansion iteration.
    pub forks: Vec<ForkRecord>,
    /// Prompts of the batch.
    pub prompts: usize,
}

impl TreeBatch {
    /// The trees with every leaf's reward set to the score of its episode (`scores[i]` for the
    /// episode of leaf `leaf_of[i]`). Errors when the scores do not match the episodes or a leaf
    /// has no episode.
    pub fn with_leaf_rewards(&self, scores: &[f64]) -> Result<Vec<RolloutTree>> {
        ensure!(
            scores.len() == self.leaf_of.len(),
            "{} scores for {} tree leaves",
            scores.len(),
            self.leaf_of.len()
        );
        let mut trees = self.trees.clone();
        for (i, (&(t, n), &score)) in self.leaf_of.iter().zip(scores).enumerate() {
            let node = trees
                .get_mut(t)
                .and_then(|tree| tree.nodes.get_mut(n))
                .with_context(|| format!("episode {i}: leaf {n} of tree {t} does not exist"))?;
            ensure!(
                node.is_leaf,
                "episode {i}: node {n} of tree {t} is not a leaf"
            );
            ensure!(
                node.reward.is_none(),
                "episode {i}: leaf {n} of tree {t} belongs to two episodes"
            );
            node.reward = Some(score);
        }
        for (t, tree) in trees.iter().enumerate() {
            if let Some(n) = tree
                .nodes
                .iter()
                .position(|n| n.is_leaf && n.reward.is_none())
            {
                bail!("leaf {n} of tree {t} has no episode");
            }
        }
        Ok(trees)
    }

    /// What the tree mechanism did this batch (`tree/*`): leaves and distinct tree labels per
    /// prompt, leaf depth in turns, forks per prompt and the mean entropy of the forked nodes.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        let prompts = self.prompts.max(1) as f64;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        m.insert(mk::tree::LEAVES.into(), self.leaf_of.len() as f64 / prompts);
        let mut labels: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
        for &(t, _) in &self.leaf_of {
            labels.entry(self.trees[t].group).or_default().insert(t);
        }
        let per_group: Vec<f64> = labels.values().map(|s| s.len() as f64).collect();
        m.insert(mk::tree::LABELS_PER_GROUP.into(), mean(&per_group));
        let depths: Vec<f64> = self
            .leaf_of
            .iter()
            .map(|&(t, n)| (self.trees[t].path_to(n).len() - 1) as f64)
            .collect();
        m.insert(mk::tree::DEPTH_MEAN.into(), mean(&depths));
        m.insert(
            mk::tree::DEPTH_MAX.into(),
            depths.iter().copied().fold(0.0, f64::max),
        );
        m.insert(mk::tree::FORKS.into(), self.forks.len() as f64 / prompts);
        if !self.forks.is_empty() {
            let h: Vec<f64> = self.forks.iter().map(|f| f.entropy).collect();
            m.insert(mk::tree::FORK_ENTROPY_MEAN.into(), mean(&h));
        }
        m
    }
}

/// The result of [`run_trees`].
pub struct TreeRollout {
    /// Finished episodes (one per kept leaf), the leaves of a prompt consecutive.
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

/// The node whose turn-start snapshot a fork of `selected` (which created `new`) resumes from:
/// `selected` itself for a sibling fork; for a child continuation the first child of `selected`
/// (every child of a node starts after the same observation), or the root.
fn resume_source(
    tree: &ExpansionTree,
    fork: ForkRule,
    selected: NodeId,
    new: NodeId,
) -> Result<NodeId> {
    let n = tree.node(selected).map_err(err)?;
    Ok(match fork {
        ForkRule::Sibling => selected,
        ForkRule::Child if n.parent.is_none() => selected,
        ForkRule::Child => *n
            .children
            .iter()
            .find(|&&c| c != new)
            .context("a continued node has no earlier child")?,
    })
}

/// Rolls out `rollout.tree_count` trees per prompt. `specs` holds `group_size` consecutive specs
/// per prompt; the first of each is the template of the prompt's trees. Returns
/// `tree_count × leaves_per_tree` episodes per prompt.
pub fn run_trees(
    policy: &Policy<'_>,
    specs: Vec<EpisodeSpec>,
    group_size: usize,
    make_env: &dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &Decoding,
    cfg: &RolloutConfig,
    seed: u64,
) -> Result<TreeRollout> {
    let settings = cfg.tree_settings();
    settings.validate().map_err(err)?;
    ensure!(cfg.tree_count > 0, "rollout.tree_count must be at least 1");
    let templates: Vec<EpisodeSpec> = specs.into_iter().step_by(group_size.max(1)).collect();
    let mut forest = Forest {
        policy,
        make_env,
        decoding,
        seed,
        templates,
        trees: Vec::new(),
        owner: Vec::new(),
        snapshots: Vec::new(),
        frontier: Vec::new(),
        leaves: Vec::new(),
        counter: 0,
        forks: Vec::new(),
    };
    forest.plant(cfg.tree_count, settings.initial_rollouts)?;
    forest.run_frontier()?;
    let mut rng = SplitMix64::new(seed ^ 0x7472_6565);
    for _ in 0..settings.expansion_iterations {
        forest.fork_all(&settings, &mut rng)?;
        forest.run_frontier()?;
    }
    let Forest {
        templates,
        mut trees,
        owner,
        snapshots,
        mut leaves,
        forks,
        ..
    } = forest;
    drop(snapshots);
    // Tree-GRPO: keep k leaves per tree.
    if let Some(k) = cfg.tree_leaves {
        for tree in &mut trees {
            tree.sample_leaves(k, &mut rng).map_err(err)?;
        }
        leaves.retain(|(t, n, _)| !trees[*t].nodes()[n.0].pruned);
    }
    ensure!(
        leaves.len() == templates.len() * cfg.tree_count * cfg.leaves_per_tree(),
        "the trees of {} prompts kept {} leaves, expected {} per prompt",
        templates.len(),
        leaves.len(),
        cfg.tree_count * cfg.leaves_per_tree()
    );
    Ok(advantage_layout(
        &trees,
        &owner,
        leaves,
        forks,
        templates.len(),
    ))
}

/// A fork of an expansion iteration in arena ids: (tree, selected, new, entropy of selected,
/// resume position).
type ArenaFork = (usize, NodeId, NodeId, f64, usize);

/// The trees of one [`run_trees`] call while they grow: every tree's bookkeeping, its
/// turn-start snapshots, the live branches and the finished leaves.
struct Forest<'a, 'p> {
    policy: &'a Policy<'p>,
    make_env: &'a dyn Fn() -> Result<Box<dyn Environment>>,
    decoding: &'a Decoding,
    seed: u64,
    /// The first spec of each prompt: the template of its trees.
    templates: Vec<EpisodeSpec>,
    trees: Vec<ExpansionTree>,
    /// Per tree: its prompt and its index among the prompt's trees.
    owner: Vec<(usize, usize)>,
    /// Per tree: the state at the start of each node's turn.
    snapshots: Vec<HashMap<NodeId, EpisodeState>>,
    /// The live branches.
    frontier: Vec<Branch>,
    /// Finished chains: (tree, leaf node, episode).
    leaves: Vec<(usize, NodeId, Episode)>,
    /// Branches started so far (each one's sampling seed index).
    counter: usize,
    /// Every fork so far.
    forks: Vec<ArenaFork>,
}

impl Forest<'_, '_> {
    /// Plants `tree_count` trees per prompt, each with `initial_rollouts` chains on the
    /// frontier.
    fn plant(&mut self, tree_count: usize, initial_rollouts: usize) -> Result<()> {
        let (policy, make_env) = (self.policy, self.make_env);
        for (p, spec) in self.templates.iter().enumerate() {
            for j in 0..tree_count {
                let t = self.trees.len();
                let tree = ExpansionTree::with_initial_rollouts(initial_rollouts);
                let mut snaps = HashMap::new();
                snaps.insert(tree.root(), EpisodeState::start(spec.clone(), make_env()?)?);
                let children = tree.node(tree.root()).map_err(err)?.children.clone();
                for node in children {
                    let mut state = snaps[&tree.root()].fork(policy, make_env()?)?;
                    state.set_seed(turn_seed(self.seed ^ spec.seed, self.counter));
                    state.set_id(format!("{}-t{j}-n{}", spec.id, node.0));
                    self.counter += 1;
                    snaps.insert(node, state.fork(policy, make_env()?)?);
                    self.frontier.push(Branch {
                        tree: t,
                        node,
                        state,
                    });
                }
                self.trees.push(tree);
                self.owner.push((p, j));
                self.snapshots.push(snaps);
            }
        }
        Ok(())
    }

    /// One expansion iteration's picks: `settings` picks the nodes of every tree to fork, and
    /// each fork starts a branch on the frontier from its source node's snapshot.
    fn fork_all(&mut self, settings: &TreeExpansionSettings, rng: &mut SplitMix64) -> Result<()> {
        let (policy, make_env) = (self.policy, self.make_env);
        for t in 0..self.trees.len() {
            let entropies: Vec<f64> = self.trees[t].nodes().iter().map(|n| n.entropy).collect();
            let pairs = self.trees[t].expand(settings, rng).map_err(err)?;
            let (p, j) = self.owner[t];
            for (selected, new) in pairs {
                let source = resume_source(&self.trees[t], settings.fork, selected, new)?;
                let snap = self.snapshots[t]
                    .get(&source)
                    .context("a forked node has no snapshot")?;
                let resume_at = self.trees[t].node(new).map_err(err)?.turn_start;
                ensure!(
                    snap.response_len() == resume_at,
                    "tree {t}: the fork of node {} resumes at {} tokens but its source state \
                     holds {}",
                    selected.0,
                    resume_at,
                    snap.response_len()
                );
                let mut state = snap.fork(policy, make_env()?)?;
                state.set_seed(turn_seed(self.seed ^ self.templates[p].seed, self.counter));
                state.set_id(format!("{}-t{j}-n{}", self.templates[p].id, new.0));
                self.counter += 1;
                self.snapshots[t].insert(new, state.fork(policy, make_env()?)?);
                self.forks
                    .push((t, selected, new, entropies[selected.0], resume_at));
                self.frontier.push(Branch {
                    tree: t,
                    node: new,
                    state,
                });
            }
        }
        Ok(())
    }

    /// Runs every live branch of every tree, batched turn by turn, until each has finished as a
    /// leaf; each turn is recorded as a node (with its snapshot for later forks).
    fn run_frontier(&mut self) -> Result<()> {
        let (policy, make_env) = (self.policy, self.make_env);
        let (frontier, trees) = (&mut self.frontier, &mut self.trees);
        while !frontier.is_empty() {
            let mut refs: Vec<&mut EpisodeState> =
                frontier.iter_mut().map(|b| &mut b.state).collect();
            step_turn(policy, &mut refs, self.decoding)?;
            let mut next = Vec::with_capacity(frontier.len());
            for mut b in frontier.drain(..) {
                let tree = &mut trees[b.tree];
                let lps = b.state.last_turn_logprobs();
                // A finished chain's last node ends where its response ends (a length cut may
                // leave an observation after the last agent turn).
                let end = if b.state.is_done() {
                    b.state.response_len()
                } else {
                    b.state.agent_end()
                };
                tree.record_generation(b.node, &lps, end).map_err(err)?;
                if b.state.is_done() {
                    tree.mark_leaf(b.node).map_err(err)?;
                    self.leaves.push((b.tree, b.node, b.state.finish()));
                } else {
                    let child = tree
                        .add_tool_child(b.node, b.state.response_len())
                        .map_err(err)?;
                    self.snapshots[b.tree].insert(child, b.state.fork(policy, make_env()?)?);
                    b.node = child;
                    next.push(b);
                }
            }
            *frontier = next;
        }
        Ok(())
    }
}

/// The grown trees in the core's advantage layout: reachable nodes in breadth-first order
/// (parents first), the kept leaves' episodes sorted by tree and node, and the forks in that
/// numbering.
fn advantage_layout(
    trees: &[ExpansionTree],
    owner: &[(usize, usize)],
    leaves: Vec<(usize, NodeId, Episode)>,
    forks: Vec<ArenaFork>,
    prompts: usize,
) -> TreeRollout {
    // Core advantage layout: reachable nodes in breadth-first order (parents first).
    let mut maps: Vec<HashMap<NodeId, usize>> = Vec::with_capacity(trees.len());
    let mut out_trees: Vec<RolloutTree> = Vec::with_capacity(trees.len());
    for (t, tree) in trees.iter().enumerate() {
        let order = tree.bfs();
        let map: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let nodes = order
            .iter()
            .map(|&id| {
                let n = &tree.nodes()[id.0];
                let parent_end = n.parent.map(|p| tree.nodes()[p.0].end).unwrap_or(0);
                TreeNode {
                    parent: n.parent.map(|p| map[&p]),
                    is_leaf: n.is_leaf,
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
        out_trees.push(RolloutTree {
            group: owner[t].0,
            nodes,
        });
        maps.push(map);
    }
    let mut leaves: Vec<(usize, usize, Episode)> = leaves
        .into_iter()
        .map(|(t, n, ep)| (t, maps[t][&n], ep))
        .collect();
    leaves.sort_by_key(|(t, n, _)| (*t, *n));
    let mut episodes = Vec::with_capacity(leaves.len());
    let mut groups = Vec::with_capacity(leaves.len());
    let mut leaf_of = Vec::with_capacity(leaves.len());
    for (t, node, ep) in leaves {
        groups.push(owner[t].0);
        leaf_of.push((t, node));
        episodes.push(ep);
    }
    let forks = forks
        .into_iter()
        .map(|(t, selected, new, entropy, resume_at)| ForkRecord {
            tree: t,
            selected: maps[t].get(&selected).copied(),
            node: maps[t].get(&new).copied(),
            entropy,
            resume_at,
        })
        .collect();
    TreeRollout {
        episodes,
        groups,
        trees: TreeBatch {
            trees: out_trees,
            leaf_of,
            forks,
            prompts,
        },
    }
}

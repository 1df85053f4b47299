//! AT2PO entropy-guided tree expansion and Tree-GRPO random expansion (spec §6.1, §3.8).
//!
//! The rollout engine owns the tokens; this module owns the *bookkeeping* of a rollout tree:
//! which node is a child of which, which nodes are leaves, each node's entropy estimate, its
//! tool-call counter and where its last turn starts. On that structure it implements:
//!
//! - node entropy `H(n) = −(1/|y|) Σ log π(y_t)` over the tokens of the node's last generation
//!   call (the Monte-Carlo estimate of the AT2PO code, §6.1 step 2);
//! - the candidate set (non-leaf nodes including the root, whose entropy is 0), the score
//!   `score(n) = H(n) − α·max(0, |children(parent(n))| − 1)` (root: its own children count;
//!   α = 0.05 hard-coded in the AT2PO code) and the top-K selection (stable order, cycling through
//!   the ranking when there are fewer than K candidates), §6.1 step 3;
//! - forking ([`ForkRule`]): AT2PO creates a new **sibling** of the selected node (a new child of
//!   the root when the root is selected) that resumes from the selected node's turn start, so the
//!   selected turn is re-sampled (§6.1 step 4); Tree-GRPO creates a new **child** of the selected
//!   node that continues after the node's action and observation (selecting the root starts a new
//!   chain in that tree; upstream `gen_action_chain`, §3.8);
//! - the leaf budget `N = M + L·K`: prune random extra leaves (and the branches left empty) or
//!   duplicate the last leaf as its siblings, §6.1 step 5;
//! - Tree-GRPO's random expansion (uniform with replacement over root + non-leaf nodes) and its
//!   `k`-leaves-per-tree sampling (upstream `sample_leaf`: needs at least `k` leaves), §3.8.
//!
//! Node order: "stable order" in the code means the order of `get_non_leaf_nodes` / `get_all_leaves`,
//! i.e. the root first and then breadth-first over children in insertion order. [`ExpansionTree`]
//! enumerates in that same order.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{ControlError, SplitMix64};

/// Branching penalty α of the AT2PO score, hard-coded to 0.05 in the official code (§6.1).
pub const AT2PO_BRANCH_PENALTY: f64 = 0.05;

/// Index of a node inside one [`ExpansionTree`] (the root is `NodeId(0)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub usize);

/// How nodes are chosen for expansion (§6.1 `expansion_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpansionMode {
    /// AT2PO: top-K by entropy score with the branching penalty.
    #[default]
    Entropy,
    /// Tree-GRPO: uniform with replacement over root + non-leaf nodes.
    Random,
}

/// Where the new branch of a fork starts (§6.1 step 4 vs. §3.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ForkRule {
    /// AT2PO: a new sibling of the selected node that re-samples the node's own turn
    /// ([`ExpansionTree::fork`]).
    #[default]
    Sibling,
    /// Tree-GRPO: a new child of the selected node that continues after the node's action and
    /// observation ([`ExpansionTree::fork_child`]).
    Child,
}

/// Tree-rollout settings (§6.1, §8.2). Defaults are the official AT2PO script values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TreeExpansionSettings {
    /// `initial_rollouts` M: chains started from the root (AT2PO: 10; Tree-GRPO: 1 per tree).
    pub initial_rollouts: usize,
    /// `expansion_iterations` L (AT2PO: 2; Tree-GRPO `l`: 1).
    pub expansion_iterations: usize,
    /// `beam_size` K: nodes forked per tree per iteration (AT2PO: 6; Tree-GRPO `n`: 2).
    pub beam_size: usize,
    /// Branching penalty α of the entropy score (AT2PO: 0.05, hard-coded in the code).
    pub branch_penalty: f64,
    /// Node selection rule.
    pub mode: ExpansionMode,
    /// Where a fork's new branch starts.
    pub fork: ForkRule,
}

impl Default for TreeExpansionSettings {
    fn default() -> Self {
        Self {
            initial_rollouts: 10,
            expansion_iterations: 2,
            beam_size: 6,
            branch_penalty: AT2PO_BRANCH_PENALTY,
            mode: ExpansionMode::Entropy,
            fork: ForkRule::Sibling,
        }
    }
}

impl TreeExpansionSettings {
    /// Leaves per tree `N = M + L·K` (`samples_per_tree`, = `rollout.n`; 22 for AT2PO).
    pub fn samples_per_tree(&self) -> usize {
        self.initial_rollouts + self.expansion_iterations * self.beam_size
    }

    /// The validation / greedy configuration: M = 1, no expansion, N = 1 (§6.1 step 7).
    pub fn greedy(&self) -> Self {
        Self {
            initial_rollouts: 1,
            expansion_iterations: 0,
            beam_size: 1,
            ..self.clone()
        }
    }

    /// Checks that the settings can produce at least one leaf.
    pub fn validate(&self) -> Result<(), ControlError> {
        if self.initial_rollouts == 0 {
            return Err(ControlError::InvalidSetting {
                name: "initial_rollouts",
                reason: "must be at least 1",
            });
        }
        if !self.branch_penalty.is_finite() {
            return Err(ControlError::InvalidSetting {
                name: "branch_penalty",
                reason: "must be finite",
            });
        }
        Ok(())
    }
}

/// One node of a rollout tree: one turn (previous observation + this node's generation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TreeNode {
    /// Parent node (`None` for the root).
    pub parent: Option<NodeId>,
    /// Children in insertion order (pruned children are removed from this list).
    pub children: Vec<NodeId>,
    /// The node ended its chain (answer/EOS, tool failure, length limit).
    pub is_leaf: bool,
    /// MC entropy estimate: mean NLL of the tokens of the node's last generation call (root: 0).
    pub entropy: f64,
    /// Tool calls made on the path up to and including this node.
    pub tool_calls: u32,
    /// Response length (tokens after the prompt) at which this node's turn starts: the state a
    /// fork of this node resumes from (everything before it, incl. the previous observation).
    pub turn_start: usize,
    /// Response length after this node's generation (its context end).
    pub end: usize,
    /// Depth (root 0).
    pub depth: usize,
    /// `true` once the node has been pruned away (it stays in the arena, unreachable).
    pub pruned: bool,
    /// For leaves created by duplication (§6.1 step 5): the leaf they copy.
    pub duplicate_of: Option<NodeId>,
}

/// What [`ExpansionTree::balance_leaves`] did to reach the leaf budget.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeafBalance {
    /// Leaves pruned (with their emptied branches).
    pub pruned: Vec<NodeId>,
    /// Leaves created as duplicates of the last leaf.
    pub duplicated: Vec<NodeId>,
    /// The final leaves, root-first breadth-first order.
    pub leaves: Vec<NodeId>,
}

/// Arena-backed rollout tree bookkeeping (one tree per prompt).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpansionTree {
    nodes: Vec<TreeNode>,
}

impl Default for ExpansionTree {
    fn default() -> Self {
        Self::new()
    }
}

/// Mean negative log-likelihood of sampled tokens: the AT2PO node entropy estimate (§6.1 step 2).
///
/// Returns 0 for an empty slice (a generation call always yields ≥ 1 token, §1.2, so this only
/// happens for the root).
pub fn mean_nll(sampled_logprobs: &[f64]) -> f64 {
    if sampled_logprobs.is_empty() {
        return 0.0;
    }
    -sampled_logprobs.iter().sum::<f64>() / sampled_logprobs.len() as f64
}

impl ExpansionTree {
    /// A tree holding only the root (the prompt; entropy 0, not a leaf).
    pub fn new() -> Self {
        Self {
            nodes: vec![TreeNode {
                parent: None,
                children: Vec::new(),
                is_leaf: false,
                entropy: 0.0,
                tool_calls: 0,
                turn_start: 0,
                end: 0,
                depth: 0,
                pruned: false,
                duplicate_of: None,
            }],
        }
    }

    /// Phase 1 of §6.1: a root with `m` empty children (the M initial chains).
    pub fn with_initial_rollouts(m: usize) -> Self {
        let mut t = Self::new();
        for _ in 0..m {
            t.push_child(NodeId(0), 0, 0, 1);
        }
        t
    }

    /// The root id.
    pub fn root(&self) -> NodeId {
        NodeId(0)
    }

    /// Number of nodes in the arena (including pruned ones).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always `false`: a tree has at least its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> Result<&TreeNode, ControlError> {
        self.nodes.get(id.0).ok_or(ControlError::UnknownNode {
            id: id.0,
            len: self.nodes.len(),
        })
    }

    fn node_mut(&mut self, id: NodeId) -> Result<&mut TreeNode, ControlError> {
        let len = self.nodes.len();
        self.nodes
            .get_mut(id.0)
            .ok_or(ControlError::UnknownNode { id: id.0, len })
    }

    fn push_child(
        &mut self,
        parent: NodeId,
        turn_start: usize,
        tool_calls: u32,
        depth: usize,
    ) -> NodeId {
        let id = NodeId(self.nodes.len());
        self.nodes.push(TreeNode {
            parent: Some(parent),
            children: Vec::new(),
            is_leaf: false,
            entropy: self.nodes[parent.0].entropy,
            tool_calls,
            turn_start,
            end: turn_start,
            depth,
            pruned: false,
            duplicate_of: None,
        });
        self.nodes[parent.0].children.push(id);
        id
    }

    /// Adds the child created after `parent`'s tool call returned (§6.1 step 2): its turn starts at
    /// `turn_start` (= parent's end + observation length); its call counter is the parent's + 1.
    pub fn add_tool_child(
        &mut self,
        parent: NodeId,
        turn_start: usize,
    ) -> Result<NodeId, ControlError> {
        let p = self.node(parent)?;
        if p.is_leaf || p.pruned {
            return Err(ControlError::InvalidTreeOp {
                id: parent.0,
                reason: "a leaf or pruned node cannot get a child",
            });
        }
        if turn_start < p.end {
            return Err(ControlError::InvalidTreeOp {
                id: parent.0,
                reason: "the child's turn cannot start before the parent's context ends",
            });
        }
        let (calls, depth) = (p.tool_calls + 1, p.depth + 1);
        Ok(self.push_child(parent, turn_start, calls, depth))
    }

    /// Records one generation call of node `id` (§6.1 step 2): sets its entropy to the mean NLL of
    /// the sampled tokens' log-probs and its context end to `end`. Calling it again (a continuation
    /// after `finish_reason == length` or an injected warning) overwrites the entropy like the
    /// AT2PO code, while the turn start stays where the turn began (\[REC\] of §6.1 step 4).
    pub fn record_generation(
        &mut self,
        id: NodeId,
        sampled_logprobs: &[f64],
        end: usize,
    ) -> Result<(), ControlError> {
        let n = self.node_mut(id)?;
        if end < n.turn_start {
            return Err(ControlError::InvalidTreeOp {
                id: id.0,
                reason: "context end before the turn start",
            });
        }
        n.entropy = mean_nll(sampled_logprobs);
        n.end = end;
        Ok(())
    }

    /// Marks `id` as a leaf (its chain ended).
    pub fn mark_leaf(&mut self, id: NodeId) -> Result<(), ControlError> {
        self.node_mut(id)?.is_leaf = true;
        Ok(())
    }

    /// Overrides a node's entropy (e.g. when the engine computed it elsewhere).
    pub fn set_entropy(&mut self, id: NodeId, entropy: f64) -> Result<(), ControlError> {
        self.node_mut(id)?.entropy = entropy;
        Ok(())
    }

    /// Reachable nodes, root first, breadth-first over children in insertion order.
    pub fn bfs(&self) -> Vec<NodeId> {
        let mut out = Vec::with_capacity(self.nodes.len());
        let mut queue = VecDeque::from([NodeId(0)]);
        while let Some(id) = queue.pop_front() {
            out.push(id);
            queue.extend(self.nodes[id.0].children.iter().copied());
        }
        out
    }

    /// Expansion candidates: reachable non-leaf nodes including the root, in [`Self::bfs`] order.
    pub fn candidates(&self) -> Vec<NodeId> {
        self.bfs()
            .into_iter()
            .filter(|id| !self.nodes[id.0].is_leaf)
            .collect()
    }

    /// Reachable leaves in [`Self::bfs`] order.
    pub fn leaves(&self) -> Vec<NodeId> {
        self.bfs()
            .into_iter()
            .filter(|id| self.nodes[id.0].is_leaf)
            .collect()
    }

    /// AT2PO expansion score `H(n) − α·max(0, |children(parent(n))| − 1)`; for the root the
    /// children count is its own (§6.1 step 3).
    pub fn score(&self, id: NodeId, alpha: f64) -> Result<f64, ControlError> {
        let n = self.node(id)?;
        let siblings = match n.parent {
            Some(p) => self.nodes[p.0].children.len(),
            None => n.children.len(),
        };
        Ok(n.entropy - alpha * siblings.saturating_sub(1) as f64)
    }

    /// AT2PO top-K selection (§6.1 step 3): candidates ranked by [`Self::score`] descending, ties
    /// kept in candidate order (stable sort); with fewer than `k` candidates the ranking is repeated
    /// cyclically (`[a, b]`, k = 5 → `[a, b, a, b, a]`). Empty when there is no candidate.
    pub fn select_top_k(&self, k: usize, alpha: f64) -> Vec<NodeId> {
        let mut scored: Vec<(NodeId, f64)> = self
            .candidates()
            .into_iter()
            .map(|id| (id, self.score(id, alpha).unwrap_or(f64::NEG_INFINITY)))
            .collect();
        if scored.is_empty() {
            return Vec::new();
        }
        // Stable sort, descending; NaN scores rank last.
        scored.sort_by(|a, b| {
            b.1.partial_cmp(&a.1)
                .unwrap_or_else(|| a.1.is_nan().cmp(&b.1.is_nan()))
        });
        scored.iter().map(|(id, _)| *id).cycle().take(k).collect()
    }

    /// Tree-GRPO random expansion (§3.8): `k` nodes drawn uniformly **with replacement** among the
    /// root and the non-leaf nodes. Empty when there is no candidate.
    pub fn select_random(&self, k: usize, rng: &mut SplitMix64) -> Vec<NodeId> {
        let c = self.candidates();
        if c.is_empty() {
            return Vec::new();
        }
        (0..k).map(|_| c[rng.below(c.len())]).collect()
    }

    /// Selects per `settings.mode` ([`Self::select_top_k`] or [`Self::select_random`]).
    pub fn select(&self, settings: &TreeExpansionSettings, rng: &mut SplitMix64) -> Vec<NodeId> {
        match settings.mode {
            ExpansionMode::Entropy => {
                self.select_top_k(settings.beam_size, settings.branch_penalty)
            }
            ExpansionMode::Random => self.select_random(settings.beam_size, rng),
        }
    }

    /// Forks `id` (§6.1 step 4): a new **sibling** (a new child of the root when `id` is the root)
    /// whose context is `id`'s context up to its turn start, so the turn is re-sampled. The new node
    /// inherits the entropy and depth of `id` and its tool-call counter minus one (floored at 0).
    /// The engine must then copy `response[..turn_start]` of `id`'s path and run Phase 2 from it.
    pub fn fork(&mut self, id: NodeId) -> Result<NodeId, ControlError> {
        let n = self.node(id)?;
        if n.pruned {
            return Err(ControlError::InvalidTreeOp {
                id: id.0,
                reason: "cannot fork a pruned node",
            });
        }
        let (parent, turn_start, calls, depth, entropy) = match n.parent {
            Some(p) => (
                p,
                n.turn_start,
                n.tool_calls.saturating_sub(1),
                n.depth,
                n.entropy,
            ),
            None => (id, 0, 0, 1, n.entropy),
        };
        let new = self.push_child(parent, turn_start, calls, depth);
        self.nodes[new.0].entropy = entropy;
        Ok(new)
    }

    /// Tree-GRPO fork (§3.8, upstream `gen_action_chain` from an expanded node): a new **child**
    /// of `id` that continues after `id`'s action and observation, i.e. its turn starts where
    /// `id`'s existing children start (every child of a node resumes from the same observation).
    /// Selecting the root starts a new chain in the tree (turn start 0). The new node's call
    /// counter and depth are those of `id`'s children; its entropy is `id`'s. The engine must
    /// then copy `response[..turn_start]` of a path through `id` and run Phase 2 from it.
    ///
    /// Errors for a leaf, a pruned node, or a non-root node without a child (its observation is
    /// unknown).
    pub fn fork_child(&mut self, id: NodeId) -> Result<NodeId, ControlError> {
        let n = self.node(id)?;
        if n.pruned || n.is_leaf {
            return Err(ControlError::InvalidTreeOp {
                id: id.0,
                reason: "a leaf or pruned node cannot be continued",
            });
        }
        let (turn_start, calls, depth) = if n.parent.is_none() {
            (0, 0, 1)
        } else {
            let Some(&first) = n.children.first() else {
                return Err(ControlError::InvalidTreeOp {
                    id: id.0,
                    reason: "a node without a child has no observation to continue from",
                });
            };
            let c = &self.nodes[first.0];
            (c.turn_start, c.tool_calls, c.depth)
        };
        Ok(self.push_child(id, turn_start, calls, depth))
    }

    /// One expansion iteration (§6.1 step 3–4, §3.8): selects per `settings` and forks every
    /// selected node per `settings.fork` (a node selected twice is forked twice). Returns
    /// `(selected, new node)` pairs in selection order; the engine then runs Phase 2 on the new
    /// nodes.
    pub fn expand(
        &mut self,
        settings: &TreeExpansionSettings,
        rng: &mut SplitMix64,
    ) -> Result<Vec<(NodeId, NodeId)>, ControlError> {
        let selected = self.select(settings, rng);
        selected
            .into_iter()
            .map(|n| {
                match settings.fork {
                    ForkRule::Sibling => self.fork(n),
                    ForkRule::Child => self.fork_child(n),
                }
                .map(|new| (n, new))
            })
            .collect()
    }

    /// Builds a tree from nodes kept elsewhere (e.g. a stored rollout tree), checking that node 0
    /// is the only root and that parent and children links agree.
    pub fn from_nodes(nodes: Vec<TreeNode>) -> Result<Self, ControlError> {
        let len = nodes.len();
        if nodes.first().is_none_or(|r| r.parent.is_some()) {
            return Err(ControlError::InvalidTreeOp {
                id: 0,
                reason: "node 0 must exist and be the root (no parent)",
            });
        }
        for (i, n) in nodes.iter().enumerate() {
            if i > 0 {
                let Some(p) = n.parent else {
                    return Err(ControlError::InvalidTreeOp {
                        id: i,
                        reason: "only node 0 may lack a parent",
                    });
                };
                let parent = nodes
                    .get(p.0)
                    .ok_or(ControlError::UnknownNode { id: p.0, len })?;
                if !n.pruned && !parent.children.contains(&NodeId(i)) {
                    return Err(ControlError::InvalidTreeOp {
                        id: i,
                        reason: "node is not listed among its parent's children",
                    });
                }
            }
            for c in &n.children {
                let child = nodes
                    .get(c.0)
                    .ok_or(ControlError::UnknownNode { id: c.0, len })?;
                if child.parent != Some(NodeId(i)) {
                    return Err(ControlError::InvalidTreeOp {
                        id: c.0,
                        reason: "child's parent link does not point back",
                    });
                }
            }
        }
        Ok(Self { nodes })
    }

    /// All nodes of the arena (including pruned ones), indexed by [`NodeId`].
    pub fn nodes(&self) -> &[TreeNode] {
        &self.nodes
    }

    /// Brings the number of reachable leaves to exactly `target` (§6.1 step 5):
    /// - more leaves: keep `target` of them chosen uniformly at random, prune the others and every
    ///   ancestor left without children (never the root);
    /// - fewer: append duplicates of the last leaf (breadth-first order) as its siblings.
    ///
    /// Errors when duplication is impossible (no leaf, or the last leaf is the root).
    pub fn balance_leaves(
        &mut self,
        target: usize,
        rng: &mut SplitMix64,
    ) -> Result<LeafBalance, ControlError> {
        let leaves = self.leaves();
        let mut out = LeafBalance::default();
        if leaves.len() > target {
            let keep = rng.sample_indices(leaves.len(), target);
            let mut kept = vec![false; leaves.len()];
            for i in keep {
                kept[i] = true;
            }
            for (i, &leaf) in leaves.iter().enumerate() {
                if !kept[i] {
                    self.prune_branch(leaf);
                    out.pruned.push(leaf);
                }
            }
        } else if leaves.len() < target {
            let Some(&last) = leaves.last() else {
                return Err(ControlError::LeafBudget {
                    target,
                    have: 0,
                    reason: "no leaf to duplicate",
                });
            };
            let Some(parent) = self.nodes[last.0].parent else {
                return Err(ControlError::LeafBudget {
                    target,
                    have: leaves.len(),
                    reason: "the only leaf is the root, which has no parent to hold duplicates",
                });
            };
            for _ in leaves.len()..target {
                let mut copy = self.nodes[last.0].clone();
                copy.children.clear();
                copy.duplicate_of = Some(last);
                let id = NodeId(self.nodes.len());
                self.nodes.push(copy);
                self.nodes[parent.0].children.push(id);
                out.duplicated.push(id);
            }
        }
        out.leaves = self.leaves();
        Ok(out)
    }

    /// Tree-GRPO leaf sampling (§3.8, upstream `sample_leaf`): keep `k` leaves of the tree chosen
    /// uniformly at random, prune the others and the branches they leave empty. Unlike
    /// [`Self::balance_leaves`] it never duplicates: fewer than `k` leaves is an error (upstream
    /// asserts), since a duplicate has no rollout of its own.
    pub fn sample_leaves(
        &mut self,
        k: usize,
        rng: &mut SplitMix64,
    ) -> Result<LeafBalance, ControlError> {
        let have = self.leaves().len();
        if have < k {
            return Err(ControlError::LeafBudget {
                target: k,
                have,
                reason: "fewer leaves than the number to sample",
            });
        }
        self.balance_leaves(k, rng)
    }

    /// Removes `leaf` from its parent and walks up removing ancestors left childless (not the root).
    fn prune_branch(&mut self, leaf: NodeId) {
        let mut cur = leaf;
        while let Some(parent) = self.nodes[cur.0].parent {
            self.nodes[parent.0].children.retain(|c| *c != cur);
            self.nodes[cur.0].pruned = true;
            if !self.nodes[parent.0].children.is_empty() || self.nodes[parent.0].parent.is_none() {
                break;
            }
            cur = parent;
        }
    }

    /// Nodes on the path root → `id` (both included).
    pub fn path(&self, id: NodeId) -> Result<Vec<NodeId>, ControlError> {
        self.node(id)?;
        let mut p = vec![id];
        let mut cur = id;
        while let Some(parent) = self.nodes[cur.0].parent {
            p.push(parent);
            cur = parent;
        }
        p.reverse();
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{TOL, assert_all_close};
    use proptest::prelude::*;

    /// The §3.6 tree: root → {n1 (H .9), n2 (H .3, leaf), n3 (H .6, leaf)}; n1 → {n11 (H .7),
    /// n12 (H .5, leaf)}; n11 → {n111 (H .2, leaf)}.
    fn spec_tree() -> (ExpansionTree, [NodeId; 7]) {
        let mut t = ExpansionTree::with_initial_rollouts(3);
        let root = t.root();
        let (n1, n2, n3) = (NodeId(1), NodeId(2), NodeId(3));
        for (id, h) in [(n1, 0.9), (n2, 0.3), (n3, 0.6)] {
            t.set_entropy(id, h).unwrap();
        }
        t.mark_leaf(n2).unwrap();
        t.mark_leaf(n3).unwrap();
        let n11 = t.add_tool_child(n1, 0).unwrap();
        let n12 = t.add_tool_child(n1, 0).unwrap();
        t.set_entropy(n11, 0.7).unwrap();
        t.set_entropy(n12, 0.5).unwrap();
        t.mark_leaf(n12).unwrap();
        let n111 = t.add_tool_child(n11, 0).unwrap();
        t.set_entropy(n111, 0.2).unwrap();
        t.mark_leaf(n111).unwrap();
        (t, [root, n1, n2, n3, n11, n12, n111])
    }

    #[test]
    fn spec_6_1_scores_and_top2() {
        let (t, [root, n1, _, _, n11, _, _]) = spec_tree();
        assert_eq!(t.candidates(), vec![root, n1, n11]);
        let s: Vec<f64> = t
            .candidates()
            .iter()
            .map(|&id| t.score(id, 0.05).unwrap())
            .collect();
        assert_all_close(&s, &[-0.1, 0.8, 0.65], TOL, "scores");
        assert_eq!(t.select_top_k(2, 0.05), vec![n1, n11]);
    }

    #[test]
    fn top_k_repeats_ranking_when_short() {
        let (t, [root, n1, _, _, n11, _, _]) = spec_tree();
        assert_eq!(t.select_top_k(5, 0.05), vec![n1, n11, root, n1, n11]);
        assert!(ExpansionTree::new().select_top_k(0, 0.05).is_empty());
    }

    #[test]
    fn ties_keep_bfs_order() {
        let mut t = ExpansionTree::with_initial_rollouts(2);
        t.set_entropy(NodeId(1), 0.5).unwrap();
        t.set_entropy(NodeId(2), 0.5).unwrap();
        assert_eq!(t.select_top_k(2, 0.05), vec![NodeId(1), NodeId(2)]);
    }

    #[test]
    fn node_entropy_is_mean_nll() {
        let mut t = ExpansionTree::with_initial_rollouts(1);
        t.record_generation(NodeId(1), &[-0.5, -1.0, -1.5], 3)
            .unwrap();
        assert!((t.node(NodeId(1)).unwrap().entropy - 1.0).abs() < TOL);
        assert_eq!(mean_nll(&[]), 0.0);
    }

    #[test]
    fn fork_creates_sibling_resuming_at_turn_start() {
        let mut t = ExpansionTree::with_initial_rollouts(1);
        let n1 = NodeId(1);
        t.record_generation(n1, &[-1.0], 10).unwrap();
        let c = t.add_tool_child(n1, 25).unwrap();
        t.record_generation(c, &[-0.2, -0.4], 40).unwrap();
        let f = t.fork(c).unwrap();
        let fnode = t.node(f).unwrap();
        assert_eq!(fnode.parent, Some(n1));
        assert_eq!(fnode.turn_start, 25);
        assert_eq!(fnode.tool_calls, 0);
        assert_eq!(fnode.depth, 2);
        assert!((fnode.entropy - 0.3).abs() < TOL);
        // Forking the root adds a fresh chain under the root.
        let r = t.fork(t.root()).unwrap();
        assert_eq!(t.node(r).unwrap().parent, Some(t.root()));
        assert_eq!(t.node(r).unwrap().turn_start, 0);
    }

    #[test]
    fn fork_child_continues_after_the_observation() {
        let mut t = ExpansionTree::with_initial_rollouts(1);
        let n1 = NodeId(1);
        t.record_generation(n1, &[-1.0], 10).unwrap();
        // n1's tool call returned a 15-token observation: its child starts at 25.
        let c = t.add_tool_child(n1, 25).unwrap();
        t.record_generation(c, &[-0.2, -0.4], 40).unwrap();
        t.mark_leaf(c).unwrap();
        let f = t.fork_child(n1).unwrap();
        let fnode = t.node(f).unwrap();
        assert_eq!(
            fnode.parent,
            Some(n1),
            "a child of the selected node, not a sibling"
        );
        assert_eq!(
            fnode.turn_start, 25,
            "after n1's action (10) and observation (15)"
        );
        assert_eq!((fnode.tool_calls, fnode.depth), (1, 2));
        assert!((fnode.entropy - 1.0).abs() < TOL);
        // The sibling rule on the same node re-samples n1's own turn instead.
        let s = t.fork(n1).unwrap();
        assert_eq!(t.node(s).unwrap().parent, Some(t.root()));
        assert_eq!(t.node(s).unwrap().turn_start, 0);
        // Selecting the root starts a new chain in the tree.
        let r = t.fork_child(t.root()).unwrap();
        assert_eq!(t.node(r).unwrap().parent, Some(t.root()));
        assert_eq!(
            (t.node(r).unwrap().turn_start, t.node(r).unwrap().depth),
            (0, 1)
        );
        // Leaves and childless inner nodes cannot be continued.
        assert!(t.fork_child(c).is_err());
        assert!(t.fork_child(f).is_err());
    }

    #[test]
    fn expand_follows_the_fork_rule() {
        let (t0, [_, n1, _, _, n11, _, _]) = spec_tree();
        for (fork, parents) in [
            (ForkRule::Sibling, [Some(NodeId(0)), Some(n1)]),
            (ForkRule::Child, [Some(n1), Some(n11)]),
        ] {
            let mut t = t0.clone();
            let settings = TreeExpansionSettings {
                beam_size: 2,
                fork,
                ..TreeExpansionSettings::default()
            };
            let pairs = t.expand(&settings, &mut SplitMix64::new(0)).unwrap();
            assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), vec![n1, n11]);
            let got: Vec<_> = pairs.iter().map(|p| t.node(p.1).unwrap().parent).collect();
            assert_eq!(got, parents, "{fork:?}");
        }
    }

    #[test]
    fn sample_leaves_keeps_k_and_never_duplicates() {
        let (mut t, _) = spec_tree();
        let mut rng = SplitMix64::new(5);
        let err = t.clone().sample_leaves(5, &mut rng).unwrap_err();
        assert!(matches!(
            err,
            ControlError::LeafBudget {
                target: 5,
                have: 4,
                ..
            }
        ));
        let b = t.sample_leaves(3, &mut rng).unwrap();
        assert_eq!((b.leaves.len(), b.pruned.len()), (3, 1));
        assert!(b.duplicated.is_empty());
        assert_eq!(t.leaves(), b.leaves);
        // Sampling every leaf changes nothing.
        let before = t.clone();
        assert!(t.sample_leaves(3, &mut rng).unwrap().pruned.is_empty());
        assert_eq!(t, before);
    }

    #[test]
    fn budget_and_greedy() {
        let s = TreeExpansionSettings::default();
        assert_eq!(s.samples_per_tree(), 22);
        let g = s.greedy();
        assert_eq!(
            (
                g.initial_rollouts,
                g.expansion_iterations,
                g.samples_per_tree()
            ),
            (1, 0, 1)
        );
        let parsed: TreeExpansionSettings = serde_json::from_str(r#"{"beam_size": 2}"#).unwrap();
        assert_eq!(parsed.samples_per_tree(), 14);
        assert!(serde_json::from_str::<TreeExpansionSettings>(r#"{"beam": 2}"#).is_err());
    }

    #[test]
    fn prune_and_duplicate() {
        let (mut t, [_, n1, _, _, n11, n12, n111]) = spec_tree();
        let mut rng = SplitMix64::new(3);
        let b = t.balance_leaves(6, &mut rng).unwrap();
        assert_eq!(b.duplicated.len(), 2);
        assert_eq!(b.leaves.len(), 6);
        // The last leaf in BFS order is n111; duplicates are its siblings.
        for d in &b.duplicated {
            assert_eq!(t.node(*d).unwrap().parent, Some(n11));
            assert_eq!(t.node(*d).unwrap().duplicate_of, Some(n111));
        }
        let b = t.balance_leaves(1, &mut rng).unwrap();
        assert_eq!(b.leaves.len(), 1);
        assert_eq!(b.pruned.len(), 5);
        // A node whose only leaves were pruned disappears with them.
        if !b.leaves.contains(&n12) && !b.leaves.iter().any(|l| t.path(*l).unwrap().contains(&n1)) {
            assert!(t.node(n1).unwrap().pruned);
        }
        assert!(ExpansionTree::new().balance_leaves(2, &mut rng).is_err());
    }

    #[test]
    fn expand_and_rebuild() {
        let (mut t, [_, n1, _, _, n11, _, _]) = spec_tree();
        let settings = TreeExpansionSettings {
            beam_size: 2,
            ..TreeExpansionSettings::default()
        };
        let pairs = t.expand(&settings, &mut SplitMix64::new(0)).unwrap();
        assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), vec![n1, n11]);
        // Fork of n1 is a new child of the root; fork of n11 a new child of n1.
        assert_eq!(t.node(pairs[0].1).unwrap().parent, Some(t.root()));
        assert_eq!(t.node(pairs[1].1).unwrap().parent, Some(n1));
        let rebuilt = ExpansionTree::from_nodes(t.nodes().to_vec()).unwrap();
        assert_eq!(rebuilt, t);
        let mut broken = t.nodes().to_vec();
        broken[1].parent = Some(NodeId(4));
        assert!(ExpansionTree::from_nodes(broken).is_err());
        assert!(ExpansionTree::from_nodes(Vec::new()).is_err());
    }

    #[test]
    fn random_selection_is_uniform_with_replacement() {
        let (t, ids) = spec_tree();
        let mut rng = SplitMix64::new(11);
        let sel = t.select_random(300, &mut rng);
        assert_eq!(sel.len(), 300);
        for &id in &[ids[0], ids[1], ids[4]] {
            let c = sel.iter().filter(|&&x| x == id).count();
            assert!(c > 60, "each candidate drawn about 100 times, got {c}");
        }
        assert!(sel.iter().all(|id| [ids[0], ids[1], ids[4]].contains(id)));
    }

    /// Builds a random tree from a list of (parent-choice, leaf?) steps.
    fn random_tree(steps: &[(usize, bool)]) -> ExpansionTree {
        let mut t = ExpansionTree::new();
        for &(p, leaf) in steps {
            let cands = t.candidates();
            if cands.is_empty() {
                break;
            }
            let parent = cands[p % cands.len()];
            let end = t.node(parent).unwrap().end;
            let c = t.add_tool_child(parent, end).unwrap();
            if leaf {
                t.mark_leaf(c).unwrap();
            }
        }
        t
    }

    proptest! {
        #[test]
        fn top_k_returns_exactly_k(steps in prop::collection::vec((0usize..8, any::<bool>()), 0..20), k in 0usize..12) {
            let t = random_tree(&steps);
            // The root is never a leaf here, so there is always ≥ 1 candidate.
            prop_assert_eq!(t.select_top_k(k, 0.05).len(), k);
        }

        #[test]
        fn leaf_budget_reaches_exactly_n(steps in prop::collection::vec((0usize..8, any::<bool>()), 1..20), n in 1usize..30, seed in any::<u64>()) {
            let mut t = random_tree(&steps);
            // Ensure at least one non-root leaf exists.
            if t.leaves().is_empty() {
                let c = t.add_tool_child(t.root(), 0).unwrap();
                t.mark_leaf(c).unwrap();
            }
            let mut rng = SplitMix64::new(seed);
            let b = t.balance_leaves(n, &mut rng).unwrap();
            prop_assert_eq!(b.leaves.len(), n);
            prop_assert_eq!(t.leaves().len(), n);
        }
    }
}

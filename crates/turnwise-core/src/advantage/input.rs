//! The plain input of every estimator: [`AdvantageBatch`] = rollouts (+ trees for AT2PO).

use serde::{Deserialize, Serialize};

use super::AdvantageError;

/// `turn_id` value of a token inserted by the environment (observation, injected text): loss
/// mask 0 (§1.1).
pub const OBSERVATION: i32 = -1;

/// One rollout (trajectory) of a group, reduced to what the advantage estimators read.
///
/// Tokens are the *response* tokens in order (agent segments and observations, §1.1);
/// `turn_id[k]` is the agent-turn index `0..num_turns` of token `k`, or [`OBSERVATION`] (`-1`)
/// for an environment token. The loss mask is `turn_id >= 0`. Turn `num_turns - 1` is the final
/// (answer) turn, turns `0..num_turns - 1` are process (tool-call) turns (§0.3, 0-based here).
///
/// Only `group`, `num_turns`, `turn_id` and `outcome` are read by every estimator; the other
/// fields are inputs of particular estimators and may stay empty / `None` otherwise:
///
/// | field | used by |
/// |---|---|
/// | `tree` | `tree_grpo` (tree label inside the group), `at2po` (index into [`AdvantageBatch::trees`]) |
/// | `leaf` | `at2po` (node index of this rollout's leaf) |
/// | `turn_rewards` | `mt_grpo` (one per turn), `mt_grpo_code` (first entry), `gae` (placed at turn ends) |
/// | `info_gain` | `igpo`, `a2tgpo` (one per process turn: `num_turns - 1`) |
/// | `token_rewards`, `values` | `gae` (one per token) |
/// | `step_rewards`, `anchors` | `gigpo`, `t2po` (one per turn = env step); `anchors` also `mt_grpo` with `state_key = "anchor"` |
/// | `step_scores` | `gigpo`, `t2po` (optional per-step episode score) |
/// | `anchor_scopes` | `gigpo`, `t2po` (optional: anchors group only within their scope) |
///
/// Build one with [`Rollout::new`] (turn count from `turn_id`) or [`Rollout::with_turns`] (no
/// tokens: only per-turn advantages are then meaningful) and the `with_*` setters.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Rollout {
    /// Prompt group (rollouts of the same prompt share it): the GRPO group.
    pub group: usize,
    /// Tree id: Tree-GRPO tree label within the group; AT2PO index into [`AdvantageBatch::trees`].
    pub tree: Option<usize>,
    /// AT2PO: index of this rollout's leaf node in its tree.
    pub leaf: Option<usize>,
    /// Number of agent turns `T_i` (≥ every `turn_id + 1`).
    pub num_turns: usize,
    /// Per response token: agent turn index, or `-1` for observation tokens.
    pub turn_id: Vec<i32>,
    /// Outcome reward `R(τ_i)` (the GRPO score).
    pub outcome: f64,
    /// Per agent turn: turn-level reward (MT-GRPO `R_{i,k}`, MT-PPO `R^I_k`).
    pub turn_rewards: Vec<f64>,
    /// Per process turn (`num_turns - 1` entries): information gain `ig_{i,t}` (§4).
    pub info_gain: Vec<f64>,
    /// GAE: explicit per-token rewards; if `None` they are placed from `turn_rewards` and
    /// `outcome` (§3.3).
    pub token_rewards: Option<Vec<f64>>,
    /// GAE: critic values per token.
    pub values: Option<Vec<f64>>,
    /// GiGPO / T2PO: environment reward of every step (= turn).
    pub step_rewards: Vec<f64>,
    /// GiGPO / T2PO: anchor observation (state) of every step (= turn).
    pub anchors: Vec<String>,
    /// GiGPO / T2PO: the scope of every step's anchor, or empty for one scope for all steps.
    /// Two step samples share an anchor group only when their scopes are equal, whether the
    /// anchors are compared exactly or by similarity: a scope holds what must match exactly
    /// for two steps to be in one state (the search world's step depth and earlier
    /// observations) when the anchor is the last observation only.
    pub anchor_scopes: Vec<String>,
    /// GiGPO / T2PO: episode score of every step sample (the value VERL-agent sums from the
    /// sample's token rewards). `None` = `Σ step_rewards` for every step. Set it to reproduce the
    /// code's per-step invalid-action penalty, which lowers only the invalid step's sample (§2.6).
    pub step_scores: Option<Vec<f64>>,
    /// GiGPO / T2PO: a penalty taken off each step's **discounted return** `R_k` after
    /// discounting (verl-agent's `apply_invalid_action_penalty`: only the penalised step's return
    /// falls; earlier steps' returns keep `Σ_{j≥k} γ^{j−k} r_j` of the unpenalised rewards).
    /// Empty = no penalty. The episode term reads [`Rollout::step_scores`], which carries the
    /// same penalty on the penalised step's sample.
    pub step_penalties: Vec<f64>,
}

impl Rollout {
    /// A rollout of prompt group `group` with per-token `turn_id`s and an outcome reward;
    /// `num_turns` is `max(turn_id) + 1` (0 when there is no agent token).
    pub fn new(group: usize, turn_id: Vec<i32>, outcome: f64) -> Self {
        let num_turns = turn_id
            .iter()
            .copied()
            .max()
            .map_or(0, |m| (m + 1).max(0) as usize);
        Self {
            group,
            num_turns,
            turn_id,
            outcome,
            ..Self::default()
        }
    }

    /// A rollout without tokens: `num_turns` turns and an outcome. Estimators then return empty
    /// per-token advantages and only the per-turn ones (handy for tests and diagnostics).
    pub fn with_turns(group: usize, num_turns: usize, outcome: f64) -> Self {
        Self {
            group,
            num_turns,
            outcome,
            ..Self::default()
        }
    }

    /// Sets the per-turn rewards.
    pub fn with_turn_rewards(mut self, turn_rewards: Vec<f64>) -> Self {
        self.turn_rewards = turn_rewards;
        self
    }

    /// Sets the per-process-turn information gains.
    pub fn with_info_gain(mut self, info_gain: Vec<f64>) -> Self {
        self.info_gain = info_gain;
        self
    }

    /// Sets the tree id.
    pub fn with_tree(mut self, tree: usize) -> Self {
        self.tree = Some(tree);
        self
    }

    /// Sets the tree id and the leaf node (AT2PO).
    pub fn with_leaf(mut self, tree: usize, leaf: usize) -> Self {
        self.tree = Some(tree);
        self.leaf = Some(leaf);
        self
    }

    /// Sets the per-token critic values (GAE).
    pub fn with_values(mut self, values: Vec<f64>) -> Self {
        self.values = Some(values);
        self
    }

    /// Sets explicit per-token rewards (GAE).
    pub fn with_token_rewards(mut self, token_rewards: Vec<f64>) -> Self {
        self.token_rewards = Some(token_rewards);
        self
    }

    /// Sets the per-step environment rewards and anchor observations (GiGPO / T2PO).
    pub fn with_steps(mut self, step_rewards: Vec<f64>, anchors: Vec<String>) -> Self {
        self.step_rewards = step_rewards;
        self.anchors = anchors;
        self
    }

    /// Sets per-step penalties on the discounted step returns (GiGPO / T2PO): see
    /// [`Rollout::step_penalties`].
    pub fn with_step_penalties(mut self, penalties: Vec<f64>) -> Self {
        self.step_penalties = penalties;
        self
    }

    /// Loss mask of the response tokens: `turn_id >= 0`.
    pub fn loss_mask(&self) -> Vec<bool> {
        self.turn_id.iter().map(|&t| t >= 0).collect()
    }

    /// Index of the last token of turn `turn`, if the turn has tokens.
    pub fn last_token_of_turn(&self, turn: usize) -> Option<usize> {
        self.turn_id
            .iter()
            .rposition(|&t| t >= 0 && t as usize == turn)
    }
}

/// One node of an AT2PO rollout tree (§3.6): one turn = (observation of the parent's tool call,
/// if any) + the segment generated at this node. The root (node 0) holds the prompt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TreeNode {
    /// Parent node index (`None` only for the root). Must be smaller than the node's own index.
    pub parent: Option<usize>,
    /// Whether the node is a leaf (answer/EOS, failure or length limit, §3.6).
    pub is_leaf: bool,
    /// Monte-Carlo entropy estimate `H` of the node's sampled tokens (mean NLL, §6.1).
    pub entropy: f64,
    /// Raw outcome reward of a leaf (the episode's outcome score). `at2po` rejects a tree with a
    /// leaf whose reward is `None`; inner nodes have none.
    pub reward: Option<f64>,
    /// Number of response tokens this node adds on the root→leaf token sequence (its
    /// *incremental* span: previous observation + own generation). Usually 0 for the root.
    pub span: usize,
}

/// One AT2PO rollout tree (one per prompt). Node 0 is the root; nodes are stored in an order
/// where every parent precedes its children (what [`RolloutTree::add_child`] produces).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutTree {
    /// Prompt group of the tree.
    pub group: usize,
    /// Nodes, root first.
    pub nodes: Vec<TreeNode>,
}

impl RolloutTree {
    /// A tree with only a root node that spans `root_span` response tokens (usually 0).
    pub fn new(group: usize, root_span: usize) -> Self {
        Self {
            group,
            nodes: vec![TreeNode {
                span: root_span,
                ..TreeNode::default()
            }],
        }
    }

    /// Adds a non-leaf child of `parent` and returns its index.
    pub fn add_child(&mut self, parent: usize, entropy: f64, span: usize) -> usize {
        self.nodes.push(TreeNode {
            parent: Some(parent),
            is_leaf: false,
            entropy,
            reward: None,
            span,
        });
        self.nodes.len() - 1
    }

    /// Adds a leaf child of `parent` with a raw outcome reward and returns its index.
    pub fn add_leaf(&mut self, parent: usize, entropy: f64, span: usize, reward: f64) -> usize {
        self.nodes.push(TreeNode {
            parent: Some(parent),
            is_leaf: true,
            entropy,
            reward: Some(reward),
            span,
        });
        self.nodes.len() - 1
    }

    /// Children of every node, in index order.
    pub fn children(&self) -> Vec<Vec<usize>> {
        let mut children = vec![Vec::new(); self.nodes.len()];
        for (i, node) in self.nodes.iter().enumerate() {
            if let Some(p) = node.parent
                && p < i
            {
                children[p].push(i);
            }
        }
        children
    }

    /// Node indices from the root to `node` (inclusive).
    pub fn path_to(&self, node: usize) -> Vec<usize> {
        let mut path = vec![node];
        let mut cur = node;
        while let Some(p) = self.nodes.get(cur).and_then(|n| n.parent) {
            path.push(p);
            cur = p;
        }
        path.reverse();
        path
    }
}

/// The input of every estimator: a batch of rollouts (any number of prompt groups), plus the
/// rollout trees when the estimator is `at2po`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageBatch {
    /// The rollouts; outputs are aligned with this order.
    pub rollouts: Vec<Rollout>,
    /// AT2PO rollout trees, referenced by [`Rollout::tree`].
    pub trees: Vec<RolloutTree>,
}

impl AdvantageBatch {
    /// A batch of rollouts without trees.
    pub fn new(rollouts: Vec<Rollout>) -> Self {
        Self {
            rollouts,
            trees: Vec::new(),
        }
    }

    /// A batch of leaf rollouts and their trees (AT2PO).
    pub fn with_trees(rollouts: Vec<Rollout>, trees: Vec<RolloutTree>) -> Self {
        Self { rollouts, trees }
    }
}

/// Errors out on the first NaN/infinite value of `xs`.
pub(crate) fn check_finite(
    estimator: &'static str,
    rollout: usize,
    field: &'static str,
    xs: &[f64],
) -> Result<(), AdvantageError> {
    match xs.iter().find(|x| !x.is_finite()) {
        Some(&value) => Err(AdvantageError::NonFinite {
            estimator,
            rollout,
            field,
            value,
        }),
        None => Ok(()),
    }
}

/// Errors out unless `got == expected`.
pub(crate) fn check_len(
    estimator: &'static str,
    rollout: usize,
    field: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), AdvantageError> {
    if got == expected {
        Ok(())
    } else {
        Err(AdvantageError::LengthMismatch {
            estimator,
            rollout,
            field,
            got,
            expected,
        })
    }
}

/// Checks what every estimator relies on: finite numbers everywhere, `turn_id` values in
/// `-1..num_turns`.
pub(crate) fn validate_common(
    estimator: &'static str,
    batch: &AdvantageBatch,
) -> Result<(), AdvantageError> {
    for (i, r) in batch.rollouts.iter().enumerate() {
        check_finite(estimator, i, "outcome", &[r.outcome])?;
        check_finite(estimator, i, "turn_rewards", &r.turn_rewards)?;
        check_finite(estimator, i, "info_gain", &r.info_gain)?;
        check_finite(estimator, i, "step_rewards", &r.step_rewards)?;
        check_finite(estimator, i, "step_penalties", &r.step_penalties)?;
        if let Some(v) = &r.step_scores {
            check_finite(estimator, i, "step_scores", v)?;
        }
        if let Some(v) = &r.token_rewards {
            check_finite(estimator, i, "token_rewards", v)?;
        }
        if let Some(v) = &r.values {
            check_finite(estimator, i, "values", v)?;
        }
        if let Some((k, &t)) = r
            .turn_id
            .iter()
            .enumerate()
            .find(|&(_, &t)| t < OBSERVATION || (t >= 0 && t as usize >= r.num_turns))
        {
            return Err(AdvantageError::InvalidRollout {
                estimator,
                rollout: i,
                message: format!(
                    "turn_id[{k}] = {t} is outside -1..{} (num_turns = {})",
                    r.num_turns, r.num_turns
                ),
            });
        }
    }
    Ok(())
}

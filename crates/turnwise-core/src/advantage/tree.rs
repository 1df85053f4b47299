//! §3.6 AT2PO turn-wise credit assignment over rollout trees [CODE ATPO rollout file
//! `compute_value_from_children`, `generate_sequences` PHASE 6; PAPER at2po.md §4.2, §5.3.2].
//!
//! 1. Leaf values: raw outcome, or per tree `(r − mean) / (std_p + ε)` (`leaf_value_norm`).
//! 2. Node values bottom-up: `child_softmax` `V(n) = Σ_c softmax_c(H(c)) V(c)`, `child_mean`,
//!    or `leaf_mean`; a non-leaf without valid children gets 0.
//! 3. Node advantages: `node_value`, `diff_parent`, `diff_global`, `diff_localglobal` (root:
//!    `A = V(root)`), or `vanilla` = GRPO over the tree's leaves.
//! 4. Tokens: walking root→leaf, every node's incremental span gets `A(node)`.

use serde::{Deserialize, Serialize};

use crate::range::Range;

use super::contract::{MetricDoc, Metrics, Needs};
use super::error::settings_result;
use super::input::{check_finite, validate_common};
use super::kernels::{StdKind, grpo_normalize, mean, softmax, std_population};
use super::output::TreeValues;
use super::{
    AdvantageBatch, AdvantageError, AdvantageOutput, Estimator, RolloutAdvantage, RolloutTree,
};

/// How an inner node's value is computed from its subtree (`node_value_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeValueMode {
    /// Entropy-softmax weighted children (official script; the paper's "child-weighted").
    #[default]
    ChildSoftmax,
    /// Mean of the children's values.
    ChildMean,
    /// Mean over all valued leaves of the subtree (TreeRL).
    LeafMean,
}

/// How a node's advantage is derived from the values (`node_adv_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeAdvMode {
    /// `A(n) = V(n)` (default, best in the paper).
    #[default]
    NodeValue,
    /// `V(n) − V(parent)` (TD).
    DiffParent,
    /// `V(n) − V(root)`.
    DiffGlobal,
    /// `(V(n) − V(root)) + (V(n) − V(parent))` (TreeRL).
    DiffLocalglobal,
    /// Plain GRPO over the tree's leaf rewards (`std_u + ε`), the same for every token.
    Vanilla,
}

/// Settings of `at2po`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct At2poConfig {
    /// Normalize leaf rewards per tree with `std_p + ε` (`leaf_value_norm`, default true).
    pub leaf_value_norm: bool,
    /// Inner node value rule.
    pub node_value_mode: NodeValueMode,
    /// Node advantage rule.
    pub node_adv_mode: NodeAdvMode,
    /// ε of the leaf normalization (and of `vanilla` GRPO).
    pub epsilon: f64,
}

impl Default for At2poConfig {
    fn default() -> Self {
        Self {
            leaf_value_norm: true,
            node_value_mode: NodeValueMode::ChildSoftmax,
            node_adv_mode: NodeAdvMode::NodeValue,
            epsilon: 1e-6,
        }
    }
}

fn tree_err(tree: usize, message: String) -> AdvantageError {
    AdvantageError::InvalidTree {
        estimator: "at2po",
        tree,
        message,
    }
}

/// Checks the tree shape: node 0 is the only root, parents precede children, finite numbers.
pub(crate) fn validate_tree(t: usize, tree: &RolloutTree) -> Result<(), AdvantageError> {
    if tree.nodes.is_empty() {
        return Err(tree_err(t, "has no node".to_string()));
    }
    for (i, n) in tree.nodes.iter().enumerate() {
        match (i, n.parent) {
            (0, None) => {}
            (0, Some(_)) => return Err(tree_err(t, "node 0 (root) has a parent".to_string())),
            (_, None) => return Err(tree_err(t, format!("node {i} has no parent"))),
            (_, Some(p)) if p >= i => {
                return Err(tree_err(t, format!("node {i} has parent {p} ≥ {i}")));
            }
            _ => {}
        }
        check_finite("at2po", t, "tree node entropy", &[n.entropy])?;
        if let Some(r) = n.reward {
            check_finite("at2po", t, "tree leaf reward", &[r])?;
        }
    }
    Ok(())
}

/// Node values `V(n)` of one tree (`None` for leaves without reward). Leaves get their
/// (normalized) reward, inner nodes follow `mode`.
pub fn tree_node_values(
    tree: &RolloutTree,
    leaf_value_norm: bool,
    mode: NodeValueMode,
    epsilon: f64,
) -> Vec<Option<f64>> {
    let n = tree.nodes.len();
    let leaves: Vec<usize> = (0..n)
        .filter(|&i| tree.nodes[i].is_leaf && tree.nodes[i].reward.is_some())
        .collect();
    let raw: Vec<f64> = leaves
        .iter()
        .map(|&i| tree.nodes[i].reward.unwrap_or(0.0))
        .collect();
    let leaf_vals: Vec<f64> = if leaf_value_norm {
        // numpy np.std (population) + ε; a single leaf or all-equal leaves give 0.
        let (m, s) = (mean(&raw), std_population(&raw));
        raw.iter().map(|r| (r - m) / (s + epsilon)).collect()
    } else {
        raw
    };
    let mut value: Vec<Option<f64>> = vec![None; n];
    for (&i, v) in leaves.iter().zip(&leaf_vals) {
        value[i] = Some(*v);
    }
    let children = tree.children();
    // Leaves in every subtree, for `leaf_mean`.
    let mut subtree_leaves: Vec<Vec<f64>> = vec![Vec::new(); n];
    // Parents precede children: a reverse sweep visits children first.
    for i in (0..n).rev() {
        if tree.nodes[i].is_leaf {
            if let Some(v) = value[i] {
                subtree_leaves[i].push(v);
            }
            continue;
        }
        let mut below = Vec::new();
        for &c in &children[i] {
            below.extend_from_slice(&subtree_leaves[c]);
        }
        let valid: Vec<(f64, f64)> = children[i]
            .iter()
            .filter_map(|&c| value[c].map(|v| (v, tree.nodes[c].entropy)))
            .collect();
        value[i] = Some(match mode {
            _ if valid.is_empty() && mode != NodeValueMode::LeafMean => 0.0,
            NodeValueMode::ChildSoftmax => {
                let h: Vec<f64> = valid.iter().map(|&(_, h)| h).collect();
                softmax(&h)
                    .iter()
                    .zip(&valid)
                    .map(|(w, &(v, _))| w * v)
                    .sum()
            }
            NodeValueMode::ChildMean => mean(&valid.iter().map(|&(v, _)| v).collect::<Vec<_>>()),
            NodeValueMode::LeafMean => mean(&below),
        });
        subtree_leaves[i] = below;
    }
    value
}

/// Node advantages of one tree from its values (`vanilla` is handled by the estimator).
pub fn tree_node_advantages(
    tree: &RolloutTree,
    values: &[Option<f64>],
    mode: NodeAdvMode,
) -> Vec<f64> {
    let v = |i: usize| values[i].unwrap_or(0.0);
    let root = v(0);
    (0..tree.nodes.len())
        .map(|i| match tree.nodes[i].parent {
            None => root,
            Some(p) => match mode {
                NodeAdvMode::NodeValue | NodeAdvMode::Vanilla => v(i),
                NodeAdvMode::DiffParent => v(i) - v(p),
                NodeAdvMode::DiffGlobal => v(i) - root,
                NodeAdvMode::DiffLocalglobal => (v(i) - root) + (v(i) - v(p)),
            },
        })
        .collect()
}

impl Estimator for At2poConfig {
    fn name(&self) -> &'static str {
        "at2po"
    }

    fn validate(&self) -> Result<(), AdvantageError> {
        let mut p = Vec::new();
        Range::StdEpsilon.check(&mut p, "epsilon", self.epsilon);
        settings_result("at2po", p)
    }

    fn needs(&self) -> Needs {
        Needs {
            trees: true,
            ..Needs::default()
        }
    }

    /// The size of the node values below the roots, the turn credit: whether credit reaches
    /// the loss.
    fn metrics(&self, batch: &AdvantageBatch, out: &AdvantageOutput) -> Metrics {
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
        let mut m = Metrics::new();
        if !node_values.is_empty() {
            m.insert(
                "tree/node_value/abs_mean".into(),
                node_values.iter().sum::<f64>() / node_values.len() as f64,
            );
        }
        m
    }

    fn metric_docs(&self) -> &'static [MetricDoc] {
        &[MetricDoc {
            key: "tree/node_value/abs_mean",
            label: "tree node value |V|",
        }]
    }

    fn estimate(&self, batch: &AdvantageBatch) -> Result<AdvantageOutput, AdvantageError> {
        let name = self.name();
        validate_common(name, batch)?;
        let mut trees = Vec::with_capacity(batch.trees.len());
        for (t, tree) in batch.trees.iter().enumerate() {
            validate_tree(t, tree)?;
            // A leaf without a reward would silently drop out of every node value (and with all
            // of them missing every advantage is 0): the caller must fill them in.
            if let Some(i) = (0..tree.nodes.len())
                .find(|&i| tree.nodes[i].is_leaf && tree.nodes[i].reward.is_none())
            {
                return Err(tree_err(
                    t,
                    format!(
                        "leaf {i} has no reward: every leaf needs its episode's outcome reward \
                         before node values can be computed"
                    ),
                ));
            }
            let values = tree_node_values(
                tree,
                self.leaf_value_norm,
                self.node_value_mode,
                self.epsilon,
            );
            let advantages = if self.node_adv_mode == NodeAdvMode::Vanilla {
                let leaves: Vec<usize> = (0..tree.nodes.len())
                    .filter(|&i| tree.nodes[i].is_leaf && tree.nodes[i].reward.is_some())
                    .collect();
                let raw: Vec<f64> = leaves
                    .iter()
                    .filter_map(|&i| tree.nodes[i].reward)
                    .collect();
                let mut a = vec![0.0; tree.nodes.len()];
                for (&i, g) in
                    leaves
                        .iter()
                        .zip(grpo_normalize(&raw, StdKind::Unbiased, self.epsilon))
                {
                    a[i] = g;
                }
                a
            } else {
                tree_node_advantages(tree, &values, self.node_adv_mode)
            };
            trees.push(TreeValues {
                values: values.iter().map(|v| v.unwrap_or(0.0)).collect(),
                advantages,
            });
        }
        let mut rollouts = Vec::with_capacity(batch.rollouts.len());
        for (i, r) in batch.rollouts.iter().enumerate() {
            let missing = |field| AdvantageError::MissingInput {
                estimator: name,
                rollout: i,
                field,
            };
            let t = r.tree.ok_or_else(|| missing("tree"))?;
            let leaf = r.leaf.ok_or_else(|| missing("leaf"))?;
            let invalid = |message: String| AdvantageError::InvalidRollout {
                estimator: name,
                rollout: i,
                message,
            };
            let tree = batch.trees.get(t).ok_or_else(|| {
                invalid(format!(
                    "tree {t} does not exist ({} trees)",
                    batch.trees.len()
                ))
            })?;
            let node = tree
                .nodes
                .get(leaf)
                .ok_or_else(|| invalid(format!("leaf {leaf} is not a node of tree {t}")))?;
            if !node.is_leaf {
                return Err(invalid(format!("node {leaf} of tree {t} is not a leaf")));
            }
            let path = tree.path_to(leaf);
            let adv = &trees[t].advantages;
            let vanilla = self.node_adv_mode == NodeAdvMode::Vanilla;
            let node_adv = |n: usize| if vanilla { adv[leaf] } else { adv[n] };
            let span: usize = path.iter().map(|&n| tree.nodes[n].span).sum();
            if span != r.turn_id.len() {
                return Err(AdvantageError::LengthMismatch {
                    estimator: name,
                    rollout: i,
                    field: "turn_id (vs. the spans on the root→leaf path)",
                    got: r.turn_id.len(),
                    expected: span,
                });
            }
            if path.len() - 1 != r.num_turns {
                return Err(invalid(format!(
                    "num_turns = {} but the root→leaf path has {} turn nodes",
                    r.num_turns,
                    path.len() - 1
                )));
            }
            let mut tokens = Vec::with_capacity(span);
            for &n in &path {
                tokens.extend(std::iter::repeat_n(node_adv(n), tree.nodes[n].span));
            }
            rollouts.push(RolloutAdvantage {
                tokens,
                turns: path[1..].iter().map(|&n| node_adv(n)).collect(),
                ..RolloutAdvantage::default()
            });
        }
        Ok(AdvantageOutput {
            estimator: name.to_string(),
            rollouts,
            trees,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantage::Rollout;
    use crate::test_util::{TOL, assert_all_close, assert_close};

    /// The §3.6 worked example; returns the tree and the node ids
    /// `[root, n1, n2, n3, n11, n12, n111]`.
    fn example() -> (RolloutTree, [usize; 7]) {
        let mut t = RolloutTree::new(0, 0);
        let n1 = t.add_child(0, 0.9, 2); // n1 gen: 2 tokens
        let n2 = t.add_leaf(0, 0.3, 2, 0.0);
        let n3 = t.add_leaf(0, 0.6, 2, 1.0);
        let n11 = t.add_child(n1, 0.7, 3); // obs (1) + gen (2)
        let n12 = t.add_leaf(n1, 0.5, 2, 0.0);
        let n111 = t.add_leaf(n11, 0.2, 2, 1.0); // obs (1) + gen (1)
        (t, [0, n1, n2, n3, n11, n12, n111])
    }

    #[test]
    fn spec_3_6_leaf_norm_and_child_softmax() {
        let (t, [root, n1, n2, n3, n11, n12, n111]) = example();
        let v = tree_node_values(&t, true, NodeValueMode::ChildSoftmax, 1e-6);
        let v = |i: usize| v[i].unwrap();
        assert_close(v(n2), -0.999998, TOL, "n2");
        assert_close(v(n3), 0.999998, TOL, "n3");
        assert_close(v(n12), -0.999998, TOL, "n12");
        assert_close(v(n111), 0.999998, TOL, "n111");
        assert_close(v(n11), 0.999998, TOL, "V(n11)");
        assert_close(v(n1), 0.099668, TOL, "V(n1)");
        assert_close(v(root), 0.127389, TOL, "V(root)");
    }

    #[test]
    fn spec_3_6_child_mean_and_leaf_mean() {
        let (t, [root, n1, _, _, n11, _, _]) = example();
        for mode in [NodeValueMode::ChildMean, NodeValueMode::LeafMean] {
            let v = tree_node_values(&t, true, mode, 1e-6);
            assert_close(v[n11].unwrap(), 0.999998, TOL, "V(n11)");
            assert_close(v[n1].unwrap(), 0.0, TOL, "V(n1)");
            assert_close(v[root].unwrap(), 0.0, TOL, "V(root)");
        }
    }

    #[test]
    fn spec_3_6_advantage_modes() {
        let (t, [_, n1, _, n3, n11, n12, n111]) = example();
        let v = tree_node_values(&t, true, NodeValueMode::ChildSoftmax, 1e-6);
        let modes = [
            NodeAdvMode::NodeValue,
            NodeAdvMode::DiffParent,
            NodeAdvMode::DiffGlobal,
            NodeAdvMode::DiffLocalglobal,
        ];
        let expected: [(usize, [f64; 4]); 5] = [
            (n1, [0.099668, -0.027721, -0.027721, -0.055443]),
            (n11, [0.999998, 0.90033, 0.872609, 1.772939]),
            (n111, [0.999998, 0.0, 0.872609, 0.872609]),
            (n12, [-0.999998, -1.099666, -1.127387, -2.227053]),
            (n3, [0.999998, 0.872609, 0.872609, 1.745218]),
        ];
        for (m, mode) in modes.iter().enumerate() {
            let a = tree_node_advantages(&t, &v, *mode);
            for (node, exp) in expected {
                assert_close(a[node], exp[m], TOL, &format!("{mode:?} node {node}"));
            }
        }
    }

    #[test]
    fn spec_3_6_token_assignment() {
        let (t, ids) = example();
        let n111 = ids[6];
        // tokens: n1 gen (2), obs, n11 gen (2), obs, n111 gen (1)
        let r = Rollout::new(0, vec![0, 0, -1, 1, 1, -1, 2], 1.0).with_leaf(0, n111);
        let batch = AdvantageBatch::with_trees(vec![r], vec![t]);
        let out = At2poConfig::default().estimate(&batch).unwrap();
        let (a, b) = (0.099668, 0.999998);
        assert_all_close(
            &out.rollouts[0].tokens,
            &[a, a, b, b, b, b, b],
            TOL,
            "tokens",
        );
        assert_all_close(&out.rollouts[0].turns, &[a, b, b], TOL, "turns");
        assert_close(out.trees[0].values[0], 0.127389, TOL, "logged V(root)");
    }

    #[test]
    fn vanilla_is_grpo_over_leaves() {
        let (t, ids) = example();
        let r = Rollout::new(0, vec![0, 0], 0.0).with_leaf(0, ids[2]); // n2, r = 0
        let cfg = At2poConfig {
            node_adv_mode: NodeAdvMode::Vanilla,
            ..At2poConfig::default()
        };
        let out = cfg
            .estimate(&AdvantageBatch::with_trees(vec![r], vec![t]))
            .unwrap();
        // leaves [0, 1, 0, 1]: GRPO std_u → ±0.866024
        assert_all_close(
            &out.rollouts[0].tokens,
            &[-0.866024, -0.866024],
            TOL,
            "vanilla",
        );
    }

    #[test]
    fn span_mismatch_is_an_error() {
        let (t, ids) = example();
        let r = Rollout::new(0, vec![0, 0, -1, 1], 1.0).with_leaf(0, ids[6]);
        let err = At2poConfig::default()
            .estimate(&AdvantageBatch::with_trees(vec![r], vec![t]))
            .unwrap_err();
        assert!(matches!(
            err,
            AdvantageError::LengthMismatch {
                rollout: 0,
                got: 4,
                expected: 7,
                ..
            }
        ));
    }

    #[test]
    fn a_leaf_without_reward_is_an_error() {
        let (mut t, ids) = example();
        let r = Rollout::new(0, vec![0, 0], 0.0).with_leaf(0, ids[2]);
        t.nodes[ids[5]].reward = None;
        let err = At2poConfig::default()
            .estimate(&AdvantageBatch::with_trees(vec![r], vec![t]))
            .unwrap_err();
        assert!(
            matches!(&err, AdvantageError::InvalidTree { tree: 0, message, .. }
                if message.contains(&format!("leaf {} has no reward", ids[5]))),
            "{err}"
        );
    }

    #[test]
    fn bad_tree_is_an_error() {
        let mut t = RolloutTree::new(0, 0);
        t.add_leaf(0, f64::NAN, 1, 1.0);
        let err = At2poConfig::default()
            .estimate(&AdvantageBatch::with_trees(vec![], vec![t]))
            .unwrap_err();
        assert!(matches!(err, AdvantageError::NonFinite { .. }), "{err}");
    }
}

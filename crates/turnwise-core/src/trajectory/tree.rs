//! Rollout trees whose nodes are turns (AT2PO, Tree-GRPO; spec §3.6, §6.1).
//!
//! Node 0 is the root: it holds the prompt and no tokens. Every other node is one agent turn:
//! the observation of the previous tool call (environment tokens, empty for a first turn)
//! followed by the turn's generation, stored as [`Segment`]s so a notice injected inside a turn
//! is kept exactly. Root-to-leaf paths read back as ordinary [`Trajectory`]s.

use serde::{Deserialize, Serialize};

use super::{FinishReason, Segment, TokenId, Trajectory, TrajectoryError, TurnRecord};

/// One node (turn) of a rollout tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TreeNode {
    /// Parent node index; `None` only for the root.
    pub parent: Option<usize>,
    /// Child node indices, in creation order.
    pub children: Vec<usize>,
    /// Whether this node ended its chain (answer, EOS, failure or length limit).
    pub is_leaf: bool,
    /// Node entropy `H(n)`: mean negative log-prob of the tokens it generated (spec §6.1).
    pub entropy: f64,
    /// The observation preceding this turn and the turn's generation, in order.
    pub segments: Vec<Segment>,
    /// The turn's record (absent for the root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<TurnRecord>,
    /// Outcome reward of the chain ending here (leaves only, once scored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
}

/// A tree of rollouts for one prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RolloutTree {
    /// Tree id (a prompt may have several trees, e.g. Tree-GRPO's m trees).
    pub id: String,
    /// The prompt's uid.
    pub prompt_uid: String,
    /// Chat-templated prompt ids.
    pub prompt_ids: Vec<TokenId>,
    /// Nodes; index 0 is the root.
    pub nodes: Vec<TreeNode>,
}

impl RolloutTree {
    /// A tree holding only its root.
    pub fn new(
        id: impl Into<String>,
        prompt_uid: impl Into<String>,
        prompt_ids: Vec<TokenId>,
    ) -> Self {
        Self {
            id: id.into(),
            prompt_uid: prompt_uid.into(),
            prompt_ids,
            nodes: vec![TreeNode {
                parent: None,
                children: Vec::new(),
                is_leaf: false,
                entropy: 0.0,
                segments: Vec::new(),
                record: None,
                reward: None,
            }],
        }
    }

    /// Index of the root.
    pub const ROOT: usize = 0;

    /// Adds a turn under `parent` and returns its index. The node entropy is the mean negative
    /// log-prob of the agent tokens in `segments`.
    ///
    /// # Panics
    /// If `parent` is not a node of this tree.
    pub fn add_child(
        &mut self,
        parent: usize,
        segments: Vec<Segment>,
        record: Option<TurnRecord>,
        is_leaf: bool,
    ) -> usize {
        assert!(
            parent < self.nodes.len(),
            "parent {parent} is not a node of tree {}",
            self.id
        );
        let (sum, n) = segments
            .iter()
            .fold((0.0f64, 0usize), |(s, n), seg| match seg {
                Segment::Agent(a) => (
                    s + a.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>(),
                    n + a.logprobs.len(),
                ),
                Segment::Env(_) => (s, n),
            });
        let entropy = if n == 0 { 0.0 } else { -sum / n as f64 };
        let idx = self.nodes.len();
        self.nodes.push(TreeNode {
            parent: Some(parent),
            children: Vec::new(),
            is_leaf,
            entropy,
            segments,
            record,
            reward: None,
        });
        self.nodes[parent].children.push(idx);
        idx
    }

    /// Leaf indices in node order.
    pub fn leaves(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].is_leaf)
            .collect()
    }

    /// Depth of a node (root 0, first turn 1).
    pub fn depth(&self, mut node: usize) -> usize {
        let mut d = 0;
        while let Some(p) = self.nodes[node].parent {
            node = p;
            d += 1;
        }
        d
    }

    /// Node indices from the first turn down to `node` (the root excluded).
    pub fn path_to(&self, node: usize) -> Vec<usize> {
        let mut path = Vec::new();
        let mut cur = node;
        while let Some(p) = self.nodes[cur].parent {
            path.push(cur);
            cur = p;
        }
        path.reverse();
        path
    }

    /// Reads the root-to-`leaf` chain as a trajectory: each node's segments in order, agent turn
    /// indices rewritten to the node's depth − 1, records taken from the nodes, the leaf's reward
    /// as the outcome.
    pub fn trajectory_for_leaf(&self, leaf: usize) -> Trajectory {
        let mut t = Trajectory::new(
            format!("{}/{leaf}", self.id),
            self.prompt_uid.clone(),
            self.prompt_ids.clone(),
        );
        for (turn, &n) in self.path_to(leaf).iter().enumerate() {
            let node = &self.nodes[n];
            for seg in &node.segments {
                let mut seg = seg.clone();
                if let Segment::Agent(a) = &mut seg {
                    a.turn = turn;
                }
                t.segments.push(seg);
            }
            if let Some(r) = &node.record {
                let mut r = r.clone();
                r.index = turn;
                t.turns.push(r);
            }
        }
        t.outcome_reward = self.nodes[leaf].reward;
        t.finish = FinishReason::Answered;
        t
    }

    /// Checks links: one root at index 0, every child's parent points back, no cycles, leaves
    /// have no children.
    pub fn validate(&self) -> Result<(), TrajectoryError> {
        let err = |node: usize, message: String| TrajectoryError::Tree {
            tree: self.id.clone(),
            node,
            message,
        };
        if self.nodes.is_empty() || self.nodes[0].parent.is_some() {
            return Err(err(0, "node 0 must be the root (no parent)".into()));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            match n.parent {
                None if i != 0 => return Err(err(i, "only the root may lack a parent".into())),
                Some(p) if p >= self.nodes.len() => {
                    return Err(err(i, format!("parent {p} does not exist")));
                }
                Some(p) if !self.nodes[p].children.contains(&i) => {
                    return Err(err(i, format!("parent {p} does not list it as a child")));
                }
                _ => {}
            }
            for &c in &n.children {
                if c >= self.nodes.len() || self.nodes[c].parent != Some(i) {
                    return Err(err(i, format!("child {c} does not point back")));
                }
            }
            if n.is_leaf && !n.children.is_empty() {
                return Err(err(i, "a leaf has children".into()));
            }
            if self.depth_bounded(i).is_none() {
                return Err(err(i, "cycle in parent links".into()));
            }
        }
        Ok(())
    }

    fn depth_bounded(&self, mut node: usize) -> Option<usize> {
        let mut d = 0;
        while let Some(p) = self.nodes[node].parent {
            node = p;
            d += 1;
            if d > self.nodes.len() {
                return None;
            }
        }
        Some(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trajectory::{AgentSegment, EnvSegment, TurnAction};

    fn turn_gen(lp: &[f32]) -> Segment {
        Segment::Agent(AgentSegment::new(
            0,
            (0..lp.len() as u32).collect(),
            lp.to_vec(),
        ))
    }

    fn rec(action: TurnAction) -> Option<TurnRecord> {
        Some(TurnRecord {
            index: 0,
            action,
            format_ok: true,
            observation: None,
            searches_so_far: 0,
            env_reward: None,
            anchor: None,
        })
    }

    /// The tree of spec §3.6 (entropies .9/.3/.6/.7/.5/.2).
    pub(crate) fn spec_tree() -> RolloutTree {
        let search = || rec(TurnAction::Search { query: "q".into() });
        let answer = || rec(TurnAction::Answer { text: "a".into() });
        let obs = || Segment::Env(EnvSegment { ids: vec![7, 7] });
        let mut t = RolloutTree::new("t0", "p0", vec![1]);
        let n1 = t.add_child(0, vec![turn_gen(&[-0.9])], search(), false);
        let n2 = t.add_child(0, vec![turn_gen(&[-0.3])], answer(), true);
        let n3 = t.add_child(0, vec![turn_gen(&[-0.6])], answer(), true);
        let n11 = t.add_child(n1, vec![obs(), turn_gen(&[-0.7])], search(), false);
        let n12 = t.add_child(n1, vec![obs(), turn_gen(&[-0.5])], answer(), true);
        let n111 = t.add_child(n11, vec![obs(), turn_gen(&[-0.2])], answer(), true);
        for (n, r) in [(n2, 0.0), (n3, 1.0), (n12, 0.0), (n111, 1.0)] {
            t.nodes[n].reward = Some(r);
        }
        t
    }

    #[test]
    fn spec_tree_structure_and_paths() {
        let t = spec_tree();
        t.validate().unwrap();
        assert_eq!(t.leaves(), vec![2, 3, 5, 6]);
        assert!((t.nodes[1].entropy - 0.9).abs() < 1e-6);
        assert_eq!(t.path_to(6), vec![1, 4, 6]);
        assert_eq!(t.depth(6), 3);
        let traj = t.trajectory_for_leaf(6);
        traj.validate().unwrap();
        let f = traj.flatten(false);
        assert_eq!(f.turn_id, vec![0, -1, -1, 1, -1, -1, 2]);
        assert_eq!(traj.outcome_reward, Some(1.0));
        assert_eq!(
            traj.turns.iter().map(|r| r.index).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
    }

    #[test]
    fn validate_catches_broken_links() {
        let mut t = spec_tree();
        t.nodes[4].parent = Some(2);
        assert!(
            t.validate()
                .unwrap_err()
                .to_string()
                .contains("child 4 does not point back")
        );
        let mut t = spec_tree();
        t.nodes[2].children.push(5);
        assert!(t.validate().is_err());
    }
}

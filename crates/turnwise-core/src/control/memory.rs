//! Memory context window for per-step samples (spec §1.3, §6.3; t2po.md §4 "Memory context
//! window"; verl-agent `env.history_length`).
//!
//! In T2PO / GiGPO each turn is a separate training sample whose prompt re-renders the task plus
//! the last `P` (search, information) pairs only. This is the pure bookkeeping of that window: the
//! caller pushes one record per finished turn and renders the prompt from [`MemoryWindow::window`].

use std::collections::VecDeque;

/// Default window length P (`env.history_length = 4` in the T2PO search script).
pub const DEFAULT_HISTORY_LENGTH: usize = 4;

/// The last `P` turn records of one environment (generic over what a record holds: text pairs,
/// token ids, …). Older turns are dropped as new ones arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryWindow<T> {
    capacity: usize,
    items: VecDeque<T>,
    total: usize,
}

impl<T> MemoryWindow<T> {
    /// A window keeping the last `capacity` turns (`capacity = 0` keeps none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            items: VecDeque::with_capacity(capacity),
            total: 0,
        }
    }

    /// A window of the default length P = 4.
    pub fn with_default_length() -> Self {
        Self::new(DEFAULT_HISTORY_LENGTH)
    }

    /// Records a finished turn, evicting the oldest one beyond P.
    pub fn push(&mut self, item: T) {
        self.total += 1;
        if self.capacity == 0 {
            return;
        }
        if self.items.len() == self.capacity {
            self.items.pop_front();
        }
        self.items.push_back(item);
    }

    /// The kept turns, oldest first.
    pub fn window(&self) -> impl ExactSizeIterator<Item = &T> {
        self.items.iter()
    }

    /// 0-based index (over all turns pushed) of the oldest kept turn: the prompt of turn K shows
    /// turns `first_index()..K`.
    pub fn first_index(&self) -> usize {
        self.total - self.items.len()
    }

    /// Number of turns pushed so far (kept or evicted).
    pub fn total_turns(&self) -> usize {
        self.total
    }

    /// Number of kept turns (≤ P).
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// No kept turn.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Forgets everything (new episode).
    pub fn clear(&mut self) {
        self.items.clear();
        self.total = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_last_p_turns() {
        let mut w = MemoryWindow::with_default_length();
        for t in 0..6 {
            w.push(t);
        }
        assert_eq!(w.window().copied().collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!((w.first_index(), w.total_turns(), w.len()), (2, 6, 4));
        let mut z = MemoryWindow::new(0);
        z.push("x");
        assert!(z.is_empty());
        assert_eq!(z.first_index(), 1);
        w.clear();
        assert!(w.is_empty());
    }
}

//! Blocking work over indices on a few scoped threads (HTTP requests to rollout servers and
//! judges, which wait on the network rather than on the CPU).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `f(0..n)` on at most `workers` threads, results in index order. Once `stop(&result)` holds
/// for a result no further index is started (those results are `None`).
pub fn map_indices<T: Send>(
    n: usize,
    workers: usize,
    f: impl Fn(usize) -> T + Sync,
    stop: impl Fn(&T) -> bool + Sync,
) -> Vec<Option<T>> {
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let cursor = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..workers.min(n).max(1) {
            scope.spawn(|| {
                loop {
                    let i = cursor.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let r = f(i);
                    if stop(&r) {
                        cursor.store(n, Ordering::Relaxed);
                    }
                    *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                }
            });
        }
    });
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_index_order_and_a_stop_ends_the_work() {
        let out = map_indices(50, 4, |i| i * 2, |_| false);
        assert_eq!(out, (0..50).map(|i| Some(i * 2)).collect::<Vec<_>>());
        // One worker: nothing after the stopping result is started.
        let out = map_indices(10, 1, |i| i, |&r| r == 3);
        assert_eq!(out[..4], [Some(0), Some(1), Some(2), Some(3)]);
        assert!(out[4..].iter().all(Option::is_none));
    }
}

//! Property tests of the estimators (§3 invariants).

use proptest::prelude::*;

use super::*;

fn scores(min_len: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(-5.0f64..5.0, min_len..12)
}

/// Per-token turn ids with `turns` agent turns, each of 1–3 tokens, observations between turns.
fn turn_ids(turns: usize) -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec((1usize..4, 0usize..3), turns).prop_map(|spec| {
        let mut ids = Vec::new();
        for (t, (n, obs)) in spec.into_iter().enumerate() {
            ids.extend(std::iter::repeat_n(t as i32, n));
            ids.extend(std::iter::repeat_n(-1, obs));
        }
        ids
    })
}

proptest! {
    #[test]
    fn group_baselines_sum_to_zero(s in scores(2)) {
        for a in [
            grpo_normalize(&s, StdKind::Unbiased, 1e-6),
            grpo_normalize(&s, StdKind::Population, 1e-6),
            dr_grpo_center(&s),
            rloo(&s),
        ] {
            prop_assert!(a.iter().sum::<f64>().abs() < 1e-8, "{:?}", a);
        }
    }

    #[test]
    fn grpo_invariant_to_shift(s in scores(1), c in -100.0f64..100.0) {
        let shifted: Vec<f64> = s.iter().map(|x| x + c).collect();
        let a = grpo_normalize(&s, StdKind::Unbiased, 1e-6);
        let b = grpo_normalize(&shifted, StdKind::Unbiased, 1e-6);
        if s.len() >= 2 {
            for (x, y) in a.iter().zip(&b) {
                prop_assert!((x - y).abs() < 1e-6, "{} vs {}", x, y);
            }
        }
    }

    #[test]
    fn a2tgpo_turn_groups_sum_to_zero(
        lens in prop::collection::vec(1usize..5, 2..8),
        igs in prop::collection::vec(-1.0f64..1.0, 40),
    ) {
        let mut k = 0;
        let rollouts: Vec<Rollout> = lens
            .iter()
            .map(|&t| {
                let ig: Vec<f64> = (0..t - 1).map(|_| { k += 1; igs[k - 1] }).collect();
                Rollout::with_turns(0, t, igs[k] ).with_info_gain(ig)
            })
            .collect();
        let out = A2tgpoConfig::default().estimate(&AdvantageBatch::new(rollouts.clone())).unwrap();
        let max_p = lens.iter().max().unwrap() - 1;
        for t in 0..max_p {
            let members: Vec<usize> = (0..rollouts.len()).filter(|&i| rollouts[i].info_gain.len() > t).collect();
            let raw: Vec<f64> = members.iter().map(|&i| rollouts[i].info_gain[t]).collect();
            let distinct = raw.iter().any(|x| (x - raw[0]).abs() > 1e-9);
            if members.len() >= 2 && distinct {
                let sum: f64 = members
                    .iter()
                    .map(|&i| out.rollouts[i].channels[&crate::advantage::Channel::NormalizedInfoGain][t])
                    .sum();
                prop_assert!(sum.abs() < 1e-6, "turn {}: {}", t, sum);
            }
        }
    }

    #[test]
    fn gigpo_anchor_groups_sum_to_zero(
        trajs in prop::collection::vec(prop::collection::vec((0usize..3, 0.0f64..1.0), 1..5), 2..6),
    ) {
        let rollouts: Vec<Rollout> = trajs
            .iter()
            .map(|steps| {
                let rewards = steps.iter().map(|&(_, r)| r).collect();
                let anchors = steps.iter().map(|&(a, _)| format!("state {a}")).collect();
                Rollout::with_turns(0, steps.len(), 0.0).with_steps(rewards, anchors)
            })
            .collect();
        let batch = AdvantageBatch::new(rollouts);
        let joint = GigpoConfig::default().estimate(&batch).unwrap();
        let episode = GigpoConfig { step_advantage_w: 0.0, ..GigpoConfig::default() }
            .estimate(&batch)
            .unwrap();
        let mut sums = std::collections::BTreeMap::<&str, f64>::new();
        for (i, r) in batch.rollouts.iter().enumerate() {
            for (k, a) in r.anchors.iter().enumerate() {
                let step = joint.rollouts[i].turns[k] - episode.rollouts[i].turns[k];
                *sums.entry(a.as_str()).or_default() += step;
            }
        }
        for (a, s) in sums {
            prop_assert!(s.abs() < 1e-6, "anchor {}: {}", a, s);
        }
    }

    #[test]
    fn gae_unit_discount_is_reward_to_go_minus_value(
        ids in (1usize..5).prop_flat_map(turn_ids),
        seed in prop::collection::vec((-1.0f64..1.0, -1.0f64..1.0), 20),
        skip in any::<bool>(),
    ) {
        let n = ids.len();
        let values: Vec<f64> = seed.iter().cycle().take(n).map(|p| p.1).collect();
        // rewards only on agent tokens (where §3.3 places them)
        let rewards: Vec<f64> = seed
            .iter()
            .cycle()
            .take(n)
            .zip(&ids)
            .map(|(p, &t)| if t >= 0 { p.0 } else { 0.0 })
            .collect();
        let r = Rollout::new(0, ids.clone(), 0.0).with_values(values.clone()).with_token_rewards(rewards.clone());
        let cfg = GaeConfig { whiten: false, skip_observations: skip, ..GaeConfig::default() };
        let out = cfg.estimate(&AdvantageBatch::new(vec![r])).unwrap();
        for t in 0..n {
            if ids[t] >= 0 {
                let rtg: f64 = rewards[t..].iter().sum();
                prop_assert!((out.rollouts[0].tokens[t] - (rtg - values[t])).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn mt_grpo_turn_advantages_sum_to_zero(
        g in 2usize..6,
        k in 1usize..4,
        flat in prop::collection::vec(0.0f64..1.0, 24),
    ) {
        let rewards: Vec<Vec<f64>> = (0..g).map(|i| flat[i * k..(i + 1) * k].to_vec()).collect();
        let (a, _) = mt_grpo_turn_advantages(&rewards, StdKind::Unbiased, 1e-6);
        for t in 0..k {
            let s: f64 = a.iter().map(|ai| ai[t]).sum();
            prop_assert!(s.abs() < 1e-8, "turn {}: {}", t, s);
        }
    }
}

//! Property tests of the policy losses (small sizes, f64).

use candle_core::{Device, Tensor, Var};
use proptest::prelude::*;

use super::agg::{AggOptions, agg_loss};
use super::policy::{PolicyLossConfig, PolicyLossInput, PolicyLossKind, compute_policy_loss};
use super::test_util::{rows, scalar};

fn tensor(v: &[f64], b: usize, l: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (b, l), &Device::Cpu).unwrap()
}

/// (B, L, logp, old_logp, advantages, mask) with values in the given ranges.
fn batch(
    logr_range: std::ops::Range<f64>,
) -> impl Strategy<Value = (usize, usize, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>)> {
    (1usize..4, 1usize..7).prop_flat_map(move |(b, l)| {
        let n = b * l;
        (
            Just(b),
            Just(l),
            prop::collection::vec(-8.0f64..0.0, n),
            prop::collection::vec(logr_range.clone(), n),
            prop::collection::vec(-3.0f64..3.0, n),
            prop::collection::vec(prop::bool::weighted(0.7), n),
        )
            .prop_map(|(b, l, old, logr, adv, mask)| {
                let logp: Vec<f64> = old.iter().zip(&logr).map(|(o, r)| o + r).collect();
                let mask: Vec<f64> = mask.into_iter().map(|m| f64::from(u8::from(m))).collect();
                (b, l, logp, old, adv, mask)
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// With w ≡ 1 (logp = old_logp) every PPO-family loss equals −agg(A).
    #[test]
    fn on_policy_loss_is_minus_agg_advantage((b, l, _lp, old, adv, mask) in batch(0.0..1e-9)) {
        let old_t = tensor(&old, b, l);
        let adv_t = tensor(&adv, b, l);
        let m_t = tensor(&mask, b, l);
        let c = tensor(&vec![1.1; b * l], b, l);
        for kind in PolicyLossKind::ALL {
            let cfg = PolicyLossConfig::named(kind.name());
            let input = PolicyLossInput::new(&old_t, &old_t, &adv_t, &m_t).with_channel(turnwise_core::advantage::Channel::ClipScale, &c);
            let out = compute_policy_loss(&input, &cfg).unwrap();
            let mode = cfg.resolve().unwrap().agg_mode;
            let want = scalar(&agg_loss(&adv_t.neg().unwrap(), &m_t, mode, &AggOptions::default()).unwrap());
            prop_assert!((scalar(&out.loss) - want).abs() < 1e-9, "{}: {} vs {}", kind, scalar(&out.loss), want);
        }
    }

    /// ∂loss/∂logp_t of the token-mean vanilla loss is −A_t·w_t/N on unclipped loss tokens and 0
    /// on clipped and non-loss tokens.
    #[test]
    fn vanilla_gradient_is_minus_a_w_over_n((b, l, lp, old, adv, mask) in batch(-0.5..0.5)) {
        let v = Var::from_tensor(&tensor(&lp, b, l)).unwrap();
        let old_t = tensor(&old, b, l);
        let (adv_t, m_t) = (tensor(&adv, b, l), tensor(&mask, b, l));
        let input = PolicyLossInput::new(v.as_tensor(), &old_t, &adv_t, &m_t);
        let out = compute_policy_loss(&input, &PolicyLossConfig::named("vanilla")).unwrap();
        let grads = out.loss.backward().unwrap();
        let g: Vec<f64> = rows(grads.get(v.as_tensor()).unwrap()).into_iter().flatten().collect();
        let n: f64 = mask.iter().sum();
        for (k, gk) in g.iter().enumerate() {
            let w = (lp[k] - old[k]).exp();
            let (a, m) = (adv[k], mask[k]);
            let clipped = (a > 0.0 && w > 1.2) || (a < 0.0 && w < 0.8);
            let near_edge = (w - 1.2).abs() < 1e-9 || (w - 0.8).abs() < 1e-9;
            if near_edge {
                continue;
            }
            let want = if m == 0.0 || clipped { 0.0 } else { -a * w / n };
            prop_assert!((gk - want).abs() < 1e-9, "token {k}: {gk} vs {want}");
        }
    }

    /// Every loss is finite (and Ok) for finite inputs, including large log-ratios.
    #[test]
    fn losses_are_finite((b, l, lp, old, adv, mask) in batch(-30.0..30.0)) {
        let (lp_t, old_t, adv_t, m_t) = (tensor(&lp, b, l), tensor(&old, b, l), tensor(&adv, b, l), tensor(&mask, b, l));
        let c = tensor(&vec![0.8; b * l], b, l);
        for kind in PolicyLossKind::ALL {
            let input = PolicyLossInput::new(&lp_t, &old_t, &adv_t, &m_t).with_channel(turnwise_core::advantage::Channel::ClipScale, &c);
            let out = compute_policy_loss(&input, &PolicyLossConfig::named(kind.name())).unwrap();
            prop_assert!(scalar(&out.loss).is_finite(), "{}", kind);
            prop_assert!(out.metrics.clip_bias_norm.is_finite());
        }
    }
}

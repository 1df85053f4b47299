//! The policy-loss fixture of the Python package: turnwise-model's losses and their gradients
//! on fixed pseudo-random f64 inputs, stored in `python/tests/fixtures/losses.json`, which the
//! Python tests (`python/tests/test_losses.py`) compare with the torch losses of
//! `turnwise.losses` (loss and autograd input gradients at 1e-6).
//!
//! The test fails when the committed fixture differs from what turnwise-model computes now
//! (beyond 1e-12), so a change to a loss cannot leave the Python losses checked against stale
//! numbers. `TURNWISE_REGEN_FIXTURES=1 cargo test -p turnwise-py --test loss_fixture` rewrites
//! the fixture.

use std::path::PathBuf;
use turnwise_core::advantage::Channel;

use candle_core::{Device, Tensor, Var};
use serde_json::{Value, json};
use turnwise_model::loss::{
    AggDenominators, PolicyLossConfig, PolicyLossInput, compute_policy_loss,
};

const B: usize = 4;
const L: usize = 10;

/// Loss masks: two turns with a tool span and a trailing turn; one turn then padding; a
/// leading tool token and three turns; a fully masked row (excluded from seq-mean modes).
const MASK: [[f64; L]; B] = [
    [1., 1., 1., 0., 0., 1., 1., 0., 1., 1.],
    [1., 1., 1., 1., 1., 1., 0., 0., 0., 0.],
    [0., 1., 1., 0., 1., 0., 0., 1., 1., 1.],
    [0.; L],
];

/// Explicit turn ids: row 0's second turn is split by an injected mask-0 token (ids keep it
/// one turn), row 2's ids follow its mask runs.
const TURN_ID: [[f64; L]; B] = [
    [0., 0., 0., -1., -1., 1., 1., -1., 1., 1.],
    [0., 0., 0., 0., 0., 0., -1., -1., -1., -1.],
    [-1., 0., 0., -1., 1., -1., -1., 2., 2., 2.],
    [-1.; L],
];

/// splitmix64: a fixed, dependency-free stream of uniform numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }

    fn rows(&mut self, lo: f64, hi: f64) -> Vec<Vec<f64>> {
        (0..B)
            .map(|_| (0..L).map(|_| self.uniform(lo, hi)).collect())
            .collect()
    }
}

/// One input set: `spread` is the range of the token log-ratios.
fn inputs(seed: u64, spread: f64) -> Value {
    let mut rng = Rng(seed);
    let old = rng.rows(-3.0, -0.1);
    let logr = rng.rows(-spread, spread);
    let logp: Vec<Vec<f64>> = old
        .iter()
        .zip(&logr)
        .map(|(o, r)| o.iter().zip(r).map(|(o, r)| o + r).collect())
        .collect();
    let adv = rng.rows(-1.5, 1.5);
    let clip_scale = rng.rows(0.7, 1.3);
    json!({
        "logp": logp,
        "old_logp": old,
        "advantages": adv,
        "loss_mask": MASK.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
        "turn_id": TURN_ID.iter().map(|r| r.to_vec()).collect::<Vec<_>>(),
        "clip_scale": clip_scale,
    })
}

fn tensor(v: &Value) -> Tensor {
    let rows: Vec<Vec<f64>> = serde_json::from_value(v.clone()).unwrap();
    let flat: Vec<f64> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), rows[0].len()), &Device::Cpu).unwrap()
}

/// One fixture case.
struct Case {
    name: String,
    /// `PolicyLossConfig` as JSON.
    config: Value,
    /// Seed of the inputs.
    seed: u64,
    /// Range of the token log-ratios.
    spread: f64,
    /// Whether the loss gets the explicit turn ids.
    turn_id: bool,
    /// Mini-batch `(tokens, sequences)` for a micro-batch.
    denominators: Option<[f64; 2]>,
    /// A precomputed `inverse_norm` scale.
    clip_bias_scale: Option<f64>,
}

fn cases() -> Vec<Case> {
    let wide = 0.35;
    let narrow = 0.006;
    let mut out = Vec::new();
    let mut push = |name: String, config: Value, seed: u64, spread: f64, turn_id: bool| {
        out.push(Case {
            name,
            config,
            seed,
            spread,
            turn_id,
            denominators: None,
            clip_bias_scale: None,
        });
    };
    let aggs = [
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ];
    for (k, loss) in ["vanilla", "dapo", "s_ppo", "s_grpo"].iter().enumerate() {
        for (j, agg) in aggs.iter().enumerate() {
            push(
                format!("{loss}/{agg}"),
                json!({"policy_loss": loss, "loss_agg_mode": agg}),
                (10 * k + j) as u64,
                wide,
                false,
            );
        }
    }
    push(
        "vanilla/no-dual-clip".into(),
        json!({"policy_loss": "vanilla", "clip_ratio_c": null}),
        40,
        wide,
        false,
    );
    push(
        "vanilla/sum-norm-K16".into(),
        json!({"policy_loss": "vanilla", "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 16.0}),
        41,
        wide,
        false,
    );
    push(
        "vanilla/dual-clip".into(),
        json!({"policy_loss": "vanilla"}),
        42,
        1.5,
        false,
    );
    push(
        "vanilla/log-ratio-clamp-0.5".into(),
        json!({"policy_loss": "vanilla", "log_ratio_clamp": 0.5}),
        44,
        1.5,
        false,
    );
    push(
        "vanilla/clip-bias-downweight".into(),
        json!({"policy_loss": "vanilla", "clip_bias": {}}),
        43,
        wide,
        false,
    );
    push(
        "gspo".into(),
        json!({"policy_loss": "gspo"}),
        50,
        narrow * 0.1,
        false,
    );
    push(
        "gspo/plain-clip-0.1".into(),
        json!({"policy_loss": "gspo", "ratio_form": "plain", "clip_ratio": 0.1}),
        51,
        wide,
        false,
    );
    for tid in [false, true] {
        let t = if tid { "turn-id" } else { "mask-runs" };
        push(
            format!("gspo_turn/{t}"),
            json!({"policy_loss": "gspo_turn"}),
            60 + u64::from(tid),
            narrow,
            tid,
        );
        push(
            format!("a2tgpo/{t}"),
            json!({"policy_loss": "a2tgpo"}),
            62 + u64::from(tid),
            narrow,
            tid,
        );
        push(
            format!("a2tgpo/{t}/clip-bias-loss-ratio"),
            json!({"policy_loss": "a2tgpo", "clip_bias": {"ratio": "loss"}}),
            64 + u64::from(tid),
            narrow,
            tid,
        );
        for (j, agg) in aggs.iter().enumerate() {
            push(
                format!("turn/{t}/{agg}"),
                json!({"policy_loss": "turn", "loss_agg_mode": agg}),
                70 + 10 * u64::from(tid) + j as u64,
                wide,
                tid,
            );
        }
        push(
            format!("turn/{t}/stop-gradient"),
            json!({"policy_loss": "turn", "ratio_form": "stop_gradient"}),
            90 + u64::from(tid),
            wide,
            tid,
        );
        push(
            format!("st_ppo/{t}"),
            json!({"policy_loss": "st_ppo"}),
            92 + u64::from(tid),
            wide,
            tid,
        );
        push(
            format!("st_ppo/{t}/ratio-loss"),
            json!({"policy_loss": "st_ppo", "clip_bias": {"ratio": "loss"}}),
            94 + u64::from(tid),
            wide,
            tid,
        );
        push(
            format!("st_ppo/{t}/inverse-norm"),
            json!({"policy_loss": "st_ppo", "clip_bias": {"rule": "inverse_norm"}}),
            96 + u64::from(tid),
            wide,
            tid,
        );
        push(
            format!("st_ppo/{t}/inverse-norm-per-sample"),
            json!({"policy_loss": "st_ppo", "clip_bias": {"rule": "inverse_norm", "norm_scope": "per_sample", "ratio": "loss"}}),
            98 + u64::from(tid),
            wide,
            tid,
        );
    }
    push(
        "s_ppo/inverse-norm-max-scale".into(),
        json!({"policy_loss": "s_ppo", "clip_bias": {"rule": "inverse_norm", "max_scale": 3.0}}),
        110,
        wide,
        false,
    );
    push(
        "s_grpo/inverse-norm-per-sample".into(),
        json!({"policy_loss": "s_grpo", "clip_bias": {"rule": "inverse_norm", "norm_scope": "per_sample"}, "loss_agg_mode": "seq-mean-token-mean"}),
        111,
        wide,
        false,
    );
    push(
        "dapo/asymmetric".into(),
        json!({"policy_loss": "decoupled_clip", "clip_ratio_low": 0.1, "clip_ratio_high": 0.3}),
        112,
        wide,
        false,
    );
    out.push(Case {
        name: "vanilla/micro-batch-denominators".into(),
        config: json!({"policy_loss": "vanilla"}),
        seed: 120,
        spread: wide,
        turn_id: false,
        denominators: Some([40.0, 6.0]),
        clip_bias_scale: None,
    });
    out.push(Case {
        name: "turn/micro-batch-denominators".into(),
        config: json!({"policy_loss": "turn", "loss_agg_mode": "seq-mean-token-mean"}),
        seed: 121,
        spread: wide,
        turn_id: true,
        denominators: Some([40.0, 6.0]),
        clip_bias_scale: None,
    });
    out.push(Case {
        name: "s_ppo/precomputed-scale".into(),
        config: json!({"policy_loss": "s_ppo", "clip_bias": {"rule": "inverse_norm"}}),
        seed: 122,
        spread: wide,
        turn_id: false,
        denominators: None,
        clip_bias_scale: Some(2.5),
    });
    out
}

/// Every case computed with turnwise-model: loss, ∂loss/∂logp and the metrics.
fn compute() -> Value {
    let mut out = Vec::new();
    for case in cases() {
        let Case {
            name,
            config,
            seed,
            spread,
            turn_id: tid,
            denominators,
            clip_bias_scale: cb_scale,
        } = case;
        let cfg: PolicyLossConfig = serde_json::from_value(config).unwrap();
        let mut inp = inputs(seed, spread);
        let logp = Var::from_tensor(&tensor(&inp["logp"])).unwrap();
        let (old, adv, mask) = (
            tensor(&inp["old_logp"]),
            tensor(&inp["advantages"]),
            tensor(&inp["loss_mask"]),
        );
        let (turn_id, clip_scale) = (tensor(&inp["turn_id"]), tensor(&inp["clip_scale"]));
        let mut input = PolicyLossInput::new(logp.as_tensor(), &old, &adv, &mask);
        if tid {
            input = input.with_turn_id(&turn_id);
        }
        let kind: turnwise_model::loss::PolicyLossKind = cfg.policy_loss.parse().unwrap();
        if kind.reads().contains(&Channel::ClipScale) {
            input = input.with_channel(Channel::ClipScale, &clip_scale);
        }
        if let Some([tokens, sequences]) = denominators {
            input = input.with_denominators(AggDenominators { tokens, sequences });
        }
        if let Some(s) = cb_scale {
            input = input.with_clip_bias_scale(s);
        }
        let o = compute_policy_loss(&input, &cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        let grads = o.loss.backward().unwrap();
        let grad: Vec<Vec<f64>> = match grads.get(logp.as_tensor()) {
            Some(g) => g.to_vec2().unwrap(),
            None => vec![vec![0.0; L]; B],
        };
        let loss: f64 = o.loss.to_scalar().unwrap();
        let obj = inp.as_object_mut().unwrap();
        if !tid {
            obj.remove("turn_id");
        }
        if cfg.policy_loss != "a2tgpo" {
            obj.remove("clip_scale");
        }
        out.push(json!({
            "name": name,
            "config": cfg,
            "denominators": denominators,
            "clip_bias_scale": cb_scale,
            "inputs": inp,
            "loss": loss,
            "grad": grad,
            "metrics": o.metrics.to_map(),
        }));
    }
    json!({
        "about": "turnwise-model policy losses and d(loss)/d(logp) in f64; written by crates/turnwise-py/tests/loss_fixture.rs (TURNWISE_REGEN_FIXTURES=1 regenerates), read by python/tests/test_losses.py",
        "cases": out,
    })
}

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python/tests/fixtures/losses.json")
}

/// One case per line, so a diff shows which cases changed.
fn render(v: &Value) -> String {
    let cases = v["cases"].as_array().unwrap();
    let body: Vec<String> = cases
        .iter()
        .map(|c| format!("  {}", serde_json::to_string(c).unwrap()))
        .collect();
    format!(
        "{{\"about\": {},\n\"cases\": [\n{}\n]}}\n",
        serde_json::to_string(&v["about"]).unwrap(),
        body.join(",\n")
    )
}

/// Compares `got` with `want`: numbers within `tol`, everything else equal.
fn close(path: &str, got: &Value, want: &Value, tol: f64, errors: &mut Vec<String>) {
    match (got, want) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            if (a - b).abs() > tol {
                errors.push(format!("{path}: computed {a}, fixture {b}"));
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                close(&format!("{path}[{i}]"), x, y, tol, errors);
            }
        }
        (Value::Object(a), Value::Object(b)) if a.len() == b.len() => {
            for (k, x) in a {
                match b.get(k) {
                    Some(y) => close(&format!("{path}.{k}"), x, y, tol, errors),
                    None => errors.push(format!("{path}: key {k} missing from the fixture")),
                }
            }
        }
        (a, b) if a == b => {}
        (a, b) => errors.push(format!("{path}: computed {a}, fixture {b}")),
    }
}

#[test]
fn loss_fixture_matches_turnwise_model() {
    let computed = compute();
    let path = fixture_path();
    if std::env::var("TURNWISE_REGEN_FIXTURES").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, render(&computed)).unwrap();
        eprintln!("wrote {}", path.display());
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {} ({e}); regenerate it with TURNWISE_REGEN_FIXTURES=1 cargo test -p turnwise-py --test loss_fixture",
            path.display()
        )
    });
    let committed: Value = serde_json::from_str(&text).unwrap();
    let mut errors = Vec::new();
    close("fixture", &computed, &committed, 1e-12, &mut errors);
    assert!(
        errors.is_empty(),
        "{} differs from what turnwise-model computes ({} difference(s); first: {:?}); \
         if the change is intended, regenerate it with TURNWISE_REGEN_FIXTURES=1 cargo test -p \
         turnwise-py --test loss_fixture and rerun the Python tests",
        path.display(),
        errors.len(),
        &errors[..errors.len().min(5)]
    );
}

/// The cases exercise what they are meant to: clipping on both sides, the dual clip, turns
/// split by explicit ids, and the clipping-bias rules with non-trivial weights.
#[test]
fn cases_cover_the_clip_paths() {
    let v = compute();
    let cases = v["cases"].as_array().unwrap();
    let metric = |name: &str, key: &str| {
        let c = cases.iter().find(|c| c["name"] == name).unwrap();
        c["metrics"][key].as_f64().unwrap()
    };
    assert!(metric("vanilla/token-mean", "actor/pg_clipfrac") > 0.0);
    assert!(metric("vanilla/token-mean", "actor/pg_clipfrac_low") > 0.0);
    assert!(metric("vanilla/token-mean", "actor/pg_clipfrac_high") > 0.0);
    assert!(metric("vanilla/dual-clip", "actor/pg_clipfrac_lower") > 0.0);
    let gt = metric("gspo_turn/turn-id", "actor/pg_clipfrac");
    assert!(
        gt > 0.0 && gt < 1.0,
        "gspo_turn clips some turns only: {gt}"
    );
    let s = metric("st_ppo/mask-runs", "actor/clip_bias_scale");
    assert!(s > 0.0 && s < 1.0, "downweight scale {s}");
    assert_eq!(metric("turn/turn-id/token-mean", "actor/num_turns"), 6.0);
    assert_eq!(metric("turn/mask-runs/token-mean", "actor/num_turns"), 7.0);
}

//! Sampling engine tests on tiny models.

use candle_core::{DType, Device, Tensor};

use super::*;
use crate::logprobs::logprobs_and_entropy_with_temperature;
use crate::model::tests::{model_for, tiny_configs};
use crate::model::{ModelConfig, Transformer};

fn detached(cfg: &ModelConfig, dtype: DType, seed: u64) -> Transformer {
    let (vm, m) = model_for(cfg, dtype, seed);
    let mut c = m.config().clone();
    c.initializer_range = 0.2;
    Transformer::detached_from_varmap(&c, &vm).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 17, 3], vec![9, 1, 2, 60, 7, 33, 70], vec![44]]
}

/// Greedy decoding by full forwards without a cache, one row at a time.
fn naive_greedy(model: &Transformer, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let t = seq.len();
        let ids = Tensor::from_vec(seq.clone(), (1, t), &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = Tensor::ones((1, t), DType::U32, &Device::Cpu).unwrap();
        let logits = model.forward(&ids, &pos, &mask, None).unwrap();
        let last = logits.narrow(1, t - 1, 1).unwrap().flatten_all().unwrap();
        seq.push(last.argmax(0).unwrap().to_scalar::<u32>().unwrap());
    }
    seq[prompt.len()..].to_vec()
}

#[test]
fn batched_greedy_equals_naive_greedy_per_row() {
    for cfg in tiny_configs() {
        let model = detached(&cfg, DType::F64, 21);
        let params = SamplingParams {
            temperature: 0.0,
            max_new_tokens: 6,
            ..Default::default()
        };
        let out = generate(&model, &prompts(), &[1, 2, 3], &params, None).unwrap();
        for (p, c) in prompts().iter().zip(&out) {
            assert_eq!(
                c.tokens,
                naive_greedy(&model, p, 6),
                "{:?}",
                cfg.architecture
            );
            assert_eq!(c.finish, FinishReason::Length);
        }
    }
}

#[test]
fn seeded_rows_do_not_depend_on_their_batch() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, DType::F64, 22);
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 0.95,
        top_k: 50,
        max_new_tokens: 12,
        ..Default::default()
    };
    let batch = generate(&model, &prompts(), &[10, 11, 12], &params, None).unwrap();
    let again = generate(&model, &prompts(), &[10, 11, 12], &params, None).unwrap();
    assert_eq!(batch, again);
    let alone = generate(&model, &prompts()[1..2], &[11], &params, None).unwrap();
    assert_eq!(alone[0].tokens, batch[1].tokens);
    let other_seed = generate(&model, &prompts(), &[99, 98, 97], &params, None).unwrap();
    assert_ne!(
        other_seed.iter().map(|c| &c.tokens).collect::<Vec<_>>(),
        batch.iter().map(|c| &c.tokens).collect::<Vec<_>>()
    );
}

/// Per-position log-probs and entropies (as `f32`) of `prompt` + `tokens` under a full
/// teacher-forced pass at `temperature`; position `j` scores token `j + 1`.
fn teacher_forced(
    model: &Transformer,
    prompt: &[u32],
    tokens: &[u32],
    temperature: f64,
) -> (Vec<f32>, Vec<f32>) {
    let full: Vec<u32> = prompt.iter().chain(tokens).copied().collect();
    let t = full.len() - 1;
    let ids = Tensor::from_vec(full[..t].to_vec(), (1, t), &Device::Cpu).unwrap();
    let tg = Tensor::from_vec(full[1..].to_vec(), (1, t), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mask = Tensor::ones((1, t), DType::U32, &Device::Cpu).unwrap();
    let (lp, ent) =
        logprobs_and_entropy_with_temperature(model, &ids, &pos, &mask, &tg, temperature).unwrap();
    let flat = |x: Tensor| {
        x.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    (flat(lp), flat(ent))
}

#[test]
fn reported_logprobs_match_the_training_pass() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, DType::F32, 23);
    let params = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        max_new_tokens: 8,
        ..Default::default()
    };
    let out = generate(&model, &prompts(), &[4, 5, 6], &params, None).unwrap();
    for (p, c) in prompts().iter().zip(&out) {
        let (lp, ent) = teacher_forced(&model, p, &c.tokens, 0.7);
        for (k, (&a, &e)) in c.logprobs.iter().zip(&c.entropies).enumerate() {
            let j = p.len() - 1 + k;
            assert!((a - lp[j]).abs() < 1e-4, "logp step {k}: {a} vs {}", lp[j]);
            assert!(
                (e - ent[j]).abs() < 1e-4,
                "entropy step {k}: {e} vs {}",
                ent[j]
            );
        }
    }
}

#[test]
fn stops_on_tokens_strings_and_length() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, DType::F64, 24);
    let greedy = SamplingParams {
        temperature: 0.0,
        max_new_tokens: 10,
        ..Default::default()
    };
    let free = generate(&model, &prompts()[..1], &[0], &greedy, None).unwrap();
    let stop_tok = free[0].tokens[3];
    let first = free[0].tokens.iter().position(|&t| t == stop_tok).unwrap();
    let params = SamplingParams {
        stop_token_ids: vec![stop_tok],
        ..greedy.clone()
    };
    let out = generate(&model, &prompts()[..1], &[0], &params, None).unwrap();
    assert_eq!(out[0].tokens, free[0].tokens[..=first]);
    assert_eq!(out[0].finish, FinishReason::StopToken(stop_tok));

    // Stop strings through a word-level tokenizer whose ids cover the model's vocabulary.
    let words: Vec<String> = (0..80).map(|i| format!("w{i}")).collect();
    let tok = crate::tokenizer::TextTokenizer::train_word_level(
        &[words.join(" ")],
        96,
        crate::tokenizer::DEFAULT_SPECIAL_TOKENS,
    )
    .unwrap();
    let target = tok.decode(&free[0].tokens[2..3], false).unwrap();
    let params = SamplingParams {
        stop_strings: vec!["never-there".into(), target.clone()],
        ..greedy.clone()
    };
    let out = generate(&model, &prompts()[..1], &[0], &params, Some(&tok)).unwrap();
    let text = tok.decode(&out[0].tokens, false).unwrap();
    assert!(text.contains(&target), "{text} lacks {target}");
    assert!(out[0].tokens.len() <= 3);
    assert_eq!(out[0].finish, FinishReason::StopString(1));

    let err = generate(&model, &prompts(), &[0], &greedy, None).unwrap_err();
    assert!(err.to_string().contains("seeds"), "{err}");
    let err = generate(&model, &[vec![500]], &[0], &greedy, None).unwrap_err();
    assert!(err.to_string().contains("vocab_size"), "{err}");
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() {
    let logits: Vec<f32> = vec![0.1, 2.0, -1.0, 1.9, 0.0];
    let mut rng = TurnRng::seed_from_u64(0);
    for _ in 0..20 {
        let k1 = SamplingParams {
            top_k: 1,
            ..Default::default()
        };
        assert_eq!(sample_row(&logits, &k1, &mut rng).token, 1);
        let p = SamplingParams {
            top_p: 0.01,
            ..Default::default()
        };
        assert_eq!(sample_row(&logits, &p, &mut rng).token, 1);
    }
    // top-k 2 only ever yields the two best tokens.
    let k2 = SamplingParams {
        top_k: 2,
        temperature: 5.0,
        ..Default::default()
    };
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        seen.insert(sample_row(&logits, &k2, &mut rng).token);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec![1, 3]);
    // Frequencies follow the softmax at temperature 1.
    let all = SamplingParams::default();
    let n = 20_000;
    let hits = (0..n)
        .filter(|_| sample_row(&logits, &all, &mut rng).token == 1)
        .count();
    let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
    let p1 = (2.0f64).exp() / z;
    assert!(
        (hits as f64 / n as f64 - p1).abs() < 0.015,
        "{} vs {p1}",
        hits as f64 / n as f64
    );
}

/// Forbids every token but the allowed ones, and records what it saw.
struct AllowOnly {
    allowed: Vec<u32>,
    calls: Vec<(usize, usize)>,
}

impl LogitsProcessor for AllowOnly {
    fn process(&mut self, prompt_index: usize, generated: &[u32], logits: &mut [f32]) {
        self.calls.push((prompt_index, generated.len()));
        for (i, x) in logits.iter_mut().enumerate() {
            if !self.allowed.contains(&(i as u32)) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

#[test]
fn logits_processor_constrains_and_top_logprobs_are_reported() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, DType::F32, 25);
    let params = SamplingParams {
        max_new_tokens: 5,
        top_logprobs: 3,
        ..Default::default()
    };
    let mut hook = AllowOnly {
        allowed: vec![10, 20, 30],
        calls: Vec::new(),
    };
    let out = generate_with_processor(
        &model,
        &prompts(),
        &[1, 2, 3],
        &params,
        None,
        Some(&mut hook),
    )
    .unwrap();
    assert_eq!(hook.calls.len(), 15);
    assert!(hook.calls.contains(&(2, 4)));
    for c in &out {
        assert!(
            c.tokens.iter().all(|t| [10, 20, 30].contains(t)),
            "{:?}",
            c.tokens
        );
        assert_eq!(c.top_logprobs.len(), c.tokens.len());
        for (step, top) in c.top_logprobs.iter().enumerate() {
            assert_eq!(top.len(), 3);
            let mut ids: Vec<u32> = top.iter().map(|p| p.0).collect();
            ids.sort();
            assert_eq!(ids, vec![10, 20, 30]);
            assert!(top[0].1 >= top[1].1 && top[1].1 >= top[2].1);
            let mass: f32 = top.iter().map(|p| p.1.exp()).sum();
            assert!((mass - 1.0).abs() < 1e-5, "{mass}");
            let own = top.iter().find(|p| p.0 == c.tokens[step]).unwrap().1;
            assert_eq!(own, c.logprobs[step]);
            assert!(c.entropies[step] <= (3f32).ln() + 1e-5);
        }
    }
    let mut none = AllowOnly {
        allowed: vec![],
        calls: Vec::new(),
    };
    let err = generate_with_processor(
        &model,
        &prompts(),
        &[1, 2, 3],
        &params,
        None,
        Some(&mut none),
    )
    .unwrap_err();
    assert!(err.to_string().contains("forbade every token"), "{err}");
    // Greedy also reports top log-probs, led by the chosen token.
    let greedy = SamplingParams {
        temperature: 0.0,
        top_logprobs: 2,
        max_new_tokens: 3,
        ..Default::default()
    };
    let g = generate(&model, &prompts(), &[0, 0, 0], &greedy, None).unwrap();
    for c in &g {
        for (step, top) in c.top_logprobs.iter().enumerate() {
            assert_eq!(top[0].0, c.tokens[step]);
        }
    }
}

/// The sampler as it was before the sort-free paths: a full sort of the vocabulary, then an
/// inverse-CDF draw in most-likely-first order. Kept as the reference the fast paths must match.
fn reference_sample_row(logits: &[f32], params: &SamplingParams, rng: &mut TurnRng) -> TokenDraw {
    let temp = if params.temperature > 0.0 {
        params.temperature
    } else {
        1.0
    };
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / temp).collect();
    let max = scaled.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + scaled.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
    let logp: Vec<f64> = scaled.iter().map(|x| x - lse).collect();
    let entropy = -logp
        .iter()
        .map(|&l| if l.is_finite() { l.exp() * l } else { 0.0 })
        .sum::<f64>();
    let mut order: Vec<usize> = (0..logp.len()).collect();
    order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
    let token = if params.temperature == 0.0 {
        argmax(&logp)
    } else {
        let mut k = order.len();
        if params.top_k > 0 {
            k = k.min(params.top_k);
        }
        if params.top_p < 1.0 {
            let mut mass = 0.0;
            for (n, &i) in order.iter().enumerate().take(k) {
                mass += logp[i].exp();
                if mass >= params.top_p {
                    k = n + 1;
                    break;
                }
            }
        }
        let kept = &order[..k.max(1)];
        let total: f64 = kept.iter().map(|&i| logp[i].exp()).sum();
        let mut u = rng.next_f64() * total;
        let mut pick = kept[kept.len() - 1];
        for &i in kept {
            let p = logp[i].exp();
            if u < p {
                pick = i;
                break;
            }
            u -= p;
        }
        pick
    };
    TokenDraw {
        token: token as u32,
        logprob: logp[token] as f32,
        entropy: entropy as f32,
        top: top_pairs(&logp, &order, params.top_logprobs),
    }
}

/// Logits with ties, forbidden tokens and a spread of magnitudes.
fn test_logits(v: usize, seed: u64) -> Vec<f32> {
    let mut rng = TurnRng::seed_from_u64(seed);
    (0..v)
        .map(|_| match rng.next_u64() % 10 {
            0 => f32::NEG_INFINITY,
            1 => 1.5,
            _ => (rng.normal() * 3.0) as f32,
        })
        .collect()
}

#[test]
fn fast_paths_match_the_full_sort_reference() {
    let settings = [
        (1.0, 1.0, 0, 5),
        (0.7, 1.0, 0, 0),
        (0.0, 1.0, 0, 20),
        (1.0, 1.0, 1, 3),
        (1.0, 1.0, 7, 20),
        (1.3, 1.0, 5000, 2),
        (1.0, 0.9, 0, 20),
        (0.5, 0.3, 0, 1),
        (2.0, 0.999, 0, 4),
        (1.0, 0.95, 50, 0),
        (1.0, 0.5, 3, 40),
    ];
    for v in [1, 2, 5, 63, 64, 65, 200, 2049, 4096] {
        for seed in 0..3u64 {
            let mut logits = test_logits(v, seed * 31 + v as u64);
            if logits.iter().all(|x| !x.is_finite()) {
                logits[0] = 0.0;
            }
            for &(temperature, top_p, top_k, top_logprobs) in &settings {
                let params = SamplingParams {
                    temperature,
                    top_p,
                    top_k,
                    top_logprobs,
                    ..Default::default()
                };
                let mut fast_rng = TurnRng::seed_from_u64(seed);
                let mut ref_rng = TurnRng::seed_from_u64(seed);
                for _ in 0..20 {
                    let fast = sample_row(&logits, &params, &mut fast_rng);
                    let reference = reference_sample_row(&logits, &params, &mut ref_rng);
                    let ctx = format!("v {v} seed {seed} {params:?}");
                    assert_eq!(fast.entropy.to_bits(), reference.entropy.to_bits(), "{ctx}");
                    assert_eq!(fast.top, reference.top, "{ctx}");
                    assert!(logits[fast.token as usize].is_finite(), "{ctx}");
                    let draw = forced_row(&logits, &params, fast.token);
                    assert_eq!(draw.logprob.to_bits(), fast.logprob.to_bits(), "{ctx}");
                    assert_eq!(draw.entropy.to_bits(), fast.entropy.to_bits(), "{ctx}");
                    // Greedy, top-k and top-p draw in the same order as the reference, so they
                    // pick the same token for the same random number; plain sampling does not.
                    if temperature == 0.0 || top_k > 0 || top_p < 1.0 {
                        assert_eq!(fast, reference, "{ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn top_n_desc_is_a_prefix_of_the_full_sort() {
    for v in [1, 7, 64, 300, 5000] {
        let logits = test_logits(v, v as u64);
        let logp: Vec<f64> = logits.iter().map(|&x| x as f64).collect();
        let mut full: Vec<usize> = (0..v).collect();
        full.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
        for n in [0, 1, 2, 3, 9, 20, 64, 157, 4999, 5000, 6000] {
            assert_eq!(top_n_desc(&logp, n), full[..n.min(v)], "v {v} n {n}");
        }
    }
}

/// Draws `n` tokens with `params` and checks their frequencies against `expected` (probabilities
/// per token): Pearson's chi-square below the 0.999 quantile and every frequency within 0.01.
fn assert_frequencies(logits: &[f32], params: &SamplingParams, expected: &[f64], seed: u64) {
    let n = 20_000;
    let mut rng = TurnRng::seed_from_u64(seed);
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[sample_row(logits, params, &mut rng).token as usize] += 1;
    }
    let mut chi2 = 0.0;
    let mut cells = 0;
    for (i, (&c, &p)) in counts.iter().zip(expected).enumerate() {
        let freq = c as f64 / n as f64;
        assert!(
            (freq - p).abs() < 0.01,
            "token {i}: frequency {freq} vs probability {p} ({params:?})"
        );
        if p == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 ({params:?})");
        } else {
            chi2 += (c as f64 - n as f64 * p).powi(2) / (n as f64 * p);
            cells += 1;
        }
    }
    // 0.999 quantiles of chi-square with 1..=11 degrees of freedom.
    const Q999: [f64; 12] = [
        0.0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
    ];
    assert!(
        chi2 < Q999[cells - 1],
        "chi-square {chi2} with {} degrees of freedom ({params:?})",
        cells - 1
    );
}

#[test]
fn plain_top_k_and_top_p_draws_follow_their_distributions() {
    let logits: Vec<f32> = vec![
        0.3,
        1.2,
        -0.5,
        1.2,
        f32::NEG_INFINITY,
        0.9,
        -2.0,
        0.0,
        2.1,
        -1.0,
        0.6,
        1.7,
    ];
    let temperature = 0.8;
    let scaled: Vec<f64> = logits.iter().map(|&x| x as f64 / temperature).collect();
    let z: f64 = scaled.iter().map(|x| x.exp()).sum();
    let probs: Vec<f64> = scaled.iter().map(|x| x.exp() / z).collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let renormalised = |kept: &[usize]| -> Vec<f64> {
        let mass: f64 = kept.iter().map(|&i| probs[i]).sum();
        (0..probs.len())
            .map(|i| {
                if kept.contains(&i) {
                    probs[i] / mass
                } else {
                    0.0
                }
            })
            .collect()
    };
    let base = SamplingParams {
        temperature,
        ..Default::default()
    };
    assert_frequencies(&logits, &base, &probs, 1);
    let top_k = SamplingParams {
        top_k: 4,
        ..base.clone()
    };
    assert_frequencies(&logits, &top_k, &renormalised(&order[..4]), 2);
    // The smallest most-likely-first prefix whose mass reaches 0.8.
    let mut cut = 0;
    let mut mass = 0.0;
    while mass < 0.8 {
        mass += probs[order[cut]];
        cut += 1;
    }
    assert!(cut > 1 && cut < 10, "{cut}");
    let top_p = SamplingParams {
        top_p: 0.8,
        ..base.clone()
    };
    assert_frequencies(&logits, &top_p, &renormalised(&order[..cut]), 3);
    let both = SamplingParams {
        top_p: 0.8,
        top_k: 3,
        ..base
    };
    assert_frequencies(&logits, &both, &renormalised(&order[..cut.min(3)]), 4);
}

/// Timing probe (ignored by default; `cargo test -p turnwise-model --release -- --ignored
/// --nocapture sample_row_speed`): [`sample_row`] against the full-sort reference, alternated
/// in rounds so that machine load hits both alike. Prints figures; asserts nothing about speed.
#[test]
#[ignore = "timing probe"]
fn sample_row_speed_against_the_full_sort_reference() {
    use std::time::Instant;
    let settings: [(&str, f64, usize, usize); 5] = [
        ("plain", 1.0, 0, 0),
        ("plain, top-20 log-probs", 1.0, 0, 20),
        ("top-k 50", 1.0, 50, 0),
        ("top-p 0.9", 0.9, 0, 0),
        ("top-p 0.95, top-20", 0.95, 0, 20),
    ];
    for v in [4096, 8192] {
        let logits: Vec<f32> = test_logits(v, 5)
            .into_iter()
            .map(|x| if x.is_finite() { x } else { -3.0 })
            .collect();
        for (name, top_p, top_k, top_logprobs) in settings {
            let params = SamplingParams {
                top_p,
                top_k,
                top_logprobs,
                ..Default::default()
            };
            let mut rng = TurnRng::seed_from_u64(0);
            let reps = 200;
            let (mut fast, mut reference) = (Vec::new(), Vec::new());
            for _ in 0..15 {
                let t0 = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(sample_row(&logits, &params, &mut rng));
                }
                fast.push(t0.elapsed().as_secs_f64() / reps as f64);
                let t0 = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(reference_sample_row(&logits, &params, &mut rng));
                }
                reference.push(t0.elapsed().as_secs_f64() / reps as f64);
            }
            fast.sort_by(f64::total_cmp);
            reference.sort_by(f64::total_cmp);
            let (f, r) = (fast[fast.len() / 2], reference[reference.len() / 2]);
            println!(
                "V {v} {name}: sample_row {:.1} µs, full-sort reference {:.1} µs: {:.2}x",
                f * 1e6,
                r * 1e6,
                r / f
            );
        }
    }
}

/// Long turns (past the engine's spare cache columns, so its buffers regrow), rows leaving at
/// different steps, and enough rows × vocabulary for the parallel draw: every row's tokens,
/// log-probs and entropies equal those of the row sampled alone.
#[test]
fn long_batched_turns_match_rows_alone() {
    let cfg = ModelConfig::tiny_qwen2(4096);
    let model = detached(&cfg, DType::F64, 31);
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 90,
        stop_token_ids: (0..40).collect(),
        top_logprobs: 2,
        ..Default::default()
    };
    let prompts: Vec<Vec<u32>> = (0..20u32)
        .map(|r| {
            (0..1 + r % 5)
                .map(|i| (97 * r + 31 * i + 5) % 4096)
                .collect()
        })
        .collect();
    let seeds: Vec<u64> = (100..120).collect();
    let batch = generate(&model, &prompts, &seeds, &params, None).unwrap();
    let lens: Vec<usize> = batch.iter().map(|c| c.tokens.len()).collect();
    assert!(lens.contains(&90), "no row reached the limit: {lens:?}");
    assert!(
        lens.iter().any(|&n| n < 90),
        "no row stopped early: {lens:?}"
    );
    for (i, (p, c)) in prompts.iter().zip(&batch).enumerate() {
        // The reported log-probs are those of a full teacher-forced pass (no cache).
        let (lp, _) = teacher_forced(&model, p, &c.tokens, 1.0);
        for (k, &a) in c.logprobs.iter().enumerate() {
            let j = p.len() - 1 + k;
            assert!(
                (a - lp[j]).abs() < 1e-5,
                "row {i} step {k}: {a} vs {}",
                lp[j]
            );
        }
        let alone = generate(&model, &prompts[i..i + 1], &seeds[i..i + 1], &params, None).unwrap();
        let a = &alone[0];
        assert_eq!(a.tokens, c.tokens, "row {i}");
        assert_eq!(a.finish, c.finish, "row {i}");
        for (x, y) in a
            .logprobs
            .iter()
            .zip(&c.logprobs)
            .chain(a.entropies.iter().zip(&c.entropies))
        {
            assert!((x - y).abs() <= 1e-5, "row {i}: {x} vs {y}");
        }
    }
}

#[test]
fn sharded_puts_every_shards_outputs_back_in_row_order() {
    for (rows, shards) in [(0, 3), (1, 1), (7, 1), (7, 3), (10, 4), (3, 5)] {
        let out: Vec<usize> = super::sharded(rows, shards, |part| {
            // Each shard holds every `shards`-th row from its first.
            assert!(part.windows(2).all(|w| w[1] - w[0] == shards));
            Ok::<_, String>(part.iter().map(|&i| i * 10).collect())
        })
        .unwrap();
        assert_eq!(out, (0..rows).map(|i| i * 10).collect::<Vec<_>>());
    }
    let err = super::sharded(8, 2, |part| {
        if part[0] == 1 {
            Err(format!("shard of row {}", part[0]))
        } else {
            Ok(part.to_vec())
        }
    });
    assert_eq!(err, Err("shard of row 1".to_string()));
}

/// `Transformer::with_batch_invariant`: a batch's sampled completions (tokens, log-probs,
/// entropies, top log-probs) are the same bits on one thread (one shard: all 16 rows padded
/// together) and on four (four shards of 4 rows each, other padding): what a run samples no
/// longer depends on the machine's cores. The default model's completions differ between the
/// two (checked, so the test cannot pass for want of a difference).
#[test]
fn batch_invariant_generation_does_not_depend_on_the_shards() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, DType::F32, 13);
    let prompts: Vec<Vec<u32>> = (0..16u32)
        .map(|i| (0..5 + 7 * i).map(|j| (j * 11 + i * 5) % 90 + 1).collect())
        .collect();
    let seeds: Vec<u64> = (0..16).collect();
    let params = SamplingParams {
        temperature: 1.0,
        max_new_tokens: 24,
        top_logprobs: 2,
        ..Default::default()
    };
    let run = |m: &Transformer, threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let out = pool.install(|| {
            assert_eq!(generation_shards(m, prompts.len()), threads);
            generate(m, &prompts, &seeds, &params, None).unwrap()
        });
        let f = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        out.iter()
            .map(|c| {
                let top: Vec<(u32, u32)> = c
                    .top_logprobs
                    .iter()
                    .flatten()
                    .map(|&(t, l)| (t, l.to_bits()))
                    .collect();
                (c.tokens.clone(), f(&c.logprobs), f(&c.entropies), top)
            })
            .collect::<Vec<_>>()
    };
    let invariant = model.clone().with_batch_invariant(true);
    assert!(invariant.is_batch_invariant() && !model.is_batch_invariant());
    assert!(
        run(&invariant, 1) == run(&invariant, 4),
        "batch-invariant completions changed with the number of shards"
    );
    assert!(
        run(&model, 1) != run(&model, 4),
        "the default kernels gave the same bits on 1 and 4 shards"
    );
}

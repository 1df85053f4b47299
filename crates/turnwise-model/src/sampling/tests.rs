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
        let full: Vec<u32> = p.iter().chain(&c.tokens).copied().collect();
        let t = full.len() - 1;
        let ids = Tensor::from_vec(full[..t].to_vec(), (1, t), &Device::Cpu).unwrap();
        let tg = Tensor::from_vec(full[1..].to_vec(), (1, t), &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, t as u32, &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let mask = Tensor::ones((1, t), DType::U32, &Device::Cpu).unwrap();
        let (lp, ent) =
            logprobs_and_entropy_with_temperature(&model, &ids, &pos, &mask, &tg, 0.7).unwrap();
        let lp = lp.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ent = ent.flatten_all().unwrap().to_vec1::<f32>().unwrap();
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

//! Speculative decoding: greedy output identical to plain decoding, sampled output from the
//! policy's exact distribution, and the recorded statistics the policy's own.

use candle_core::DType;

use super::super::*;
use super::prompt_lookup;
use crate::model::ModelConfig;
use crate::model::tests::model_for;
use crate::tokenizer::{DEFAULT_SPECIAL_TOKENS, TextTokenizer};

fn detached(cfg: &ModelConfig, seed: u64) -> Transformer {
    let (vm, m) = model_for(cfg, DType::F32, seed);
    Transformer::detached_from_varmap(m.config(), &vm).unwrap()
}

fn word_tokenizer() -> TextTokenizer {
    let words: Vec<String> = (0..80).map(|i| format!("w{i}")).collect();
    TextTokenizer::train_word_level(&[words.join(" ")], 96, DEFAULT_SPECIAL_TOKENS).unwrap()
}

fn spec() -> SpeculativeConfig {
    SpeculativeConfig {
        max_draft: 4,
        ngram_max: 3,
        ngram_min: 1,
    }
}

fn engine_config(speculative: Option<SpeculativeConfig>) -> EngineConfig {
    EngineConfig {
        speculative,
        ..EngineConfig::with_max_batch_size(0)
    }
}

/// Prompts that repeat text (so that drafts exist), and one that does not.
fn repeating_prompts() -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for i in 0..4u32 {
        let unit: Vec<u32> = (0..5 + i).map(|j| 10 + 7 * i + j).collect();
        let mut p = Vec::new();
        for _ in 0..3 {
            p.extend(&unit);
        }
        p.extend(&unit[..2]);
        out.push(p);
    }
    out.push(vec![60, 61, 62, 63, 64, 65]);
    out
}

/// Runs `prompts` for two turns (the observation `[40, 41, 42]` and the prompt's first three
/// tokens appended between them); returns the sequences, every turn end and the stats.
fn two_turns(
    model: &Transformer,
    tok: &TextTokenizer,
    speculative: Option<SpeculativeConfig>,
    prompts: &[Vec<u32>],
    params: &SequenceParams,
    seed: u64,
) -> (Vec<Sequence>, Vec<TurnEnd>, EngineStats) {
    let mut eng = SamplingEngine::new(model, Some(tok), engine_config(speculative));
    let ids: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            eng.add_sequence(p.clone(), params.clone(), seed + i as u64)
                .unwrap()
        })
        .collect();
    let mut ends = eng.run_until_stop(None).unwrap();
    for e in ends.clone() {
        let p = &prompts[e.id.0 as usize];
        if !e.reason.is_terminal() {
            let mut obs = vec![40, 41, 42];
            obs.extend(&p[..3]);
            eng.append_tokens(e.id, &obs).unwrap();
            eng.resume(e.id).unwrap();
        }
    }
    ends.extend(eng.run_until_stop(None).unwrap());
    // Turns end at different steps with and without drafts: compare them in sequence order.
    ends.sort_by_key(|e| (e.id, e.start));
    let seqs = ids
        .iter()
        .map(|&id| eng.sequence(id).unwrap().clone())
        .collect();
    (seqs, ends, eng.stats())
}

fn assert_same_outputs(plain: &[Sequence], spec: &[Sequence], tol: f32) {
    for (a, b) in plain.iter().zip(spec) {
        assert_eq!(a.tokens, b.tokens, "tokens of {}", a.id);
        assert_eq!(a.origins, b.origins, "origins of {}", a.id);
        for (what, x, y) in [
            ("logprobs", &a.logprobs, &b.logprobs),
            ("entropies", &a.entropies, &b.entropies),
            ("confidences", &a.confidences, &b.confidences),
        ] {
            let d = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0f32, f32::max);
            assert!(d < tol, "{what} of {} differ by {d}", a.id);
        }
        for (ta, tb) in a.top_logprobs.iter().zip(&b.top_logprobs) {
            assert_eq!(ta.len(), tb.len());
            for (x, y) in ta.iter().zip(tb) {
                assert_eq!(x.0, y.0);
                assert!((x.1 - y.1).abs() < tol);
            }
        }
    }
}

#[test]
fn greedy_speculation_generates_exactly_the_plain_tokens_across_turns_and_stops() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, 41);
    let tok = word_tokenizer();
    let prompts = repeating_prompts();
    let mut params = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.0,
            max_new_tokens: 24,
            top_logprobs: 2,
            ..Default::default()
        },
        confidence_top_j: 5,
        ..Default::default()
    };
    // Stops taken from what plain decoding generates: a token of row 0's turn and two
    // consecutive tokens of row 1's, as text.
    let (free_run, _, _) = two_turns(&model, &tok, None, &prompts, &params, 0);
    let g0 = &free_run[0].tokens[prompts[0].len()..];
    let g1 = &free_run[1].tokens[prompts[1].len()..];
    params.sampling.stop_token_ids = vec![g0[9]];
    params.sampling.stop_strings = vec![tok.decode(&g1[6..8], false).unwrap()];

    let (plain, plain_ends, plain_stats) = two_turns(&model, &tok, None, &prompts, &params, 0);
    let (fast, fast_ends, stats) = two_turns(&model, &tok, Some(spec()), &prompts, &params, 0);
    assert!(
        plain_ends
            .iter()
            .any(|e| matches!(e.reason, StopReason::StopToken(_))),
        "{plain_ends:?}"
    );
    assert!(
        plain_ends
            .iter()
            .any(|e| matches!(e.reason, StopReason::StopString(_))),
        "{plain_ends:?}"
    );
    assert!(plain.iter().all(|s| s.turns == 2));
    assert_eq!(plain_ends, fast_ends);
    assert_same_outputs(&plain, &fast, 1e-5);
    // Drafts were proposed, some accepted and some rejected; the forward passes were fewer.
    assert!(stats.accepted_tokens > 0, "{stats:?}");
    assert!(stats.accepted_tokens < stats.drafted_tokens, "{stats:?}");
    assert_eq!(plain_stats.drafted_tokens, 0);
    assert_eq!(stats.sampled_tokens, plain_stats.sampled_tokens);
    assert!(stats.steps < plain_stats.steps, "{stats:?} {plain_stats:?}");
}

#[test]
fn masked_draft_columns_are_compacted_and_outputs_stay_those_of_plain_decoding() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, 47);
    let greedy = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.0,
            max_new_tokens: 160,
            ..Default::default()
        },
        confidence_top_j: 0,
        ..Default::default()
    };
    let mut sampled = greedy.clone();
    sampled.sampling.temperature = 0.7;
    let run = |speculative: Option<SpeculativeConfig>| {
        let mut eng = SamplingEngine::new(&model, None, engine_config(speculative));
        let ids: Vec<SeqId> = repeating_prompts()
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let params = if i % 2 == 0 { &greedy } else { &sampled };
                eng.add_sequence(p, params.clone(), i as u64).unwrap()
            })
            .collect();
        let mut widest_waste = 0;
        while !eng.is_idle() {
            eng.step(None).unwrap();
            let real = eng
                .batch
                .mask
                .iter()
                .map(|m| m.iter().filter(|&&x| x != 0).count());
            let waste = eng.batch_width() - real.max().unwrap_or(0);
            widest_waste = widest_waste.max(waste);
        }
        let seqs: Vec<Sequence> = ids
            .iter()
            .map(|&id| eng.sequence(id).unwrap().clone())
            .collect();
        (seqs, widest_waste, eng.stats())
    };
    let (plain, _, _) = run(None);
    let (fast, waste, stats) = run(Some(spec()));
    assert!(stats.accepted_tokens > 0 && stats.accepted_tokens < stats.drafted_tokens);
    // Without compaction the rows that accept fewer drafts than their step's best would leave
    // the batch far wider than its longest row.
    assert!(
        waste < KV_RESERVE,
        "the batch is {waste} columns wider than its longest row"
    );
    assert_same_outputs(&plain, &fast, 1e-4);
}

#[test]
fn a_hook_that_leaves_the_logits_alone_keeps_the_carried_draw() {
    // Sampled rows draw seed for seed the tokens of plain decoding (one draw of the row's
    // generator per token); a step given a hook after a rejected draft must keep the draw that
    // rejected it (the residual), not draw again.
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, 49);
    let params = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.5,
            top_p: 0.95,
            max_new_tokens: 40,
            ..Default::default()
        },
        confidence_top_j: 0,
        ..Default::default()
    };
    let run = |speculative: Option<SpeculativeConfig>| {
        let mut eng = SamplingEngine::new(&model, None, engine_config(speculative));
        let ids: Vec<SeqId> = repeating_prompts()
            .into_iter()
            .enumerate()
            .map(|(i, p)| eng.add_sequence(p, params.clone(), 100 + i as u64).unwrap())
            .collect();
        let mut hooked = 0;
        let mut noop = |_: &Sequence, _: &mut [f32]| -> Option<u32> { None };
        let mut n = 0;
        while !eng.is_idle() {
            n += 1;
            if n % 2 == 0 {
                hooked += eng.carried.len();
                eng.step(Some(&mut noop)).unwrap();
            } else {
                eng.step(None).unwrap();
            }
        }
        let seqs: Vec<Sequence> = ids
            .iter()
            .map(|&id| eng.sequence(id).unwrap().clone())
            .collect();
        (seqs, hooked, eng.stats())
    };
    let (plain, _, _) = run(None);
    let (fast, hooked, stats) = run(Some(spec()));
    assert!(hooked > 0, "no hooked step followed a rejected draft");
    assert!(stats.accepted_tokens > 0, "{stats:?}");
    assert_same_outputs(&plain, &fast, 1e-4);
}

/// The log-softmax of `logits / temperature`, in f64.
fn log_softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
    let x: Vec<f64> = logits.iter().map(|&l| l as f64 / temperature).collect();
    let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
    x.iter().map(|v| v - lse).collect()
}

#[test]
fn every_token_records_the_teacher_forced_policy_statistics() {
    let cfg = ModelConfig::tiny_qwen2(96);
    let model = detached(&cfg, 43);
    let tok = word_tokenizer();
    let prompts = repeating_prompts();
    let temperature = 0.4;
    let params = SequenceParams {
        sampling: SamplingParams {
            temperature,
            top_k: 12,
            top_p: 0.9,
            max_new_tokens: 20,
            top_logprobs: 3,
            ..Default::default()
        },
        confidence_top_j: 6,
        ..Default::default()
    };
    let (seqs, _, stats) = two_turns(&model, &tok, Some(spec()), &prompts, &params, 7);
    assert!(stats.accepted_tokens > 0, "{stats:?}");
    assert!(stats.accepted_tokens < stats.drafted_tokens, "{stats:?}");
    let mut checked = 0;
    for s in &seqs {
        let logits = model
            .forward_sequence(&s.tokens)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for i in 0..s.tokens.len() {
            if s.origins[i] != TokenOrigin::Sampled {
                continue;
            }
            let lp = log_softmax(&logits[i - 1], temperature);
            let t = s.tokens[i] as usize;
            assert!(
                (s.logprobs[i] as f64 - lp[t]).abs() < 1e-5,
                "{} token {i}: {} vs {}",
                s.id,
                s.logprobs[i],
                lp[t]
            );
            let ent = -lp.iter().map(|l| l.exp() * l).sum::<f64>();
            assert!((s.entropies[i] as f64 - ent).abs() < 1e-5);
            let mut order: Vec<usize> = (0..lp.len()).collect();
            order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
            let conf = -order[..6].iter().map(|&j| lp[j]).sum::<f64>() / 6.0;
            assert!((s.confidences[i] as f64 - conf).abs() < 1e-5);
            assert_eq!(s.top_logprobs[i].len(), 3);
            for (&(id, l), &j) in s.top_logprobs[i].iter().zip(&order) {
                assert_eq!(id as usize, j);
                assert!((l as f64 - lp[j]).abs() < 1e-5);
            }
            checked += 1;
        }
    }
    assert_eq!(checked as u64, stats.sampled_tokens);
}

/// The distribution [`sample_row`] draws from: temperature, then top-k, then top-p (the
/// smallest most-likely-first prefix whose mass reaches `top_p`), renormalised.
fn truncated(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
    let lp = log_softmax(logits, p.temperature);
    let mut order: Vec<usize> = (0..lp.len()).collect();
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let mut kept = Vec::new();
    let mut mass = 0.0;
    for &i in &order {
        kept.push(i);
        mass += lp[i].exp();
        if mass >= p.top_p {
            break;
        }
    }
    let total: f64 = kept.iter().map(|&i| lp[i].exp()).sum();
    let mut out = vec![0.0; lp.len()];
    for i in kept {
        out[i] = lp[i].exp() / total;
    }
    out
}

/// Pearson's chi-square of `counts` against `probs` (cells expected below 5 pooled), its
/// degrees of freedom, and the number of draws that landed on a probability-0 pair.
fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> (f64, usize, u64) {
    let mut chi = 0.0;
    let mut cells = 0;
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    let mut impossible = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if p == 0.0 {
            impossible += c;
        } else if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
        } else {
            chi += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pooled_exp > 0.0 {
        chi += (pooled_obs - pooled_exp).powi(2) / pooled_exp;
        cells += 1;
    }
    (chi, cells - 1, impossible)
}

/// The chi-square quantile at 1 − 1e-4 (Wilson–Hilferty).
fn chi_square_critical(df: usize) -> f64 {
    let (k, z) = (df as f64, 3.719);
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn speculative_sampling_draws_two_tokens_from_the_exact_policy_distribution() {
    let v = 8usize;
    let cfg = ModelConfig::tiny_qwen2(v);
    let model = detached(&cfg, 45);
    // Every token occurs in the prompt, so the second token always has a draft.
    let prompt: Vec<u32> = vec![0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2];
    let params = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 5,
            top_p: 0.85,
            max_new_tokens: 2,
            ..Default::default()
        },
        confidence_top_j: 0,
        ..Default::default()
    };
    // The exact distribution of the two-token continuation.
    let next = |ids: &[u32]| -> Vec<f32> {
        let l = model
            .forward_sequence(ids)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        l.last().unwrap().clone()
    };
    let first = truncated(&next(&prompt), &params.sampling);
    let mut exact = vec![0.0; v * v];
    for a in 0..v {
        if first[a] == 0.0 {
            continue;
        }
        let mut ids = prompt.clone();
        ids.push(a as u32);
        let second = truncated(&next(&ids), &params.sampling);
        for b in 0..v {
            exact[a * v + b] = first[a] * second[b];
        }
    }
    let support = exact.iter().filter(|&&p| p > 0.0).count();
    assert!(support > 6, "a degenerate distribution: {exact:?}");
    let n = 20_000u64;
    for (speculative, seed0) in [(None, 1_000_000u64), (Some(spec()), 0)] {
        let mut eng = SamplingEngine::new(&model, None, engine_config(speculative.clone()));
        for i in 0..n {
            eng.add_sequence(prompt.clone(), params.clone(), seed0 + i)
                .unwrap();
        }
        eng.run_until_stop(None).unwrap();
        let mut counts = vec![0u64; v * v];
        for id in eng.ids() {
            let s = eng.sequence(id).unwrap();
            let g = &s.tokens[prompt.len()..];
            assert_eq!(g.len(), 2);
            counts[g[0] as usize * v + g[1] as usize] += 1;
        }
        let stats = eng.stats();
        if speculative.is_some() {
            assert_eq!(stats.drafted_tokens, n, "{stats:?}");
            assert!(stats.accepted_tokens > n / 20, "{stats:?}");
            assert!(stats.accepted_tokens < n - n / 20, "{stats:?}");
        }
        let (chi, df, impossible) = chi_square(&counts, &exact, n);
        let crit = chi_square_critical(df);
        assert_eq!(
            impossible, 0,
            "speculative {speculative:?}: draws outside the truncated distribution"
        );
        assert!(
            chi < crit,
            "speculative {speculative:?}: chi-square {chi:.1} > {crit:.1} ({df} df)"
        );
    }
}

#[test]
fn prompt_lookup_proposes_what_followed_the_latest_longest_match() {
    let cfg = spec();
    // The last 3 tokens [1, 2, 3] occur at 0 and 5: the later one's continuation.
    let toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 6, 4, 1, 2, 3];
    assert_eq!(prompt_lookup(&toks, &cfg, 10), vec![7, 8, 5, 6]);
    assert_eq!(prompt_lookup(&toks, &cfg, 2), vec![7, 8]);
    assert_eq!(prompt_lookup(&toks, &cfg, 0), Vec::<u32>::new());
    // Only the last token matches earlier: a 1-gram draft, cut at the end of the tokens.
    assert_eq!(prompt_lookup(&[4, 5, 6, 5], &cfg, 4), vec![6, 5]);
    assert_eq!(prompt_lookup(&[4, 5, 6, 7], &cfg, 4), Vec::<u32>::new());
    let strict = SpeculativeConfig {
        ngram_min: 2,
        ..spec()
    };
    assert_eq!(prompt_lookup(&[4, 5, 6, 5], &strict, 4), Vec::<u32>::new());
}

#[test]
fn speculative_settings_are_checked_by_name() {
    let model = detached(&ModelConfig::tiny_qwen2(32), 1);
    for (bad, key) in [
        (
            SpeculativeConfig {
                max_draft: 0,
                ..spec()
            },
            "speculative.max_draft",
        ),
        (
            SpeculativeConfig {
                ngram_min: 0,
                ..spec()
            },
            "speculative.ngram_min",
        ),
        (
            SpeculativeConfig {
                ngram_max: 1,
                ngram_min: 2,
                ..spec()
            },
            "speculative.ngram_max",
        ),
    ] {
        let mut eng = SamplingEngine::new(&model, None, engine_config(Some(bad)));
        let err = eng
            .add_sequence(vec![1, 2], SequenceParams::default(), 0)
            .unwrap_err();
        assert!(err.to_string().contains(key), "{err}");
    }
    let off: EngineConfig = serde_json::from_str(r#"{"max_batch_size": 4}"#).unwrap();
    assert_eq!(off.speculative, None);
}

/// Measurement, not a check (`cargo test --release -p turnwise-model --lib smollm2_copy --
/// --ignored --nocapture`): SmolLM2-135M-Instruct (the GGUF in the turnwise cache) asked to
/// copy a ~300-token passage, greedy, 64 new tokens, batch 1 and 8, speculation off and on:
/// tokens/s and the acceptance rate, and the outputs compared.
#[test]
#[ignore = "needs the SmolLM2 GGUF; a measurement, run in release"]
fn smollm2_copy_passage_speculation_on_and_off() {
    use std::time::Instant;
    let cache = turnwise_core::pip::default_cache_dir();
    let path = crate::checkpoint::gguf::smollm2::gguf_path(&cache).expect("the SmolLM2 GGUF");
    let ck = crate::checkpoint::GgufCheckpoint::open(&path).unwrap();
    let cfg = ck.config().unwrap();
    let tensors = ck
        .tensors(&cfg, DType::F32, &candle_core::Device::Cpu)
        .unwrap();
    let model = Transformer::from_tensors(&cfg, &tensors, "SmolLM2 GGUF").unwrap();
    let tok = ck.tokenizer().unwrap();
    let sentences = [
        "The river Elbe rises in the Krkonose mountains on the northern border of the Czech Republic and flows for about 1,094 kilometres before it reaches the North Sea at Cuxhaven.",
        "Along its course it passes through Dresden, Magdeburg and Hamburg, and for centuries it carried salt, grain and timber between Bohemia and the coast.",
        "In 1842 a great fire destroyed much of the old town of Hamburg, and the city was rebuilt with wider streets, new canals and a modern sewer system designed by William Lindley.",
        "The river's floodplains are home to white storks, beavers and sea eagles, and large parts of the middle Elbe were declared a biosphere reserve by UNESCO in 1979.",
        "Severe floods in August 2002 and again in June 2013 damaged bridges, railways and historic buildings, and led to new dykes and retention basins along the upper river.",
        "Today the port of Hamburg is one of the largest in Europe, handling millions of containers every year, while smaller harbours upstream serve barges and passenger ships.",
        "Cyclists follow the Elbe Cycle Route, which runs beside the water from the Czech border to the sea and is among the most popular long-distance routes in Germany.",
    ];
    let prompt_for = |rot: usize| {
        let passage: Vec<&str> = (0..sentences.len())
            .map(|i| sentences[(i + rot) % sentences.len()])
            .collect();
        let text = format!(
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCopy the following passage exactly, word for word.\n\n{}<|im_end|>\n<|im_start|>assistant\n",
            passage.join(" ")
        );
        tok.encode(&text).unwrap()
    };
    let eos = tok.special_id("<|im_end|>").unwrap();
    let params = SequenceParams {
        sampling: SamplingParams {
            temperature: 0.0,
            max_new_tokens: 64,
            stop_token_ids: vec![eos],
            ..Default::default()
        },
        ..Default::default()
    };
    println!("prompt tokens: {} (row 0)", prompt_for(0).len());
    for batch in [1usize, 8] {
        let mut outputs: Vec<Vec<Vec<u32>>> = Vec::new();
        for speculative in [None, Some(spec())] {
            let mut eng =
                SamplingEngine::new(&model, Some(&tok), engine_config(speculative.clone()));
            let ids: Vec<SeqId> = (0..batch)
                .map(|r| {
                    eng.add_sequence(prompt_for(r), params.clone(), r as u64)
                        .unwrap()
                })
                .collect();
            let start = Instant::now();
            eng.step(None).unwrap(); // the prefill (and the first decode step)
            let prefilled = Instant::now();
            eng.run_until_stop(None).unwrap();
            let end = Instant::now();
            let toks: Vec<Vec<u32>> = ids
                .iter()
                .map(|&id| {
                    let s = eng.sequence(id).unwrap();
                    s.tokens[s.prompt_len..].to_vec()
                })
                .collect();
            let n: usize = toks.iter().map(Vec::len).sum();
            let st = eng.stats();
            println!(
                "batch {batch} speculative {:5}: {n} tokens, {:.2} s total ({:.1} tok/s), after the prefill step {:.2} s ({:.1} tok/s), {} steps, drafted {} accepted {} (rate {:.2})",
                speculative.is_some(),
                (end - start).as_secs_f64(),
                n as f64 / (end - start).as_secs_f64(),
                (end - prefilled).as_secs_f64(),
                n as f64 / (end - prefilled).as_secs_f64(),
                st.steps,
                st.drafted_tokens,
                st.accepted_tokens,
                st.accepted_tokens as f64 / st.drafted_tokens.max(1) as f64,
            );
            if batch == 1 {
                println!("  output: {:?}", tok.decode(&toks[0], false).unwrap());
            }
            outputs.push(toks);
        }
        assert_eq!(
            outputs[0], outputs[1],
            "speculation changed the greedy output"
        );
    }
}

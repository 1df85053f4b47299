use std::collections::HashSet;

use super::oracle::{Action, AgentFormat, NoiseEvent, Oracle, OracleConfig, OracleNoise};
use super::*;
use crate::corpus::{read_corpus, read_qa, split_contents};
use crate::search::Retriever;
use crate::search::bm25::{Bm25BuildOptions, Bm25Index};
use crate::search::bm25_mem::InMemoryBm25;

fn small_config(seed: u64) -> WorldConfig {
    WorldConfig {
        seed,
        countries: 8,
        cities: 30,
        companies: 25,
        persons: 80,
        distractors: 20,
        questions: QuestionConfig {
            train: 200,
            validation: 60,
            test: 60,
            hop_weights: [1.0, 1.0, 1.0, 1.0],
        },
        ..WorldConfig::default()
    }
}

#[test]
fn generation_is_deterministic_from_the_seed() {
    let a = World::generate(&small_config(3)).unwrap();
    let b = World::generate(&small_config(3)).unwrap();
    assert_eq!(a, b);
    let c = World::generate(&small_config(4)).unwrap();
    assert_ne!(a.entities, c.entities);
    // Asking for more questions leaves the entities unchanged.
    let mut more = small_config(3);
    more.questions.train = 500;
    assert_eq!(World::generate(&more).unwrap().entities, a.entities);
    // Pinned output: a change here means worlds built from the same seed changed across versions.
    let d = World::generate(&WorldConfig::default()).unwrap();
    let pinned: Vec<&str> = d.entities.iter().take(3).map(|e| e.name.as_str()).collect();
    assert_eq!(pinned, PINNED_NAMES, "{pinned:?}");
    assert_eq!(d.questions[0].text, PINNED_QUESTION);
}

const PINNED_NAMES: [&str; 3] = ["Vinost", "Pivel", "Rakmun"];
const PINNED_QUESTION: &str = "Which company does Rada Cradovel work for?";

#[test]
fn entities_relations_and_passages_are_well_formed() {
    let w = World::generate(&WorldConfig::default()).unwrap();
    assert_eq!(w.entities.len(), 750);
    let names: HashSet<&str> = w.entities.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names.len(), 750, "names are unique");
    for e in &w.entities {
        let wanted: &[Relation] = match e.kind {
            EntityKind::Country => &[Relation::Capital],
            EntityKind::City => &[Relation::InCountry],
            EntityKind::Company => &[Relation::FoundedBy, Relation::BasedIn],
            EntityKind::Person => &[Relation::BornIn, Relation::WorksFor],
        };
        for &r in wanted {
            let o = e.get(r).unwrap_or_else(|| panic!("{} lacks {r:?}", e.name));
            assert_eq!(w.entities[o].kind, r.object_kind());
        }
        match e.kind {
            EntityKind::Company => {
                let suffix = e.name.rsplit(' ').next().unwrap();
                assert!(COMPANY_SUFFIXES.contains(&suffix), "{}", e.name);
            }
            EntityKind::Person => assert_eq!(e.name.split(' ').count(), 2),
            _ => assert_eq!(e.name.split(' ').count(), 1),
        }
        if e.kind == EntityKind::Country {
            let capital = e.get(Relation::Capital).unwrap();
            assert_eq!(w.entities[capital].get(Relation::InCountry), Some(e.id));
        }
        // 2-3 sentences, the name in each, every fact readable back from the passage.
        let p = w.passage(e.id);
        let sentences: Vec<&str> = p.split(". ").collect();
        assert!((2..=3).contains(&sentences.len()), "{p}");
        assert!(sentences.iter().all(|s| s.contains(&e.name)), "{p}");
        for &(r, o) in &e.facts {
            assert_eq!(
                r.parse(&p, &e.name),
                Some(w.entities[o].name.as_str()),
                "{p}"
            );
        }
    }
    let docs = w.documents();
    assert_eq!(docs.len(), 750);
    assert_eq!(split_contents(&docs[42].contents).0, w.entities[42].name);
}

#[test]
fn splits_hold_out_subjects_and_chains_follow_relations() {
    let w = World::generate(&small_config(11)).unwrap();
    let train_subjects: HashSet<EntityId> =
        w.questions_in(Split::Train).map(|q| q.subject).collect();
    let val: HashSet<EntityId> = w
        .questions_in(Split::Validation)
        .map(|q| q.subject)
        .collect();
    let test: HashSet<EntityId> = w.questions_in(Split::Test).map(|q| q.subject).collect();
    assert!(train_subjects.is_disjoint(&val) && train_subjects.is_disjoint(&test));
    assert!(val.is_disjoint(&test));
    assert_eq!(w.questions_in(Split::Train).count(), 200);
    assert_eq!(w.questions_in(Split::Validation).count(), 60);
    assert_eq!(w.questions_in(Split::Test).count(), 60);
    // About 20 % of each kind is held out.
    for kind in EntityKind::ALL {
        let ids = w.ids_of(kind);
        let held = ids
            .iter()
            .filter(|&&i| w.subject_split[i] != Split::Train)
            .count();
        let expected = (ids.len() as f64 * 0.2).round() as usize;
        assert_eq!(held, expected, "{kind:?}");
    }
    let mut hops_seen = [0usize; 4];
    for q in &w.questions {
        hops_seen[q.hops() - 1] += 1;
        assert_eq!(w.subject_split[q.subject], q.split);
        assert!(q.text.contains(&q.subject_name));
        let mut at = q.subject;
        for (i, &r) in q.relations.iter().enumerate() {
            at = w.entities[at].get(r).unwrap();
            assert_eq!(q.chain[i], at);
            assert_eq!(q.chain_names[i], w.entities[at].name);
        }
        assert_eq!(q.golden_answers[0], w.entities[at].name);
        assert_eq!(&q.golden_answers[1..], w.entities[at].aliases.as_slice());
    }
    assert!(hops_seen.iter().all(|&n| n > 30), "{hops_seen:?}");
    // Questions of a split and hop count are distinct until their pool of (template, subject)
    // pairs runs out.
    for split in Split::ALL {
        for hops in 1..=4 {
            let pool: usize = TEMPLATES
                .iter()
                .filter(|t| t.hops() == hops)
                .map(|t| {
                    w.ids_of(t.subject_kind())
                        .iter()
                        .filter(|&&i| w.subject_split[i] == split)
                        .count()
                })
                .sum();
            let qs: Vec<&str> = w
                .questions_in(split)
                .filter(|q| q.hops() == hops)
                .map(|q| q.text.as_str())
                .collect();
            let distinct: HashSet<&str> = qs.iter().copied().collect();
            assert_eq!(distinct.len(), qs.len().min(pool), "{split:?} {hops}");
        }
    }
    // Every template is well-typed: consecutive relations chain.
    for t in TEMPLATES {
        for pair in t.relations.windows(2) {
            assert_eq!(pair[0].object_kind(), pair[1].subject_kind(), "{}", t.id);
        }
        assert!(t.text.contains("{s}"));
    }
}

#[test]
fn export_writes_search_r1_corpus_and_qa_files() {
    let w = World::generate(&small_config(5)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.write_search_r1(dir.path()).unwrap();
    let corpus = read_corpus(dir.path().join("corpus.jsonl")).unwrap();
    assert_eq!(corpus, w.documents());
    assert_eq!(corpus.len(), w.entities.len() + 20);
    let test = read_qa(dir.path().join("test.jsonl")).unwrap();
    assert_eq!(test.len(), 60);
    let q0 = w.questions_in(Split::Test).next().unwrap();
    assert_eq!(test[0], q0.to_qa());
    assert_eq!(test[0].metadata["hops"], q0.hops());
    let back: World =
        serde_json::from_slice(&std::fs::read(dir.path().join("world.json")).unwrap()).unwrap();
    assert_eq!(back, w);
}

/// With a person-name pool, persons share given and family names (full names stay unique), and
/// every word of a held-out person's name also names some person asked about in training.
#[test]
fn person_name_pool_shares_words_across_persons() {
    let config = WorldConfig {
        seed: 5,
        person_name_pool: 40,
        ..WorldConfig::default()
    };
    let w = World::generate(&config).unwrap();
    let persons: Vec<&Entity> = w
        .entities
        .iter()
        .filter(|e| e.kind == EntityKind::Person)
        .collect();
    assert_eq!(persons.len(), 450);
    let full: HashSet<&str> = persons.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(full.len(), persons.len(), "full names are unique");
    let given: HashSet<&str> = persons
        .iter()
        .map(|e| e.name.split(' ').next().unwrap())
        .collect();
    let family: HashSet<&str> = persons
        .iter()
        .map(|e| e.name.split(' ').nth(1).unwrap())
        .collect();
    assert!(given.len() <= 40 && given.len() > 30, "{}", given.len());
    assert!(family.len() <= 40 && family.len() > 30, "{}", family.len());
    assert!(given.is_disjoint(&family));
    // No other entity is named with a person word.
    for e in w.entities.iter().filter(|e| e.kind != EntityKind::Person) {
        for word in e.name.split(' ') {
            assert!(
                !given.contains(word) && !family.contains(word),
                "{}",
                e.name
            );
        }
    }
    let train_words: HashSet<&str> = w
        .questions_in(Split::Train)
        .filter(|q| w.entities[q.subject].kind == EntityKind::Person)
        .flat_map(|q| q.subject_name.split(' '))
        .collect();
    let heldout: Vec<&Question> = w
        .questions_in(Split::Test)
        .filter(|q| w.entities[q.subject].kind == EntityKind::Person)
        .collect();
    assert!(!heldout.is_empty());
    for q in heldout {
        assert!(
            q.subject_name.split(' ').all(|x| train_words.contains(x)),
            "{}",
            q.subject_name
        );
    }
    // A pool too small for the persons is refused by name.
    let c = WorldConfig {
        person_name_pool: 20,
        ..WorldConfig::default()
    };
    let msg = World::generate(&c).unwrap_err().to_string();
    assert!(msg.contains("person_name_pool"), "{msg}");
}

#[test]
fn config_errors_name_the_field() {
    let c = WorldConfig {
        cities: 3,
        ..WorldConfig::default()
    };
    let msg = World::generate(&c).unwrap_err().to_string();
    assert!(msg.contains("cities"), "{msg}");
    let mut c = WorldConfig::default();
    c.questions.hop_weights = [0.0; 4];
    assert!(
        World::generate(&c)
            .unwrap_err()
            .to_string()
            .contains("hop_weights")
    );
    let c = WorldConfig {
        syllables: 3,
        ..WorldConfig::default()
    };
    assert!(matches!(
        World::generate(&c),
        Err(WorldError::NameSpace { .. })
    ));
}

/// For every entity, searching its exact name returns its own passage first (the property the
/// quickstart world relies on), with BM25 on disk, also with distractors and confusable names.
#[test]
fn exact_name_query_returns_own_passage_first() {
    let mut configs = vec![WorldConfig::default()];
    configs.push(WorldConfig {
        seed: 9,
        confusability: 0.5,
        distractors: 300,
        ..WorldConfig::default()
    });
    configs.push(WorldConfig {
        seed: 4,
        person_name_pool: 40,
        ..WorldConfig::default()
    });
    for config in configs {
        let w = World::generate(&config).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let index =
            Bm25Index::build(dir.path(), &w.documents(), &Bm25BuildOptions::default()).unwrap();
        let queries: Vec<String> = w.entities.iter().map(|e| e.name.clone()).collect();
        let results = index.retrieve(&queries, 3).unwrap();
        let mem = InMemoryBm25::new(w.documents());
        let mem_results = mem.retrieve(&queries, 3).unwrap();
        for (e, (hits, mem_hits)) in w.entities.iter().zip(results.iter().zip(&mem_results)) {
            assert_eq!(
                hits[0].document.id,
                e.id.to_string(),
                "{}: {hits:?}",
                e.name
            );
            assert_eq!(mem_hits[0].document.id, e.id.to_string(), "{}", e.name);
        }
        if config.confusability > 0.0 {
            // Confusability really produced shared surnames.
            let surnames: Vec<&str> = w
                .entities
                .iter()
                .filter(|e| e.kind == EntityKind::Person)
                .map(|e| e.name.split(' ').nth(1).unwrap())
                .collect();
            let distinct: HashSet<&&str> = surnames.iter().collect();
            assert!(
                distinct.len() < surnames.len() * 3 / 4,
                "{}",
                distinct.len()
            );
        }
    }
}

#[test]
fn oracle_without_noise_answers_everything_and_noise_lowers_em() {
    let w = World::generate(&small_config(21)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let index = Bm25Index::build(dir.path(), &w.documents(), &Bm25BuildOptions::default()).unwrap();
    let em = |config: OracleConfig| {
        let oracle = Oracle::new(&w, &index, config);
        let mut correct = 0;
        let mut transcripts = Vec::new();
        for q in &w.questions {
            let t = oracle.answer(q).unwrap();
            correct += usize::from(t.exact_match(&q.golden_answers));
            transcripts.push(t);
        }
        (correct as f64 / w.questions.len() as f64, transcripts)
    };
    for format in [
        AgentFormat::SearchR1,
        AgentFormat::Boxed,
        AgentFormat::T2po,
        AgentFormat::Verifiers,
    ] {
        let (score, ts) = em(OracleConfig {
            format,
            ..OracleConfig::default()
        });
        assert_eq!(score, 1.0, "{format:?}");
        for (t, q) in ts.iter().zip(&w.questions) {
            assert_eq!(t.searches(), q.hops());
            assert!(t.noise.is_none());
        }
        let text = ts.last().unwrap().render();
        match format {
            AgentFormat::SearchR1 => {
                assert!(text.starts_with("<think>I need to search for "), "{text}");
                assert!(
                    text.contains("</search>\n\n<information>Doc 1(Title: \""),
                    "{text}"
                );
                assert!(text.contains("</think>\n<answer>"), "{text}");
                assert!(text.ends_with("</answer>"));
            }
            AgentFormat::Boxed => {
                assert!(text.contains("</search> <result>\nDoc 1(Title: "), "{text}");
                assert!(text.ends_with(&format!(
                    "<answer>\\boxed{{{}}}</answer>",
                    ts.last().unwrap().answer
                )));
            }
            AgentFormat::T2po => {
                assert!(text.contains("</think><action><search>"), "{text}");
                assert!(text.ends_with("</answer></action>"), "{text}");
            }
            AgentFormat::Verifiers => {
                assert!(
                    text.starts_with("<reasoning>I need to search for "),
                    "{text}"
                );
                assert!(
                    text.contains("\"}}</tool> <result>\nDoc 1(Title: "),
                    "{text}"
                );
                assert!(text.ends_with("</answer>"), "{text}");
                // Every tool call parses back to its query.
                for turn in &ts.last().unwrap().turns {
                    if let super::oracle::Action::Search(q) = &turn.action {
                        let call = format.render_action(&turn.think, &turn.action);
                        assert_eq!(
                            turnwise_core::grammar::parse_turn(
                                turnwise_core::grammar::Format::Verifiers,
                                &call
                            )
                            .action,
                            turnwise_core::grammar::Action::Search { query: q.clone() }
                        );
                    }
                }
            }
        }
        let segs = ts[0].segments();
        assert_eq!(segs.iter().filter(|s| s.1).count(), ts[0].turns.len());
        assert!(!segs.last().unwrap().0.is_empty() && segs.last().unwrap().1);
    }

    // The in-memory BM25 works as a retriever too.
    let mem = InMemoryBm25::new(w.documents());
    let oracle = Oracle::new(&w, &mem, OracleConfig::default());
    assert!(
        w.questions
            .iter()
            .take(50)
            .all(|q| oracle.answer(q).unwrap().exact_match(&q.golden_answers))
    );

    // Each kind of noise alone lowers EM, and the error is recorded.
    let kinds = [
        OracleNoise {
            wrong_query: 0.5,
            ..OracleNoise::none()
        },
        OracleNoise {
            premature_answer: 0.5,
            ..OracleNoise::none()
        },
        OracleNoise {
            skip_search: 0.5,
            ..OracleNoise::none()
        },
        OracleNoise {
            wrong_answer: 0.5,
            ..OracleNoise::none()
        },
    ];
    for noise in kinds {
        let (score, ts) = em(OracleConfig {
            noise,
            seed: 1,
            ..OracleConfig::default()
        });
        let noisy = ts.iter().filter(|t| t.noise.is_some()).count() as f64 / ts.len() as f64;
        assert!(noisy > 0.25, "{noise:?}: {noisy}");
        assert!(score < 0.85, "{noise:?}: EM {score}");
        assert!(score > 0.3, "{noise:?}: EM {score}");
        for (t, q) in ts.iter().zip(&w.questions) {
            match t.noise {
                Some(NoiseEvent::PrematureAnswer { hop }) => assert_eq!(t.searches(), hop),
                Some(NoiseEvent::SkippedSearch { .. }) => assert_eq!(t.searches() + 1, q.hops()),
                Some(NoiseEvent::WrongQuery { .. } | NoiseEvent::WrongAnswer) => {
                    assert_eq!(t.searches(), q.hops())
                }
                None => assert!(t.exact_match(&q.golden_answers)),
            }
        }
    }
    // The noise is reproducible from the seed.
    let cfg = OracleConfig {
        noise: OracleNoise::uniform(0.4),
        seed: 5,
        ..OracleConfig::default()
    };
    assert_eq!(em(cfg.clone()).1, em(cfg).1);
}

/// `validation_fraction` only moves held-out subjects from validation to test: the entities,
/// passages and training questions are those of the default even split, and the held-out
/// subjects are the same set, cut at another point.
#[test]
fn validation_fraction_moves_held_out_subjects_only() {
    let mut even = small_config(5);
    even.heldout_fraction = 0.3;
    let mut third = even.clone();
    third.validation_fraction = Some(0.1);
    let generate = |c: &WorldConfig| World::generate(c).unwrap();
    let (a, b) = (generate(&even), generate(&third));
    assert_eq!(a.entities, b.entities);
    assert_eq!(a.documents(), b.documents());
    let train = |w: &World| w.questions_in(Split::Train).cloned().collect::<Vec<_>>();
    assert_eq!(train(&a), train(&b));
    let of = |w: &World, s: Split| -> HashSet<EntityId> {
        (0..w.entities.len())
            .filter(|&i| w.subject_split[i] == s)
            .collect()
    };
    let held = |w: &World| &of(w, Split::Validation) | &of(w, Split::Test);
    assert_eq!(held(&a), held(&b));
    assert!(of(&b, Split::Validation).is_subset(&of(&a, Split::Validation)));
    assert!(of(&a, Split::Test).is_subset(&of(&b, Split::Test)));
    // 10 % of each kind's subjects, rounded down: 8 countries, 30 cities, 25 companies, 80
    // persons.
    assert_eq!(of(&b, Split::Validation).len(), 3 + 2 + 8);
    assert!(of(&b, Split::Test).len() > of(&a, Split::Test).len());
    // Half the held-out fraction is the unset split where each kind's cut is even or whole
    // (here 30 % of 30 cities and of 80 persons; 8 countries and 25 companies cut 2.4 and 7.5).
    let mut half = even.clone();
    half.countries = 10;
    half.companies = 20;
    let mut explicit = half.clone();
    explicit.validation_fraction = Some(0.15);
    let (h, e) = (generate(&half), generate(&explicit));
    assert_eq!(h.subject_split, e.subject_split);
    assert_eq!(h.questions, e.questions);
    // A fraction above the held-out one is refused.
    let mut bad = even.clone();
    bad.validation_fraction = Some(0.4);
    let err = World::generate(&bad).unwrap_err().to_string();
    assert!(err.contains("validation_fraction"), "{err}");
}

/// Word-level tokens of a text: words and single punctuation marks (as the word-level
/// tokenizer splits them).
fn word_tokens(text: &str) -> usize {
    let mut n = 0;
    let mut in_word = false;
    for c in text.chars() {
        if c.is_alphanumeric() {
            n += usize::from(!in_word);
            in_word = true;
        } else {
            in_word = false;
            n += usize::from(!c.is_whitespace());
        }
    }
    n
}

/// `thoughts = "long"` changes only the text inside the think tags: the same searches, answers
/// and noise as the short style, with reasoning of 20–40 word-level tokens a turn that restates
/// the facts met so far, worded reproducibly from the oracle seed.
#[test]
fn long_thoughts_reason_for_tens_of_tokens_and_change_nothing_else() {
    let short_world = World::generate(&small_config(21)).unwrap();
    let long_world = World::generate(&WorldConfig {
        thoughts: ThoughtStyle::Long,
        ..small_config(21)
    })
    .unwrap();
    assert_eq!(short_world.documents(), long_world.documents());
    assert_eq!(short_world.questions, long_world.questions);
    assert_eq!(WorldConfig::default().thoughts, ThoughtStyle::Short);
    let index = InMemoryBm25::new(short_world.documents());
    for (format, noise) in [
        (AgentFormat::T2po, OracleNoise::none()),
        (AgentFormat::SearchR1, OracleNoise::uniform(0.8)),
        (AgentFormat::Verifiers, OracleNoise::uniform(0.4)),
    ] {
        let cfg = OracleConfig {
            format,
            noise,
            seed: 3,
            ..OracleConfig::default()
        };
        let short = Oracle::new(&short_world, &index, cfg.clone());
        let long = Oracle::new(&long_world, &index, cfg.clone());
        let again = Oracle::new(&long_world, &index, cfg);
        let (mut wordings, mut tokens) = (HashSet::new(), Vec::new());
        for q in &short_world.questions {
            let (s, l) = (short.answer(q).unwrap(), long.answer(q).unwrap());
            assert_eq!(l, again.answer(q).unwrap(), "reproducible");
            assert_eq!((&l.answer, l.noise), (&s.answer, s.noise));
            assert_eq!(l.turns.len(), s.turns.len());
            for (k, (lt, st)) in l.turns.iter().zip(&s.turns).enumerate() {
                assert_eq!((&lt.action, &lt.observation), (&st.action, &st.observation));
                let n = word_tokens(&lt.think);
                assert!(
                    (18..=40).contains(&n),
                    "{} turn {k}: {n}: {}",
                    q.id,
                    lt.think
                );
                assert!(word_tokens(&st.think) <= 12, "{}", st.think);
                assert!(!lt.think.contains('<') && !lt.think.contains('>'));
                tokens.push(n);
                // The first sentence of a later turn restates the last hop's fact.
                wordings.insert(lt.think.split(' ').take(3).collect::<Vec<_>>().join(" "));
                if let (Action::Search(query), 1..) = (&lt.action, k) {
                    assert!(lt.think.ends_with(&format!("search for {query}.")));
                }
            }
            // Every turn still parses in its format, to the same action.
            let grammar = match format {
                AgentFormat::T2po => turnwise_core::grammar::Format::T2po,
                AgentFormat::SearchR1 => turnwise_core::grammar::Format::SearchR1,
                _ => turnwise_core::grammar::Format::Verifiers,
            };
            for turn in &l.turns {
                let text = format.render_action(&turn.think, &turn.action);
                let parsed = turnwise_core::grammar::parse_turn(grammar, &text);
                assert!(parsed.verdict.is_valid(), "{format:?}: {text}");
                match (&turn.action, &parsed.action) {
                    (Action::Search(q), turnwise_core::grammar::Action::Search { query }) => {
                        assert_eq!(q, query)
                    }
                    (Action::Answer(a), turnwise_core::grammar::Action::Answer { text }) => {
                        assert_eq!(a, text)
                    }
                    other => panic!("{format:?}: {other:?}"),
                }
            }
            if noise == OracleNoise::none() {
                let last = l.turns.last().unwrap();
                assert!(last.think.contains(&l.answer), "{}", last.think);
                assert!(l.exact_match(&q.golden_answers));
            }
        }
        let mean = tokens.iter().sum::<usize>() as f64 / tokens.len() as f64;
        assert!(mean > 25.0, "{format:?}: mean {mean}");
        assert!(wordings.len() >= 6, "{format:?}: {wordings:?}");
    }
}

/// `decision_density` ρ < 1 adds `round((h + 1)(1 − ρ)/ρ)` routine turns to an h-hop question
/// and changes no entity, passage or question; the oracle makes them first, and the search
/// environment, given the question's routine turns, answers every turn of the oracle's
/// transcript with the observation the transcript holds (routine turns not counting towards
/// `max_turns`). ρ = 1, the default, adds none.
#[test]
fn decision_density_adds_routine_turns_and_changes_nothing_else() {
    use crate::env::{Environment, ROUTINE_TURNS_PARAM, SearchEnv, SearchEnvConfig, Task};
    let base = World::generate(&small_config(5)).unwrap();
    let sparse_cfg = WorldConfig {
        decision_density: 0.5,
        ..small_config(5)
    };
    let sparse = World::generate(&sparse_cfg).unwrap();
    assert_eq!(base.documents(), sparse.documents());
    assert_eq!(base.questions, sparse.questions);
    for h in 1..=4 {
        assert_eq!(WorldConfig::default().routine_turns(h), 0);
        assert_eq!(sparse_cfg.routine_turns(h), h + 1);
    }
    let quarter = WorldConfig {
        decision_density: 0.25,
        ..WorldConfig::default()
    };
    assert_eq!(quarter.routine_turns(1), 6);
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let c = WorldConfig {
            decision_density: bad,
            ..WorldConfig::default()
        };
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("decision_density"), "{bad}: {msg}");
    }
    let index = InMemoryBm25::new(base.documents());
    let shared: std::sync::Arc<dyn Retriever> =
        std::sync::Arc::new(InMemoryBm25::new(base.documents()));
    for (format, grammar) in [
        (
            AgentFormat::SearchR1,
            turnwise_core::grammar::Format::SearchR1,
        ),
        (AgentFormat::Boxed, turnwise_core::grammar::Format::Boxed),
    ] {
        let cfg = OracleConfig {
            format,
            ..OracleConfig::default()
        };
        let plain = Oracle::new(&base, &index, cfg.clone());
        let routine = Oracle::new(&sparse, &index, cfg);
        let mut env = SearchEnv::new(
            shared.clone(),
            SearchEnvConfig {
                format: grammar,
                max_turns: 5,
                ..SearchEnvConfig::default()
            },
        )
        .unwrap();
        let mut beyond_max_turns = 0;
        for q in base.questions.iter().take(60) {
            let (p, r) = (plain.answer(q).unwrap(), routine.answer(q).unwrap());
            let n = sparse_cfg.routine_turns(q.hops());
            assert_eq!(r.turns.len(), p.turns.len() + n, "{}", q.id);
            assert_eq!(&r.turns[n..], &p.turns[..], "{}", q.id);
            assert_eq!(r.answer, p.answer);
            beyond_max_turns += usize::from(r.turns.len() > 5);
            let mut task = Task {
                id: q.id.clone(),
                prompt: Some(q.text.clone()),
                answers: q.golden_answers.clone(),
                ..Task::default()
            };
            task.params.insert(ROUTINE_TURNS_PARAM.into(), n.into());
            env.reset(&task).unwrap();
            for (k, turn) in r.turns.iter().enumerate() {
                let step = env
                    .step(&format.render_action(&turn.think, &turn.action))
                    .unwrap();
                match &turn.observation {
                    Some(obs) => {
                        assert!(!step.done, "{} turn {k}", q.id);
                        assert_eq!(&step.observation.text, obs, "{} turn {k}", q.id);
                    }
                    None => {
                        assert!(step.done && step.reward == 1.0, "{} turn {k}", q.id);
                    }
                }
            }
        }
        assert!(
            beyond_max_turns > 0,
            "no transcript was longer than max_turns"
        );
    }
}

//! Shared test settings.

/// Overrides that shrink any preset to seconds.
#[allow(dead_code)]
pub fn tiny_overrides() -> Vec<String> {
    [
        "task.world.countries=4",
        "task.world.cities=8",
        "task.world.companies=6",
        "task.world.persons=16",
        "task.world.questions.train=40",
        "task.world.questions.validation=8",
        "task.world.questions.test=8",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "sft.steps=3",
        "sft.batch_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=3",
        "rollout.max_turn_tokens=12",
        "rollout.max_response_tokens=120",
        "optim.mini_batch_size=3",
        "run.steps=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Installs `turnwise serve` as the process's policy host, as the `turnwise` binary does at
/// start: a test whose trainer serves a policy (`rollout.backend = "harness"`, `judge.serve`)
/// calls it first.
#[allow(dead_code)]
pub fn install_policy_host() {
    turnwise::rollout::host::install(std::sync::Arc::new(turnwise::serve::LocalHost));
}

/// Copies the directory tree `from` to `to` (a run directory, to "kill" or corrupt a copy).
#[allow(dead_code)]
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Whether a metrics key is a wall-clock figure, which differs from run to run of the same
/// computation: `time`, `timing_s/*` and `perf/throughput` (tokens per second of the step).
#[allow(dead_code)]
pub fn wall_clock(key: &str) -> bool {
    key == "time" || key.starts_with("timing_s/") || key == "perf/throughput"
}

/// The lines of `phase` in the metrics file `path`, without their wall-clock fields
/// ([`wall_clock`]), so that two runs' lines compare equal when their numbers do.
#[allow(dead_code)]
pub fn phase_lines(path: &std::path::Path, phase: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["phase"] == phase)
        .map(|mut v| {
            v.as_object_mut().unwrap().retain(|k, _| !wall_clock(k));
            v
        })
        .collect()
}

/// Runs the `turnwise` binary with `args` in `cwd` (no `RUST_LOG` from the caller's shell).
#[allow(dead_code)]
pub fn turnwise_in(args: &[String], cwd: &std::path::Path) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(args)
        .current_dir(cwd)
        .env_remove("RUST_LOG")
        .output()
        .expect("the turnwise binary runs")
}

/// Plays `texts` as the agent's turns on question `q` of `t`'s task through the rollout's
/// episode bookkeeping (what a rollout records, each text encoded with the run's tokenizer as if
/// sampled, with made-up log-probs).
#[allow(dead_code)]
pub fn play_turns<S: AsRef<str>>(
    t: &turnwise::trainer::Trainer,
    q: &turnwise::task::QaItem,
    texts: &[S],
) -> turnwise::rollout::Episode {
    use turnwise::rollout::{Decoding, EpisodeSpec, EpisodeState};
    use turnwise::task::TaskSet;
    use turnwise_model::sampling::{Completion, FinishReason};

    let policy = t.rollout_policy();
    let decoding = Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 64,
        max_response_tokens: 400,
    };
    let spec = EpisodeSpec {
        id: format!("play-{}", q.id),
        prompt_uid: q.id.clone(),
        prompt_ids: t.tokenizer.encode(&t.task.prompt(q).unwrap()).unwrap(),
        task: TaskSet::env_task(q),
        seed: 0,
    };
    let mut state = EpisodeState::start(spec, t.task.env().unwrap()).unwrap();
    for text in texts {
        let tokens = t.tokenizer.encode(text.as_ref()).unwrap();
        let n = tokens.len();
        let completion = Completion {
            tokens,
            logprobs: vec![-0.5; n],
            entropies: vec![0.5; n],
            top_logprobs: vec![Vec::new(); n],
            finish: FinishReason::Length,
        };
        state.apply_turn(&policy, completion, &decoding).unwrap();
    }
    state.finish()
}

/// The values of named gradients, flattened, sorted by name (to compare two gradients).
#[allow(dead_code)]
pub fn sorted_values(g: &turnwise_model::optim::Gradients) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = g
        .iter()
        .map(|(k, t)| {
            (
                k.clone(),
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Runs `preset` (tiny, 4 steps, checkpoints at 2 and 4) uninterrupted in `a`, copies it to `b`
/// with the step-4 checkpoint left incomplete (a kill after step 2) and resumes `b`.
#[allow(dead_code)]
pub fn run_and_resume(
    preset: &str,
    extra: &[&str],
    tmp: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let mut sets = tiny_overrides();
    sets.extend(
        [
            "run.steps=4",
            "run.save_every=2",
            "run.keep_checkpoints=3",
            "eval.questions=3",
        ]
        .map(String::from),
    );
    sets.extend(extra.iter().map(|s| s.to_string()));
    let cfg = turnwise::config::TrainConfig::resolve(Some(preset), None, &sets).unwrap();
    let a = tmp.join("a");
    turnwise::pipeline::run(
        cfg,
        &turnwise::pipeline::RunOptions {
            dir: a.clone(),
            quiet: true,
        },
        false,
    )
    .unwrap();
    assert!(a.join("checkpoints/step-00004/COMPLETE").is_file());
    let b = tmp.join("b");
    copy_dir(&a, &b);
    std::fs::remove_file(b.join("checkpoints/step-00004/COMPLETE")).unwrap();
    // What the killed run had written of step 4 must not be what the resumed run reports.
    for f in ["model.safetensors", "critic.safetensors"] {
        let p = b.join("checkpoints/step-00004").join(f);
        if p.is_file() {
            std::fs::remove_file(p).unwrap();
        }
    }
    turnwise::pipeline::resume(&b, true).unwrap();
    (a, b)
}

/// What `metrics.jsonl` holds, as TensorBoard scalars: `(step, tag, value as f32, time)`.
#[allow(dead_code)]
pub fn metrics_as_scalars(run: &std::path::Path) -> Vec<(i64, String, f32, f64)> {
    let log = turnwise::run::read_metrics(run.join("metrics.jsonl")).unwrap();
    let mut out = Vec::new();
    for r in &log.records {
        let values: std::collections::BTreeMap<String, f64> = r
            .values
            .iter()
            .filter_map(|(k, v)| v.map(|v| (k.clone(), v)))
            .collect();
        for (tag, v) in turnwise::run::tensorboard::metric_tags(&r.phase, &values) {
            out.push((r.step as i64, tag, v as f32, r.time.unwrap()));
        }
    }
    out
}

/// The scalars of the run's one event file, in file order.
#[allow(dead_code)]
pub fn event_scalars(run: &std::path::Path) -> Vec<(i64, String, f32, f64)> {
    let files = turnwise::run::tensorboard::event_files(run.join("tensorboard")).unwrap();
    assert_eq!(files.len(), 1, "{files:?}");
    let events = turnwise::run::tensorboard::read_event_file(&files[0]).unwrap();
    assert!(matches!(
        events[0].payload,
        turnwise::run::tensorboard::EventPayload::FileVersion(_)
    ));
    let mut out = Vec::new();
    for e in &events[1..] {
        let turnwise::run::tensorboard::EventPayload::Scalars(values) = &e.payload else {
            panic!("{e:?}")
        };
        for (tag, v) in values {
            out.push((e.step, tag.clone(), *v, e.wall_time));
        }
    }
    out
}

/// The step records of `episodes` with their prompt groups, scores, per-turn rewards and, when
/// given, information gains (one list per episode): the estimators' input, built from a
/// test's own columns.
#[allow(dead_code)]
pub fn scored(
    episodes: &[turnwise::rollout::Episode],
    groups: &[usize],
    scores: &[f64],
    turn_rewards: &[Vec<f64>],
    info_gain: Option<&[Vec<f64>]>,
) -> Vec<turnwise::trainer::sampling::ScoredEpisode> {
    assert_eq!(episodes.len(), groups.len(), "one group per episode");
    assert_eq!(episodes.len(), scores.len(), "one score per episode");
    assert_eq!(
        episodes.len(),
        turn_rewards.len(),
        "one turn-reward list per episode"
    );
    episodes
        .iter()
        .enumerate()
        .map(|(i, ep)| {
            let mut s = turnwise::trainer::sampling::ScoredEpisode::new(
                ep.clone(),
                groups[i],
                scores[i],
                turn_rewards[i].clone(),
            );
            s.info_gain = info_gain.map(|g| g[i].clone());
            s
        })
        .collect()
}

/// Rollouts of `t`'s policy on the first `n` training questions (temperature 1, turns of up to
/// 12 tokens, 120 in all), as training rows with the log-probs the rollout recorded (forced
/// tokens trained on); every per-token field but those is zero.
#[allow(dead_code)]
pub fn sampled_rows(t: &turnwise::trainer::Trainer, n: usize) -> Vec<turnwise::update::Row> {
    use turnwise::rollout::{EpisodeSpec, run_chains};
    use turnwise::task::{TaskSet, prompt_text};

    let qs = t.task.questions(turnwise_env::world::Split::Train);
    let specs: Vec<EpisodeSpec> = qs
        .iter()
        .take(n)
        .enumerate()
        .map(|(i, q)| EpisodeSpec {
            id: format!("e{i}"),
            prompt_uid: q.id.clone(),
            prompt_ids: t.tokenizer.encode(&prompt_text(&q.text)).unwrap(),
            task: TaskSet::env_task(q),
            seed: i as u64,
        })
        .collect();
    let policy = t.rollout_policy();
    let env = || Ok(Box::new(t.task.env()?) as Box<dyn turnwise_env::env::Environment>);
    let decoding = turnwise::rollout::Decoding {
        temperature: 1.0,
        top_p: 1.0,
        top_k: 0,
        max_turn_tokens: 12,
        max_response_tokens: 120,
    };
    run_chains(&policy, specs, &env, &decoding)
        .unwrap()
        .iter()
        .map(|e| turnwise::update::Row::from_trajectory(&e.trajectory, true))
        .collect()
}

/// ChatML with Qwen2.5's tools block, tool calls and tool responses, shortened to fit the
/// fixture's context.
#[allow(dead_code)]
pub const TOOLS_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// The committed tiny GGUF fixture (Llama architecture, 301-token byte-level BPE vocabulary,
/// ChatML template, 256 positions).
#[allow(dead_code)]
pub fn tiny_gguf() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../turnwise-model/src/checkpoint/fixtures/gguf/tiny-llama.gguf")
}

/// A blocking HTTP client for the servers the tests start (120 s per request).
#[allow(dead_code)]
pub fn http_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(120))
        .build()
        .unwrap()
}

/// Sends `r` and returns the status and the JSON body.
#[allow(dead_code)]
pub fn send_json(r: reqwest::blocking::RequestBuilder) -> (u16, serde_json::Value) {
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap())
}

/// A JSON array of token ids.
#[allow(dead_code)]
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

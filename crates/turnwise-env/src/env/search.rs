//! [`SearchEnv`]: the search-agent environment (spec §1.3) over any [`Retriever`].
//!
//! Each step parses the policy's turn with the chosen tag grammar
//! ([`turnwise_core::grammar::parse_turn`]):
//!
//! - a search runs the query (top-k, default 3) and returns the passages as
//!   `Doc 1(Title: t) text` lines ([`crate::search::format`]) wrapped per format:
//!   `\n\n<information>…</information>\n\n` (Search-R1, T2PO) or ` <result>\n…\n</result>`
//!   (boxed A2TGPO/AT2PO);
//! - an answer ends the episode with reward EM(answer, golden answers) (Search-R1
//!   normalization, spec §2.1);
//! - anything else is an invalid action: Search-R1's invalid-action feedback, state unchanged.
//!
//! After `max_turns` steps without an answer the episode ends (truncated, reward 0).

use std::sync::Arc;

use turnwise_core::grammar::{Action, Format, parse_turn, search_r1, verifiers};
use turnwise_core::reward::em;

use super::{EnvError, Environment, Observation, StepInfo, StepResult, Task};
use crate::search::Retriever;
use crate::search::format::{
    ObservationStyle, TextBudget, format_observation, passages_text, routine_observation,
};

const NAME: &str = "SearchEnv";

/// Settings of a [`SearchEnv`].
#[derive(Debug, Clone, PartialEq)]
pub struct SearchEnvConfig {
    /// Tag grammar of the policy's turns. Default Search-R1.
    pub format: Format,
    /// Passages per search. Default 3 (spec §6.5).
    pub topk: usize,
    /// Steps before the episode is cut. Default 4 (spec §6.5).
    pub max_turns: usize,
    /// Cut the passages text to this many words (`None`: no cut). Default `None`; the rollout
    /// engine usually cuts by tokens instead (spec §6.5: 500 tokens).
    pub max_observation_words: Option<usize>,
    /// Most searches per episode (`None`: unlimited). A search beyond it is not run; the agent
    /// gets [`TOOL_LIMIT_NOTICE`] instead (AT2PO: 6, spec §1.2). Default `None`.
    pub max_tool_calls: Option<usize>,
}

/// What the agent reads when it searches past the tool-call limit (AT2PO's injected text,
/// spec §1.2).
pub const TOOL_LIMIT_NOTICE: &str = " I have reached the tool call limit and cannot make further tool calls. Let me provide the final answer based on the information I have gathered so far. \n\n";

impl Default for SearchEnvConfig {
    fn default() -> Self {
        Self {
            format: Format::SearchR1,
            topk: 3,
            max_turns: 4,
            max_observation_words: None,
            max_tool_calls: None,
        }
    }
}

/// The search-agent environment (see the module docs).
pub struct SearchEnv {
    retriever: Arc<dyn Retriever>,
    config: SearchEnvConfig,
    episode: Option<SearchEpisode>,
}

struct SearchEpisode {
    answers: Vec<String>,
    steps: usize,
    searches: usize,
    done: bool,
    /// Routine turns of the task (`params.routine_turns`), and how many are done.
    routine: usize,
    routine_done: usize,
}

/// The task parameter giving an episode's routine turns (`task.world.decision_density`): the
/// first that many steps are acknowledged with [`routine_observation`] whatever the action,
/// change nothing and do not count towards `max_turns`.
pub const ROUTINE_TURNS_PARAM: &str = "routine_turns";

impl std::fmt::Debug for SearchEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SearchEnv")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl SearchEnv {
    /// A search environment answering searches with `retriever`.
    pub fn new(retriever: Arc<dyn Retriever>, config: SearchEnvConfig) -> Result<Self, EnvError> {
        if config.topk == 0 || config.max_turns == 0 {
            return Err(EnvError::BadTask {
                env: NAME.into(),
                field: if config.topk == 0 {
                    "topk"
                } else {
                    "max_turns"
                }
                .into(),
                message: "must be at least 1".into(),
            });
        }
        Ok(Self {
            retriever,
            config,
            episode: None,
        })
    }
}

impl Environment for SearchEnv {
    /// Starts an episode; `task.prompt` is the question and `task.answers` the golden answers.
    /// The first observation is the question.
    fn reset(&mut self, task: &Task) -> Result<Observation, EnvError> {
        let question = task.prompt.clone().ok_or_else(|| EnvError::BadTask {
            env: NAME.into(),
            field: "prompt".into(),
            message: "a search task needs a question".into(),
        })?;
        let routine = match task.params.get(ROUTINE_TURNS_PARAM) {
            None => 0,
            Some(v) => v.as_u64().ok_or_else(|| EnvError::BadTask {
                env: NAME.into(),
                field: format!("params.{ROUTINE_TURNS_PARAM}"),
                message: format!("must be a non-negative integer, got {v}"),
            })? as usize,
        };
        self.episode = Some(SearchEpisode {
            answers: task.answers.clone(),
            steps: 0,
            searches: 0,
            done: false,
            routine,
            routine_done: 0,
        });
        Ok(Observation::new(question))
    }

    fn step(&mut self, action_text: &str) -> Result<StepResult, EnvError> {
        let format = self.config.format;
        let (topk, max_turns) = (self.config.topk, self.config.max_turns);
        let budget = match self.config.max_observation_words {
            Some(n) => TextBudget::Words(n),
            None => TextBudget::Unlimited,
        };
        let style = match format {
            Format::Boxed | Format::Verifiers => ObservationStyle::Result,
            Format::SearchR1 | Format::T2po => ObservationStyle::SearchR1,
        };
        let e = self
            .episode
            .as_mut()
            .ok_or_else(|| EnvError::NotReset { env: NAME.into() })?;
        if e.done {
            return Err(EnvError::EpisodeOver { env: NAME.into() });
        }
        let parsed = parse_turn(format, action_text);
        if e.routine_done < e.routine {
            // A routine turn: whatever the action, the same acknowledgement.
            e.routine_done += 1;
            let info = StepInfo {
                format_ok: parsed.verdict.is_valid(),
                searches_so_far: e.searches,
                action: Some("routine".into()),
                ..StepInfo::default()
            };
            return Ok(StepResult {
                observation: Observation::new(routine_observation(
                    style,
                    e.routine_done,
                    e.routine,
                )),
                reward: 0.0,
                done: false,
                info,
            });
        }
        e.steps += 1;
        let mut info = StepInfo {
            format_ok: parsed.verdict.is_valid(),
            searches_so_far: e.searches,
            ..StepInfo::default()
        };
        let mut reward = 0.0;
        let observation = match &parsed.action {
            Action::Search { query }
                if self.config.max_tool_calls.is_some_and(|m| e.searches >= m) =>
            {
                info.tool_called = None;
                info.query = Some(query.clone());
                info.action = Some("search".into());
                info.feedback = Some(format!(
                    "tool-call limit of {} reached: the search was not run",
                    e.searches
                ));
                info.extra.insert("tool_limit".into(), true.into());
                TOOL_LIMIT_NOTICE.to_owned()
            }
            Action::Search { query } => {
                e.searches += 1;
                info.searches_so_far = e.searches;
                info.tool_called = Some("search".into());
                info.query = Some(query.clone());
                info.action = Some("search".into());
                let hits = self
                    .retriever
                    .retrieve(std::slice::from_ref(query), topk)
                    .map_err(|err| EnvError::Tool {
                        env: NAME.into(),
                        tool: "search".into(),
                        message: err.to_string(),
                    })?
                    .into_iter()
                    .next()
                    .unwrap_or_default();
                info.retrieved = Some(passages_text(&hits, &budget));
                format_observation(&hits, style, &budget)
            }
            Action::Answer { .. } => {
                // The EM string: the answer block (Search-R1, T2PO) or its last \boxed{}
                // (boxed format; none extractable scores 0).
                let answer = parsed.final_answer.clone().unwrap_or_default();
                reward = em(&answer, &e.answers);
                info.won = reward >= 1.0;
                info.action = Some("answer".into());
                info.extra.insert("answer".into(), answer.into());
                e.done = true;
                String::new()
            }
            Action::Invalid { reason } => {
                info.valid_action = false;
                info.feedback = Some(reason.clone());
                match format {
                    // A failed tool call is answered inside <result> with an `Error:` text.
                    Format::Verifiers => verifiers::invalid_observation(action_text, reason),
                    _ => search_r1::INVALID_ACTION_FEEDBACK.to_owned(),
                }
            }
        };
        if !e.done && e.steps >= max_turns {
            e.done = true;
            info.truncated = true;
        }
        let done = e.done;
        Ok(StepResult {
            observation: Observation::new(observation),
            reward,
            done,
            info,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::Document;
    use crate::server::TermOverlapRetriever;

    fn env(format: Format) -> SearchEnv {
        let docs = vec![
            Document {
                id: "0".into(),
                contents: "\"Paris\"\nParis is the capital of France.".into(),
            },
            Document {
                id: "1".into(),
                contents: "\"Berlin\"\nBerlin is the capital of Germany.".into(),
            },
        ];
        SearchEnv::new(
            Arc::new(TermOverlapRetriever::new(docs)),
            SearchEnvConfig {
                format,
                topk: 1,
                max_turns: 3,
                max_observation_words: None,
                max_tool_calls: None,
            },
        )
        .unwrap()
    }

    fn task() -> Task {
        Task {
            id: "q1".into(),
            prompt: Some("What is the capital of France?".into()),
            answers: vec!["Paris".into()],
            ..Task::default()
        }
    }

    /// Routine turns (`params.routine_turns`): whatever the action (a search, an answer,
    /// nonsense), the same acknowledgement, nothing ends and nothing counts towards
    /// `max_turns`; then the episode runs as without them.
    #[test]
    fn routine_turns_acknowledge_any_action_alike() {
        let mut env = env(Format::SearchR1);
        let mut t = task();
        t.params.insert(ROUTINE_TURNS_PARAM.into(), 3.into());
        env.reset(&t).unwrap();
        let mut seen = Vec::new();
        for (k, action) in [
            "<search>Paris</search>",
            "<answer>Berlin</answer>",
            "no tags at all",
        ]
        .iter()
        .enumerate()
        {
            let s = env.step(action).unwrap();
            assert!(!s.done && s.reward == 0.0, "routine turn {k}");
            assert_eq!(s.info.action.as_deref(), Some("routine"));
            assert_eq!(
                s.observation.text,
                routine_observation(ObservationStyle::SearchR1, k + 1, 3)
            );
            seen.push(s.observation.text);
        }
        // Then three ordinary turns (max_turns = 3): two searches and a right answer.
        for _ in 0..2 {
            let s = env.step("<search>France capital</search>").unwrap();
            assert!(!s.done && s.info.query.is_some());
        }
        let s = env.step("<answer>Paris</answer>").unwrap();
        assert!(s.done && s.reward == 1.0);
        // Without the parameter, the first step is an ordinary one.
        env.reset(&task()).unwrap();
        let s = env.step("<answer>Berlin</answer>").unwrap();
        assert!(s.done && s.reward == 0.0);
        t.params.insert(ROUTINE_TURNS_PARAM.into(), "two".into());
        assert!(env.reset(&t).is_err());
    }

    #[test]
    fn search_then_answer_search_r1() {
        let mut env = env(Format::SearchR1);
        assert_eq!(
            env.reset(&task()).unwrap().text,
            "What is the capital of France?"
        );
        let r = env
            .step("<think>look it up</think><search>capital of France</search>")
            .unwrap();
        assert_eq!(
            r.observation.text,
            "\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France.</information>\n\n"
        );
        assert_eq!(r.info.tool_called.as_deref(), Some("search"));
        assert_eq!(r.info.query.as_deref(), Some("capital of France"));
        assert_eq!(r.info.searches_so_far, 1);
        assert!(r.info.retrieved.unwrap().contains("Paris is the capital"));
        assert!(!r.done && r.info.valid_action && r.info.format_ok);

        let r = env.step("no tags at all").unwrap();
        assert!(!r.info.valid_action && !r.done);
        assert_eq!(r.observation.text, search_r1::INVALID_ACTION_FEEDBACK);

        let r = env
            .step("<think>done</think><answer>paris</answer>")
            .unwrap();
        assert!(r.done && r.info.won);
        assert_eq!(r.reward, 1.0);
        assert_eq!(r.info.searches_so_far, 1);
        assert!(matches!(env.step("x"), Err(EnvError::EpisodeOver { .. })));
    }

    #[test]
    fn wrong_answers_score_zero_and_turns_are_limited() {
        let mut env = env(Format::SearchR1);
        env.reset(&task()).unwrap();
        let r = env
            .step("<think>guess</think><answer>Lyon</answer>")
            .unwrap();
        assert!(r.done && !r.info.won && r.reward == 0.0);

        env.reset(&task()).unwrap();
        for i in 0..3 {
            let r = env
                .step("<think>again</think><search>capital of Germany</search>")
                .unwrap();
            assert_eq!(r.done, i == 2);
            assert_eq!(r.info.truncated, i == 2);
            assert_eq!(r.info.searches_so_far, i + 1);
        }
    }

    #[test]
    fn boxed_format_wraps_results_and_scores_the_boxed_answer() {
        let mut env = env(Format::Boxed);
        env.reset(&task()).unwrap();
        let r = env
            .step("<think>look</think><search>capital of France</search>")
            .unwrap();
        assert!(
            r.observation.text.starts_with(" <result>\nDoc 1(Title:"),
            "{:?}",
            r.observation.text
        );
        let r = env
            .step("<think>ok</think><answer>It is \\boxed{Paris}</answer>")
            .unwrap();
        assert_eq!(r.reward, 1.0);
    }

    #[test]
    fn searches_past_the_tool_call_limit_get_the_notice() {
        let mut env = env(Format::SearchR1);
        env.config.max_tool_calls = Some(1);
        env.reset(&task()).unwrap();
        let first = env.step("<search>capital of France</search>").unwrap();
        assert_eq!(first.info.searches_so_far, 1);
        assert!(first.observation.text.contains("<information>"));
        let second = env.step("<search>Berlin</search>").unwrap();
        assert_eq!(second.observation.text, TOOL_LIMIT_NOTICE);
        assert_eq!(second.info.searches_so_far, 1, "the search was not run");
        assert!(second.info.feedback.unwrap().contains("tool-call limit"));
        assert!(!second.done);
    }

    #[test]
    fn a_task_without_question_is_rejected() {
        let mut env = env(Format::SearchR1);
        let err = env.reset(&Task::with_seed("x", 0)).unwrap_err().to_string();
        assert!(err.contains("prompt"), "{err}");
    }
}

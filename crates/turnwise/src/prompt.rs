//! Prompts: the text a question becomes before the agent's first turn (`[task.prompt]`).
//!
//! The user message comes from one of four sources ([`PromptTemplate`]):
//! - `builtin`: `<|im_start|> {question} <|im_end|>`, the format every built-in-world figure was
//!   measured with (its chat markers are single tokens of a fresh tokenizer);
//! - `search_r1`: Search-R1's instruction prompt (`scripts/data_process/nq_search.py`,
//!   `make_prefix`, template `base`), which tells the model about `<think>`, `<search>`,
//!   `<information>` and `<answer>`; the question is stripped and gets a `?` when it has none, as
//!   there;
//! - `verifiers`: the instruction of MT-GRPO's two-turn task (turn-level-rewards.md App. E.5, in
//!   our words): `<reasoning>`, one JSON `<tool>` call answered in `<result>`, `<answer>`;
//! - `data`: the `prompt` field of a Search-R1 data line (a list of chat messages
//!   `[{"role": "user", "content": ...}]`);
//! - `custom`: a user template (`task.prompt.text`, minijinja, with `{{ question }}`).
//!
//! When the model starts from a Hugging Face folder whose `tokenizer_config.json` has a
//! `chat_template` (or which has `chat_template.jinja`), the messages are rendered through it
//! with `add_generation_prompt = true`, as verl's dataset does; without one the user message is
//! the prompt (for `data`, the messages' contents joined by newlines).
//!
//! `template = "auto"` (the default) picks, per question: `custom` when `text` is set, else
//! `data` when the question has a `prompt` field, else, when a chat template is in use (a
//! pre-trained chat model needs the tool instructions), the agent format's instruction
//! (`verifiers` for `task.format = "verifiers"`, else `search_r1`), else `builtin`. A generated world
//! with a fresh model therefore gets exactly the built-in prompts.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use turnwise_model::tokenizer::{ChatMessage, ChatTemplate};

/// Where the user message of a prompt comes from (`task.prompt.template`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptTemplate {
    /// Per question: `custom` when `text` is set, `data` when the question has a `prompt`
    /// field, `search_r1` when a chat template is in use, else `builtin`.
    #[default]
    Auto,
    /// `<|im_start|> {question} <|im_end|>` ([`builtin_prompt`]).
    Builtin,
    /// Search-R1's instruction prompt ([`search_r1_prompt`]).
    SearchR1,
    /// The two-turn task's instruction in the verifiers format ([`verifiers_prompt`]).
    Verifiers,
    /// The `prompt` field of the data line (every question must have one).
    Data,
    /// The minijinja template of `task.prompt.text`.
    Custom,
}

impl PromptTemplate {
    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Builtin => "builtin",
            Self::SearchR1 => "search_r1",
            Self::Verifiers => "verifiers",
            Self::Data => "data",
            Self::Custom => "custom",
        }
    }
}

/// Whether prompts go through the model folder's chat template (`task.prompt.chat_template`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatTemplateUse {
    /// When `model.init_from` has one.
    #[default]
    Auto,
    /// Never.
    #[serde(rename = "none")]
    Off,
    /// Always: a model folder without a chat template is an error.
    Checkpoint,
}

/// `[task.prompt]`: how a question becomes the prompt.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PromptConfig {
    /// Source of the user message.
    pub template: PromptTemplate,
    /// A minijinja template of the user message, with `{{ question }}` (`template = "custom"`,
    /// or `"auto"`, which then means custom). As in Jinja, one trailing newline is dropped.
    pub text: Option<String>,
    /// Whether the messages are rendered through the model folder's chat template.
    pub chat_template: ChatTemplateUse,
}

/// A marker no question contains, to check that a custom template uses the question.
const QUESTION_PROBE: &str = "\u{1}question\u{1}";

impl PromptConfig {
    /// Checks the settings on their own: `(field, message)` on error.
    pub fn validate(&self) -> std::result::Result<(), (&'static str, String)> {
        match (&self.text, self.template) {
            (None, PromptTemplate::Custom) => {
                return Err((
                    "task.prompt.text",
                    "template = \"custom\" needs text = \"... {{ question }} ...\"".into(),
                ));
            }
            (
                Some(_),
                t @ (PromptTemplate::Builtin
                | PromptTemplate::SearchR1
                | PromptTemplate::Verifiers
                | PromptTemplate::Data),
            ) => {
                return Err((
                    "task.prompt.text",
                    format!(
                        "is used by template = \"custom\" only, but template = \"{}\"",
                        t.name()
                    ),
                ));
            }
            (Some(text), _) => {
                let t = ChatTemplate::new(text.clone(), None, None)
                    .map_err(|e| ("task.prompt.text", e.to_string()))?;
                let out = render_custom(&t, QUESTION_PROBE)
                    .map_err(|e| ("task.prompt.text", format!("{e:#}")))?;
                if !out.contains(QUESTION_PROBE) {
                    return Err((
                        "task.prompt.text",
                        "the template never writes the question: use {{ question }}".into(),
                    ));
                }
            }
            (None, _) => {}
        }
        Ok(())
    }
}

/// The built-in prompt of a question (the chat markers are single tokens of a fresh tokenizer).
pub fn builtin_prompt(question: &str) -> String {
    format!("<|im_start|> {question} <|im_end|>")
}

/// Search-R1's instruction prompt (`make_prefix`, template `base`, of Search-R1's
/// `scripts/data_process/nq_search.py`), with the question normalised as there: stripped, and
/// ending in `?`.
pub fn search_r1_prompt(question: &str) -> String {
    let mut q = question.trim().to_string();
    if !q.ends_with('?') {
        q.push('?');
    }
    format!(
        "Answer the given question. You must conduct reasoning inside <think> and </think> \
         first every time you get new information. After reasoning, if you find you lack some \
         knowledge, you can call a search engine by <search> query </search> and it will return \
         the top searched results between <information> and </information>. You can search as \
         many times as your want. If you find no further external knowledge needed, you can \
         directly provide the answer inside <answer> and </answer>, without detailed \
         illustrations. For example, <answer> Beijing </answer>. Question: {q}\n"
    )
}

/// The instruction of the two-turn task in the verifiers format (the structure of
/// turn-level-rewards.md App. E.5's system prompt, in our words, for our `search` tool).
pub fn verifiers_prompt(question: &str) -> String {
    format!(
        "Answer the given question. You may call one tool, once. First think inside \
         <reasoning> and </reasoning>. Then call the tool with a JSON command inside <tool> and \
         </tool> that gives \"name\", the tool, and \"args\", its arguments. The only tool is \
         search: it takes a \"query\" and returns the top matching passages inside <result> \
         and </result>, for example <tool>{{\"name\": \"search\", \"args\": {{\"query\": \
         \"capital of France\"}}}}</tool>. After the result, think again inside <reasoning> and \
         </reasoning>, then give the short final answer inside <answer> and </answer>, for \
         example <answer> Paris </answer>. Do not call the tool a second time; if its result \
         does not help, answer from what you know. Question: {}\n",
        question.trim()
    )
}

fn render_custom(t: &ChatTemplate, question: &str) -> Result<String> {
    Ok(t.render_with(&[], false, &serde_json::json!({ "question": question }))?)
}

/// The resolved prompt settings of a task: renders questions into prompt text.
pub struct Prompter {
    template: PromptTemplate,
    /// The instruction `auto` uses with a chat template (the agent format's).
    instruction: PromptTemplate,
    custom: Option<ChatTemplate>,
    chat: Option<ChatTemplate>,
    /// Solved examples shown before the question (few-shot prompting; empty: zero-shot).
    examples: Vec<String>,
}

impl std::fmt::Debug for Prompter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prompter")
            .field("template", &self.template)
            .field("custom", &self.custom.is_some())
            .field("chat_template", &self.chat.is_some())
            .finish()
    }
}

impl Prompter {
    /// Resolves `config` against `chat`, the model folder's chat template (`None`: the model
    /// has none, or is fresh).
    pub fn new(config: &PromptConfig, chat: Option<ChatTemplate>) -> Result<Self> {
        let chat = match (config.chat_template, chat) {
            (ChatTemplateUse::Off, _) => None,
            (ChatTemplateUse::Auto, chat) => chat,
            (ChatTemplateUse::Checkpoint, Some(chat)) => Some(chat),
            (ChatTemplateUse::Checkpoint, None) => bail!(
                "task.prompt.chat_template = \"checkpoint\" needs model.init_from to be a \
                 Hugging Face folder whose tokenizer_config.json has a chat_template (or that \
                 has chat_template.jinja)"
            ),
        };
        let custom = match &config.text {
            Some(text) => {
                Some(ChatTemplate::new(text.clone(), None, None).context("task.prompt.text")?)
            }
            None => None,
        };
        Ok(Self {
            template: config.template,
            instruction: PromptTemplate::SearchR1,
            custom,
            chat,
            examples: Vec::new(),
        })
    }

    /// Shows `examples` (solved questions, each a question and its whole transcript, see
    /// [`few_shot_example`]) in every prompt from now on, before the question; an empty list
    /// goes back to zero-shot prompts.
    pub fn set_examples(&mut self, examples: Vec<String>) {
        self.examples = examples;
    }

    /// The solved examples every prompt shows (empty: zero-shot).
    pub fn examples(&self) -> &[String] {
        &self.examples
    }

    /// The instruction `template = "auto"` gives a chat model: the verifiers instruction for
    /// the verifiers format (`verifiers = true`), else Search-R1's.
    pub fn with_verifiers_instruction(mut self, verifiers: bool) -> Self {
        self.instruction = if verifiers {
            PromptTemplate::Verifiers
        } else {
            PromptTemplate::SearchR1
        };
        self
    }

    /// Whether messages go through a chat template.
    pub fn uses_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// The source the prompt of a question with (`has_data`) or without a `prompt` field
    /// comes from.
    pub fn source(&self, has_data: bool) -> PromptTemplate {
        match self.template {
            PromptTemplate::Auto if self.custom.is_some() => PromptTemplate::Custom,
            PromptTemplate::Auto if has_data => PromptTemplate::Data,
            PromptTemplate::Auto if self.chat.is_some() => self.instruction,
            PromptTemplate::Auto => PromptTemplate::Builtin,
            t => t,
        }
    }

    /// A description of how the prompt of such a question is made, for logs.
    pub fn describe(&self, has_data: bool) -> String {
        let via = match self.chat.is_some() {
            true => "the checkpoint's chat template",
            false => "no chat template",
        };
        format!("template {}, {via}", self.source(has_data).name())
    }

    /// The prompt of `question`, whose data line's `prompt` field is `data` (if any).
    pub fn render(&self, question: &str, data: Option<&[ChatMessage]>) -> Result<String> {
        let user = match self.source(data.is_some()) {
            PromptTemplate::Data => {
                let messages =
                    data.context("template = \"data\" but the question has no prompt field")?;
                return match &self.chat {
                    Some(chat) => Ok(chat
                        .render(messages, true)
                        .context("rendering the chat template")?),
                    None => Ok(messages
                        .iter()
                        .map(|m| m.content.as_str())
                        .collect::<Vec<_>>()
                        .join("\n")),
                };
            }
            PromptTemplate::Custom => render_custom(
                self.custom.as_ref().context("no task.prompt.text")?,
                question,
            )
            .context("rendering task.prompt.text")?,
            PromptTemplate::SearchR1 => search_r1_prompt(question),
            PromptTemplate::Verifiers => verifiers_prompt(question),
            PromptTemplate::Builtin | PromptTemplate::Auto => builtin_prompt(question),
        };
        let user = with_examples(&user, &self.examples);
        match &self.chat {
            Some(chat) => Ok(chat
                .render(&[ChatMessage::new("user", user)], true)
                .context("rendering the chat template")?),
            None => Ok(user),
        }
    }
}

/// One solved example of a few-shot prompt: the question and the agent's whole response
/// (its turns and the observations between them), as the model would write and read them.
pub fn few_shot_example(question: &str, response: &str) -> String {
    format!("Question: {}\n{}", question.trim(), response.trim())
}

/// `user` with the solved `examples` placed before its question: before the last
/// `Question: ` of an instruction prompt (Search-R1's, the verifiers'), else at the start.
fn with_examples(user: &str, examples: &[String]) -> String {
    if examples.is_empty() {
        return user.to_string();
    }
    let block = format!(
        "Here are solved examples.\n\n{}\n\nNow the new question. ",
        examples.join("\n\n")
    );
    match user.rfind("Question: ") {
        Some(i) => format!("{}{block}{}", &user[..i], &user[i..]),
        None => format!("{block}{user}"),
    }
}

/// The chat messages of a data line's `prompt` field: a list of `{"role", "content"}` objects,
/// or a string (one user message). `None` when the line has no such field.
pub fn data_prompt(metadata: &serde_json::Value) -> Result<Option<Vec<ChatMessage>>> {
    match metadata.get("prompt") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(vec![ChatMessage::new("user", s.clone())])),
        Some(v @ serde_json::Value::Array(_)) => {
            let messages: Vec<ChatMessage> = serde_json::from_value(v.clone())
                .context("the `prompt` field must be a list of {\"role\", \"content\"} messages")?;
            if messages.is_empty() {
                bail!("the `prompt` field is an empty list");
            }
            Ok(Some(messages))
        }
        Some(other) => {
            bail!("the `prompt` field must be a list of chat messages or a string, found {other}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    fn chatml() -> ChatTemplate {
        ChatTemplate::new(CHATML, None, Some("<|im_end|>".into())).unwrap()
    }

    #[test]
    fn the_default_is_the_builtin_prompt_byte_for_byte() {
        let p = Prompter::new(&PromptConfig::default(), None).unwrap();
        let q = "Who founded Mirabel Corp?";
        assert_eq!(
            p.render(q, None).unwrap(),
            "<|im_start|> Who founded Mirabel Corp? <|im_end|>"
        );
        assert_eq!(p.source(false), PromptTemplate::Builtin);
    }

    #[test]
    fn search_r1_prompt_is_the_reference_text() {
        // What Search-R1's make_prefix(dp, "base") returns for "who wrote hamlet?".
        let reference = "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query </search> and it will return the top searched results between <information> and </information>. You can search as many times as your want. If you find no further external knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. Question: who wrote hamlet?\n";
        assert_eq!(search_r1_prompt("who wrote hamlet?"), reference);
        // The question is normalised as there: stripped, `?` appended when missing.
        assert_eq!(search_r1_prompt("  who wrote hamlet "), reference);
    }

    #[test]
    fn auto_picks_data_then_search_r1_under_a_chat_template() {
        let p = Prompter::new(&PromptConfig::default(), Some(chatml())).unwrap();
        let data = [ChatMessage::new("user", "from the file")];
        assert_eq!(
            p.render("q", Some(&data)).unwrap(),
            "<|im_start|>user\nfrom the file<|im_end|>\n<|im_start|>assistant\n"
        );
        let r = p.render("who wrote hamlet", None).unwrap();
        assert!(
            r.starts_with("<|im_start|>user\nAnswer the given question."),
            "{r}"
        );
        assert!(r.ends_with("Question: who wrote hamlet?\n<|im_end|>\n<|im_start|>assistant\n"));
        // Without a chat template the data prompt is the message text.
        let p = Prompter::new(&PromptConfig::default(), None).unwrap();
        assert_eq!(p.render("q", Some(&data)).unwrap(), "from the file");
        // Turning the chat template off.
        let cfg = PromptConfig {
            chat_template: ChatTemplateUse::Off,
            ..PromptConfig::default()
        };
        let p = Prompter::new(&cfg, Some(chatml())).unwrap();
        assert_eq!(p.render("q", None).unwrap(), builtin_prompt("q"));
        // Requiring one.
        let cfg = PromptConfig {
            chat_template: ChatTemplateUse::Checkpoint,
            ..PromptConfig::default()
        };
        let e = Prompter::new(&cfg, None).unwrap_err().to_string();
        assert!(e.contains("chat_template"), "{e}");
    }

    #[test]
    fn a_chat_model_in_the_verifiers_format_gets_the_two_turn_instruction() {
        let p = Prompter::new(&PromptConfig::default(), Some(chatml()))
            .unwrap()
            .with_verifiers_instruction(true);
        assert_eq!(p.source(false), PromptTemplate::Verifiers);
        let r = p.render(" who wrote hamlet? ", None).unwrap();
        assert!(
            r.starts_with("<|im_start|>user\nAnswer the given question."),
            "{r}"
        );
        // The example call in the instruction is one the environment runs.
        let example = turnwise_core::grammar::verifiers::tool_call("capital of France");
        assert!(r.contains(&example), "{r}");
        for tag in ["<reasoning>", "<tool>", "<result>", "<answer>"] {
            assert!(r.contains(tag), "{tag}");
        }
        assert!(r.ends_with("Question: who wrote hamlet?\n<|im_end|>\n<|im_start|>assistant\n"));
        // A fresh model keeps the built-in prompt.
        let p = Prompter::new(&PromptConfig::default(), None)
            .unwrap()
            .with_verifiers_instruction(true);
        assert_eq!(p.render("q", None).unwrap(), builtin_prompt("q"));
    }

    #[test]
    fn custom_templates_render_and_are_checked() {
        let cfg = PromptConfig {
            text: Some("Q: {{ question }}\nA:".into()),
            ..PromptConfig::default()
        };
        assert!(cfg.validate().is_ok());
        let p = Prompter::new(&cfg, None).unwrap();
        assert_eq!(p.render("who?", None).unwrap(), "Q: who?\nA:");
        // The custom text wins over a data prompt under auto.
        assert_eq!(
            p.render("who?", Some(&[ChatMessage::new("user", "x")]))
                .unwrap(),
            "Q: who?\nA:"
        );
        let p = Prompter::new(&cfg, Some(chatml())).unwrap();
        assert_eq!(
            p.render("who?", None).unwrap(),
            "<|im_start|>user\nQ: who?\nA:<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_q = PromptConfig {
            text: Some("hello".into()),
            ..PromptConfig::default()
        };
        assert!(no_q.validate().unwrap_err().1.contains("{{ question }}"));
        let broken = PromptConfig {
            text: Some("{{ question ".into()),
            ..PromptConfig::default()
        };
        assert_eq!(broken.validate().unwrap_err().0, "task.prompt.text");
        let missing = PromptConfig {
            template: PromptTemplate::Custom,
            ..PromptConfig::default()
        };
        assert!(missing.validate().is_err());
        let stray = PromptConfig {
            template: PromptTemplate::Builtin,
            text: Some("{{ question }}".into()),
            ..PromptConfig::default()
        };
        assert!(stray.validate().is_err());
    }

    #[test]
    fn data_prompts_parse_from_metadata() {
        let m =
            serde_json::json!({"prompt": [{"role": "user", "content": "hi"}], "data_source": "nq"});
        assert_eq!(
            data_prompt(&m).unwrap(),
            Some(vec![ChatMessage::new("user", "hi")])
        );
        assert_eq!(
            data_prompt(&serde_json::json!({"prompt": "hi"})).unwrap(),
            Some(vec![ChatMessage::new("user", "hi")])
        );
        assert_eq!(data_prompt(&serde_json::Value::Null).unwrap(), None);
        assert!(data_prompt(&serde_json::json!({"prompt": 3})).is_err());
        assert!(data_prompt(&serde_json::json!({"prompt": []})).is_err());
        assert!(data_prompt(&serde_json::json!({"prompt": [{"role": "user"}]})).is_err());
    }
}

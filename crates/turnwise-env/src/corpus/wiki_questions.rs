//! Questions built from the Wikipedia summaries themselves, and the oracle that answers them.
//!
//! Each question is the first sentence of one article's summary with the article's title masked
//! (every occurrence of the title, and of each of its words of three or more letters, becomes
//! `___`), asking for the title:
//!
//! > Which Wikipedia article starts with "___ is a public research university in Haidian,
//! > Beijing, China."?  → `Tsinghua University`
//!
//! The title must occur in the sentence (so the mask hides something), have at most
//! [`WikiQuestionConfig::max_title_words`] words, and the masked sentence must keep between
//! [`WikiQuestionConfig::min_words`] and [`WikiQuestionConfig::max_words`] words. The accepted
//! answers are the title and, for a title with a disambiguation such as `Protein (nutrient)`, the
//! title without it.
//!
//! **Held out by article.** Every article gives at most one question, and a fixed hash of the
//! title and the seed puts each article in one split (80 % train, 10 % validation, 10 % test), so
//! no held-out question's article is ever a training question's. The corpus itself is the search
//! index of every split, as Search-R1's Wikipedia is.
//!
//! **The oracle** ([`WikiOracle`]) searches the clue's first [`WikiOracle::QUERY_WORDS`] words
//! (masks dropped) and answers with the title of the passage that is the article, when the
//! article is among the passages the observation shows; a question it cannot answer that way is
//! not answerable by search and [`WikiOracle::answerable`] drops it.

use crate::search::format::{TextBudget, format_observation};
use crate::search::{RetrievalError, Retriever};
use crate::world::Split;
use crate::world::oracle::{Action, AgentFormat, Transcript, Turn};
use crate::world::rng::fnv1a;

use super::split_contents;
use super::wiki::WikiArticle;

/// The placeholder that replaces the title in a clue.
pub const MASK: &str = "___";

/// How questions are drawn from the articles.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WikiQuestionConfig {
    /// Training questions (at most; fewer when the train share of articles has fewer).
    pub train: usize,
    /// Validation questions.
    pub validation: usize,
    /// Test questions.
    pub test: usize,
    /// Seed of the split assignment and of the order questions are drawn in.
    pub seed: u64,
    /// Most words of a title.
    pub max_title_words: usize,
    /// Fewest words of a masked sentence.
    pub min_words: usize,
    /// Most words of a masked sentence.
    pub max_words: usize,
}

impl Default for WikiQuestionConfig {
    fn default() -> Self {
        Self {
            train: 400,
            validation: 50,
            test: 100,
            seed: 0,
            max_title_words: 4,
            min_words: 8,
            max_words: 30,
        }
    }
}

/// One question made from an article.
#[derive(Debug, Clone, PartialEq)]
pub struct WikiQuestion {
    /// `wiki-{split}-{k}`.
    pub id: String,
    /// The question text.
    pub text: String,
    /// The masked first sentence.
    pub clue: String,
    /// The article's title (the answer).
    pub title: String,
    /// Accepted answers: the title, and the title without its disambiguation if it has one.
    pub golden_answers: Vec<String>,
}

/// The first sentence of `text`: up to the first `.`, `!` or `?` that is followed by a space (or
/// ends the text) and does not end a one-letter initial or a common abbreviation.
pub fn first_sentence(text: &str) -> &str {
    let t = text.trim();
    let bytes = t.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if !matches!(b, b'.' | b'!' | b'?') {
            continue;
        }
        let end = i + 1;
        if end < bytes.len() && bytes[end] != b' ' {
            continue;
        }
        let word = t[..i].rsplit(' ').next().unwrap_or("");
        let abbreviation = b == b'.'
            && (word.chars().count() == 1
                || [
                    "c", "ca", "St", "Dr", "Mr", "Mrs", "Jr", "Sr", "vs", "U.S", "e.g", "i.e",
                ]
                .contains(&word.trim_start_matches('(')));
        if !abbreviation {
            return &t[..end];
        }
    }
    t
}

/// The title without a trailing disambiguation in parentheses (`Protein (nutrient)` → `Protein`).
pub fn bare_title(title: &str) -> &str {
    match title.find(" (") {
        Some(i) if title.ends_with(')') => &title[..i],
        _ => title,
    }
}

fn is_word_char(c: char) -> bool {
    c.is_alphanumeric() || c == '\''
}

/// Replaces every case-insensitive, whole-word occurrence of `needle` in `text` with [`MASK`];
/// returns the new text and whether anything was replaced.
fn mask_phrase(text: &str, needle: &str) -> (String, bool) {
    if needle.is_empty() {
        return (text.to_string(), false);
    }
    let lower = text.to_lowercase();
    let pat = needle.to_lowercase();
    // Lower-casing may change byte lengths outside ASCII; match on the original only when it
    // keeps them (every title and sentence that does not is left unmasked).
    if lower.len() != text.len() {
        return (text.to_string(), false);
    }
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    let mut found = false;
    let mut from = 0;
    while let Some(pos) = lower[from..].find(&pat) {
        let start = from + pos;
        let end = start + pat.len();
        let before_ok = text[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !is_word_char(c));
        let after_ok = text[end..].chars().next().is_none_or(|c| !is_word_char(c));
        if before_ok && after_ok {
            out.push_str(&text[last..start]);
            out.push_str(MASK);
            last = end;
            found = true;
        }
        from = end;
    }
    out.push_str(&text[last..]);
    (out, found)
}

/// `sentence` with the title masked: the whole bare title first, then each of its words of three
/// or more letters. `None` when the title does not occur in the sentence.
pub fn mask_title(sentence: &str, title: &str) -> Option<String> {
    let bare = bare_title(title);
    let (mut masked, whole) = mask_phrase(sentence, bare);
    let mut any = whole;
    for word in bare.split_whitespace() {
        let w = word.trim_matches(|c: char| !is_word_char(c));
        if w.chars().count() >= 3 {
            let (m, found) = mask_phrase(&masked, w);
            masked = m;
            any |= found;
        }
    }
    // Masks that touch ("___ ___") are one.
    while masked.contains("___ ___") {
        masked = masked.replace("___ ___", MASK);
    }
    any.then_some(masked)
}

/// The question text of a clue.
pub fn question_text(clue: &str) -> String {
    format!("Which Wikipedia article starts with \"{clue}\"?")
}

fn split_of(title: &str, seed: u64) -> Split {
    let h = fnv1a(format!("{seed}:{title}").as_bytes());
    match h % 10 {
        0 => Split::Test,
        1 => Split::Validation,
        _ => Split::Train,
    }
}

/// The candidate question of one article, if it has one.
fn candidate(article: &WikiArticle, config: &WikiQuestionConfig) -> Option<(String, Vec<String>)> {
    let title = article.title.trim();
    let bare = bare_title(title);
    let title_words = bare.split_whitespace().count();
    if title_words == 0 || title_words > config.max_title_words {
        return None;
    }
    let sentence = first_sentence(&article.extract);
    let clue = mask_title(sentence, title)?;
    let words = clue.split_whitespace().count();
    if words < config.min_words || words > config.max_words {
        return None;
    }
    let mut golds = vec![title.to_string()];
    if bare != title {
        golds.push(bare.to_string());
    }
    Some((clue, golds))
}

/// The questions of every split (train, validation, test), each in a seeded order and cut to
/// its configured count. Articles are assigned to splits by a hash of their title and the seed,
/// so the splits never share an article.
pub fn build_questions(
    articles: &[WikiArticle],
    config: &WikiQuestionConfig,
) -> [Vec<WikiQuestion>; 3] {
    let mut pools: [Vec<(u64, WikiQuestion)>; 3] = Default::default();
    for article in articles {
        let Some((clue, golden_answers)) = candidate(article, config) else {
            continue;
        };
        let split = split_of(&article.title, config.seed);
        let order = fnv1a(format!("order:{}:{}", config.seed, article.title).as_bytes());
        pools[split_slot(split)].push((
            order,
            WikiQuestion {
                id: String::new(),
                text: question_text(&clue),
                clue,
                title: article.title.trim().to_string(),
                golden_answers,
            },
        ));
    }
    let limits = [config.train, config.validation, config.test];
    let mut out: [Vec<WikiQuestion>; 3] = Default::default();
    for (slot, pool) in pools.iter_mut().enumerate() {
        pool.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.title.cmp(&b.1.title)));
        out[slot] = pool
            .drain(..)
            .map(|(_, q)| q)
            .take(limits[slot])
            .enumerate()
            .map(|(k, mut q)| {
                q.id = format!("wiki-{}-{k}", Split::ALL[slot].name());
                q
            })
            .collect();
    }
    out
}

fn split_slot(split: Split) -> usize {
    match split {
        Split::Train => 0,
        Split::Validation => 1,
        Split::Test => 2,
    }
}

/// The oracle of the Wikipedia questions: one search for the clue, then the title of the
/// passage that is the article.
pub struct WikiOracle<'a> {
    retriever: &'a dyn Retriever,
    format: AgentFormat,
    top_k: usize,
    max_observation_words: Option<usize>,
}

impl<'a> WikiOracle<'a> {
    /// Words of the clue the oracle searches for.
    pub const QUERY_WORDS: usize = 12;

    /// The oracle over `retriever`, rendering in `format` with the environment's observation
    /// settings (`top_k` passages, at most `max_observation_words` words).
    pub fn new(
        retriever: &'a dyn Retriever,
        format: AgentFormat,
        top_k: usize,
        max_observation_words: Option<usize>,
    ) -> Self {
        Self {
            retriever,
            format,
            top_k,
            max_observation_words,
        }
    }

    /// The oracle's query for a clue: its first [`Self::QUERY_WORDS`] words without the masks
    /// and the punctuation around words.
    pub fn query(clue: &str) -> String {
        clue.split_whitespace()
            .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
            .filter(|w| !w.is_empty())
            .take(Self::QUERY_WORDS)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The transcript of `question`: search the query, then answer with the article's title
    /// (its bare form) when the observation shows the article's passage; `None` otherwise.
    pub fn answer(&self, question: &WikiQuestion) -> Result<Option<Transcript>, RetrievalError> {
        let query = Self::query(&question.clue);
        let hits = self
            .retriever
            .retrieve(std::slice::from_ref(&query), self.top_k)?
            .into_iter()
            .next()
            .unwrap_or_default();
        let budget = match self.max_observation_words {
            Some(n) => TextBudget::Words(n),
            None => TextBudget::Unlimited,
        };
        let observation = format_observation(&hits, self.format.observation_style(), &budget);
        let Some(rank) = hits.iter().position(|h| {
            let (title, _) = split_contents(&h.document.contents);
            title == question.title
        }) else {
            return Ok(None);
        };
        // The passage must be visible: its title line survives the word budget.
        if !observation.contains(&format!("Doc {}(Title: \"{}\")", rank + 1, question.title)) {
            return Ok(None);
        }
        let answer = bare_title(&question.title).to_string();
        let turns = vec![
            Turn {
                think: "I will search for the sentence.".into(),
                action: Action::Search(query),
                observation: Some(observation),
            },
            Turn {
                think: format!("Doc {} is the article.", rank + 1),
                action: Action::Answer(answer.clone()),
                observation: None,
            },
        ];
        Ok(Some(Transcript {
            question_id: question.id.clone(),
            question: question.text.clone(),
            format: self.format,
            turns,
            answer,
            noise: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::bm25_mem::InMemoryBm25;

    fn art(title: &str, extract: &str) -> WikiArticle {
        WikiArticle {
            title: title.into(),
            extract: extract.into(),
            description: None,
            topic: None,
        }
    }

    #[test]
    fn first_sentence_skips_initials_and_abbreviations() {
        assert_eq!(
            first_sentence("John F. Kennedy was a president. He was born in 1917."),
            "John F. Kennedy was a president."
        );
        assert_eq!(
            first_sentence("St. Louis is a city in the U.S. state of Missouri. It is big."),
            "St. Louis is a city in the U.S. state of Missouri."
        );
        assert_eq!(first_sentence("No full stop"), "No full stop");
        assert_eq!(
            first_sentence("Version 2.5 is out. Next."),
            "Version 2.5 is out."
        );
    }

    #[test]
    fn masks_the_title_and_its_words() {
        assert_eq!(
            mask_title(
                "Tsinghua University is a public research university in Beijing.",
                "Tsinghua University"
            )
            .unwrap(),
            "___ is a public research ___ in Beijing."
        );
        assert_eq!(
            mask_title(
                "Eugen Friedrich Brecht, known as Bertolt Brecht, was a playwright.",
                "Bertolt Brecht"
            )
            .unwrap(),
            "Eugen Friedrich ___, known as ___, was a playwright."
        );
        assert_eq!(
            mask_title(
                "Proteins are nutrients. Protein is good.",
                "Protein (nutrient)"
            )
            .unwrap(),
            "Proteins are nutrients. ___ is good."
        );
        // Whole words only; no occurrence -> no question.
        assert_eq!(mask_title("Parisian life is busy.", "Paris"), None);
        assert_eq!(bare_title("Protein (nutrient)"), "Protein");
        assert_eq!(bare_title("Paris"), "Paris");
    }

    #[test]
    fn splits_are_disjoint_by_article_and_sized() {
        let arts: Vec<WikiArticle> = (0..400)
            .map(|i| {
                art(
                    &format!("Place{i}"),
                    &format!(
                        "Place{i} is a town number {i} in the middle of a large green valley. More."
                    ),
                )
            })
            .collect();
        let config = WikiQuestionConfig {
            train: 50,
            validation: 10,
            test: 10,
            ..Default::default()
        };
        let [train, val, test] = build_questions(&arts, &config);
        assert_eq!((train.len(), val.len(), test.len()), (50, 10, 10));
        let titles = |qs: &[WikiQuestion]| -> std::collections::BTreeSet<String> {
            qs.iter().map(|q| q.title.clone()).collect()
        };
        assert!(titles(&train).is_disjoint(&titles(&test)));
        assert!(titles(&train).is_disjoint(&titles(&val)));
        assert_eq!(test[0].id, "wiki-test-0");
        assert!(test[0].clue.starts_with("___ is a town number"));
        assert_eq!(test[0].golden_answers, vec![test[0].title.clone()]);
        // Deterministic, and another seed draws other splits.
        assert_eq!(build_questions(&arts, &config)[2], test);
        let other = build_questions(&arts, &WikiQuestionConfig { seed: 1, ..config });
        assert_ne!(other[2], test);
    }

    #[test]
    fn oracle_searches_the_clue_and_answers_the_title() {
        let arts = vec![
            art(
                "Paris",
                "Paris is the capital and largest city of France. It is old.",
            ),
            art(
                "Lyon",
                "Lyon is the third-largest city of France by population.",
            ),
            art(
                "Berlin",
                "Berlin is the capital and largest city of Germany.",
            ),
        ];
        let docs = super::super::wiki::to_documents(&arts);
        let bm25 = InMemoryBm25::new(docs);
        let config = WikiQuestionConfig {
            min_words: 4,
            ..Default::default()
        };
        let q = arts
            .iter()
            .find_map(|a| candidate(a, &config).filter(|_| a.title == "Paris"))
            .map(|(clue, golden_answers)| WikiQuestion {
                id: "q".into(),
                text: question_text(&clue),
                clue,
                title: "Paris".into(),
                golden_answers,
            })
            .unwrap();
        assert_eq!(q.clue, "___ is the capital and largest city of France.");
        assert_eq!(
            WikiOracle::query(&q.clue),
            "is the capital and largest city of France"
        );
        let oracle = WikiOracle::new(&bm25, AgentFormat::SearchR1, 2, Some(40));
        let t = oracle.answer(&q).unwrap().expect("answerable");
        assert_eq!(t.answer, "Paris");
        assert!(t.exact_match(&q.golden_answers));
        let segs = t.segments();
        assert_eq!(segs.len(), 3);
        assert!(
            segs[0]
                .0
                .contains("<search>is the capital and largest city of France</search>")
        );
        assert!(segs[1].0.contains("Doc 1(Title: \"Paris\")"));
        assert!(!segs[1].1);
        assert_eq!(
            segs[2].0,
            "<think>Doc 1 is the article.</think>\n<answer>Paris</answer>"
        );
        // A budget that hides the passage makes the question unanswerable.
        let blind = WikiOracle::new(&bm25, AgentFormat::SearchR1, 2, Some(0));
        assert!(blind.answer(&q).unwrap().is_none());
    }
}

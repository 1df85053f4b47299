//! A generated multi-hop world: made-up entities, typed relations between them, one passage per
//! entity, and questions of 1 to 4 hops whose answers must be searched for.
//!
//! The world is fully determined by [`WorldConfig`] (including its seed): names are built from a
//! shuffled syllable inventory, relations and questions are drawn with [`rng::SplitMix64`]
//! streams (one per purpose, so asking for more questions does not change the entities).
//!
//! - Entities: countries, cities, companies (`"Name Corp/Labs/Group/Works/Systems"`) and persons
//!   (two words). Every name word is unique unless [`WorldConfig::confusability`] makes near
//!   copies (one syllable changed) or shared surnames.
//! - Relations ([`Relation`]): city → country, country → capital, person → born in, person → works
//!   for, company → founded by, company → based in.
//! - Passages: one per entity, 2–3 sentences, the name in every sentence ("Zorvak Telim is a
//!   person. Zorvak Telim was born in Quenor. Zorvak Telim works for Mirabel Corp."), plus
//!   optional distractor passages that mention two entities without stating any relation.
//! - Questions ([`TEMPLATES`]): 1-hop questions ask one relation of a subject; k-hop questions
//!   follow a chain of k relations. Each records its golden answers (name and aliases), hop count
//!   and the chain of entities reached after each hop.
//! - Splits: the subjects of each kind are partitioned; validation and test questions ask only
//!   about held-out subjects, which never appear as the subject of a training question (they do
//!   appear inside chains and passages).
//!
//! [`World::write_search_r1`] exports the corpus and the QA files in Search-R1's formats;
//! [`oracle`] answers the questions by searching, hop by hop, with short or long thoughts
//! ([`WorldConfig::thoughts`]).

pub mod oracle;
pub mod rng;

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::corpus::{CorpusError, QaExample, join_contents, write_corpus, write_qa};
use crate::search::Document;
pub use oracle::ThoughtStyle;
use rng::SplitMix64;

/// Error in a world configuration.
#[derive(Debug, thiserror::Error)]
pub enum WorldError {
    /// A setting is out of range or the settings contradict each other.
    #[error("invalid world config: {field}: {message}")]
    Config {
        /// The offending field of [`WorldConfig`] / [`QuestionConfig`].
        field: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The syllable inventory cannot produce enough distinct names.
    #[error(
        "cannot make {needed} distinct names from {syllables} syllables; raise `syllables` or lower the entity counts"
    )]
    NameSpace {
        /// Names needed.
        needed: usize,
        /// Syllables available.
        syllables: usize,
    },
}

/// Kind of an entity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EntityKind {
    /// A country (has a capital).
    Country,
    /// A city (lies in a country).
    City,
    /// A company (founded by a person, based in a city).
    Company,
    /// A person (born in a city, works for a company).
    Person,
}

impl EntityKind {
    /// All kinds, in generation order.
    pub const ALL: [EntityKind; 4] = [
        EntityKind::Country,
        EntityKind::City,
        EntityKind::Company,
        EntityKind::Person,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// Lowercase noun ("country", "city", "company", "person").
    pub fn noun(self) -> &'static str {
        match self {
            EntityKind::Country => "country",
            EntityKind::City => "city",
            EntityKind::Company => "company",
            EntityKind::Person => "person",
        }
    }
}

/// A typed relation from a subject entity to exactly one object entity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Relation {
    /// city → the country it lies in.
    InCountry,
    /// country → its capital city.
    Capital,
    /// person → the city where they were born.
    BornIn,
    /// person → the company they work for.
    WorksFor,
    /// company → the person who founded it.
    FoundedBy,
    /// company → the city where it is based.
    BasedIn,
}

impl Relation {
    /// All relations.
    pub const ALL: [Relation; 6] = [
        Relation::InCountry,
        Relation::Capital,
        Relation::BornIn,
        Relation::WorksFor,
        Relation::FoundedBy,
        Relation::BasedIn,
    ];

    /// The kind of the subject.
    pub fn subject_kind(self) -> EntityKind {
        match self {
            Relation::InCountry => EntityKind::City,
            Relation::Capital => EntityKind::Country,
            Relation::BornIn | Relation::WorksFor => EntityKind::Person,
            Relation::FoundedBy | Relation::BasedIn => EntityKind::Company,
        }
    }

    /// The kind of the object.
    pub fn object_kind(self) -> EntityKind {
        match self {
            Relation::InCountry => EntityKind::Country,
            Relation::Capital | Relation::BornIn | Relation::BasedIn => EntityKind::City,
            Relation::WorksFor => EntityKind::Company,
            Relation::FoundedBy => EntityKind::Person,
        }
    }

    fn pattern(self) -> (&'static str, &'static str) {
        // (prefix before the subject, text between subject and object)
        match self {
            Relation::InCountry => ("", " is located in "),
            Relation::Capital => ("The capital of ", " is "),
            Relation::BornIn => ("", " was born in "),
            Relation::WorksFor => ("", " works for "),
            Relation::FoundedBy => ("", " was founded by "),
            Relation::BasedIn => ("", " is based in "),
        }
    }

    /// The sentence stating the fact, as it appears in the subject's passage
    /// (`"Zorvak Telim was born in Quenor."`).
    pub fn sentence(self, subject: &str, object: &str) -> String {
        let (pre, mid) = self.pattern();
        format!("{pre}{subject}{mid}{object}.")
    }

    /// Reads the object of this relation for `subject` from a passage text: the first sentence
    /// of the form produced by [`Relation::sentence`].
    pub fn parse<'t>(self, text: &'t str, subject: &str) -> Option<&'t str> {
        let (pre, mid) = self.pattern();
        let head = format!("{pre}{subject}{mid}");
        text.split('.')
            .map(str::trim)
            .find_map(|s| s.strip_prefix(head.as_str()))
            .map(str::trim)
            .filter(|o| !o.is_empty())
    }
}

/// Index of an entity in [`World::entities`].
pub type EntityId = usize;

/// One entity of the world.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entity {
    /// Its index in [`World::entities`] (also its document id).
    pub id: EntityId,
    /// Its kind.
    pub kind: EntityKind,
    /// Its unique name.
    pub name: String,
    /// Other accepted names ("Republic of Quenor" for a country, "Mirabel" for "Mirabel Corp").
    pub aliases: Vec<String>,
    /// Outgoing relations (one object per relation).
    pub facts: Vec<(Relation, EntityId)>,
}

impl Entity {
    /// The object of `relation`, if this entity has it.
    pub fn get(&self, relation: Relation) -> Option<EntityId> {
        self.facts
            .iter()
            .find(|(r, _)| *r == relation)
            .map(|&(_, o)| o)
    }
}

/// Which part of the data a question belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Split {
    /// Training questions (subjects not held out).
    Train,
    /// Validation questions (held-out subjects).
    Validation,
    /// Test questions (held-out subjects, disjoint from validation subjects).
    Test,
}

impl Split {
    /// All splits.
    pub const ALL: [Split; 3] = [Split::Train, Split::Validation, Split::Test];

    /// `"train"`, `"validation"` or `"test"`.
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Validation => "validation",
            Split::Test => "test",
        }
    }
}

/// A question template: a subject kind, a relation chain and the wording (`{s}` = subject).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Template {
    /// Stable name of the template.
    pub id: &'static str,
    /// The relations followed from the subject, in order (the hop count is their number).
    pub relations: &'static [Relation],
    /// The question with `{s}` for the subject's name.
    pub text: &'static str,
}

impl Template {
    /// Number of hops.
    pub fn hops(&self) -> usize {
        self.relations.len()
    }

    /// The kind of subject the template asks about.
    pub fn subject_kind(&self) -> EntityKind {
        self.relations[0].subject_kind()
    }
}

use Relation::{BasedIn, BornIn, Capital, FoundedBy, InCountry, WorksFor};

/// All question templates: 6 one-hop, 6 two-hop, 5 three-hop and 3 four-hop.
pub const TEMPLATES: &[Template] = &[
    Template {
        id: "born_in",
        relations: &[BornIn],
        text: "Where was {s} born?",
    },
    Template {
        id: "works_for",
        relations: &[WorksFor],
        text: "Which company does {s} work for?",
    },
    Template {
        id: "city_country",
        relations: &[InCountry],
        text: "Which country is {s} in?",
    },
    Template {
        id: "founder",
        relations: &[FoundedBy],
        text: "Who founded {s}?",
    },
    Template {
        id: "based_in",
        relations: &[BasedIn],
        text: "Where is {s} based?",
    },
    Template {
        id: "capital",
        relations: &[Capital],
        text: "What is the capital of {s}?",
    },
    Template {
        id: "birth_country",
        relations: &[BornIn, InCountry],
        text: "Which country was {s} born in?",
    },
    Template {
        id: "founder_birthplace",
        relations: &[FoundedBy, BornIn],
        text: "Where was the founder of {s} born?",
    },
    Template {
        id: "employer_founder",
        relations: &[WorksFor, FoundedBy],
        text: "Who founded the company that {s} works for?",
    },
    Template {
        id: "company_country",
        relations: &[BasedIn, InCountry],
        text: "Which country is {s} based in?",
    },
    Template {
        id: "employer_base",
        relations: &[WorksFor, BasedIn],
        text: "Where is the company that {s} works for based?",
    },
    Template {
        id: "city_capital",
        relations: &[InCountry, Capital],
        text: "What is the capital of the country that {s} is in?",
    },
    Template {
        id: "founder_birth_country",
        relations: &[FoundedBy, BornIn, InCountry],
        text: "Which country was the founder of {s} born in?",
    },
    Template {
        id: "employer_country",
        relations: &[WorksFor, BasedIn, InCountry],
        text: "Which country is the company that {s} works for based in?",
    },
    Template {
        id: "employer_founder_birthplace",
        relations: &[WorksFor, FoundedBy, BornIn],
        text: "Where was the founder of the company that {s} works for born?",
    },
    Template {
        id: "birth_capital",
        relations: &[BornIn, InCountry, Capital],
        text: "What is the capital of the country where {s} was born?",
    },
    Template {
        id: "founder_employer_base",
        relations: &[FoundedBy, WorksFor, BasedIn],
        text: "Where is the company that the founder of {s} works for based?",
    },
    Template {
        id: "employer_founder_country",
        relations: &[WorksFor, FoundedBy, BornIn, InCountry],
        text: "Which country was the founder of the company that {s} works for born in?",
    },
    Template {
        id: "founder_birth_capital",
        relations: &[FoundedBy, BornIn, InCountry, Capital],
        text: "What is the capital of the country where the founder of {s} was born?",
    },
    Template {
        id: "employer_capital",
        relations: &[WorksFor, BasedIn, InCountry, Capital],
        text: "What is the capital of the country where the company that {s} works for is based?",
    },
];

/// How many questions of which hop counts to generate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuestionConfig {
    /// Training questions.
    pub train: usize,
    /// Validation questions.
    pub validation: usize,
    /// Test questions.
    pub test: usize,
    /// Relative weights of 1-, 2-, 3- and 4-hop questions.
    pub hop_weights: [f64; 4],
}

impl Default for QuestionConfig {
    fn default() -> Self {
        QuestionConfig {
            train: 2000,
            validation: 300,
            test: 300,
            hop_weights: [0.5, 0.5, 0.0, 0.0],
        }
    }
}

/// Everything that determines a world. The default is the world measured to work in
/// `notes/quickstart-recipe.md`: 30 countries, 150 cities, 120 companies, 450 persons from 32
/// syllables, 20 % of subjects held out, a 50/50 mix of 1- and 2-hop questions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorldConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Number of countries (≥ 1).
    pub countries: usize,
    /// Number of cities (≥ countries, so every country has a capital).
    pub cities: usize,
    /// Number of companies (≥ 1).
    pub companies: usize,
    /// Number of persons (≥ 1).
    pub persons: usize,
    /// Size of the syllable inventory names are built from (2 to 64).
    pub syllables: usize,
    /// Name confusability in `[0, 1]`: the probability that a new name word is a near copy of an
    /// earlier word (one syllable changed), and that a person shares an earlier person's surname.
    pub confusability: f64,
    /// Size of the given-name pool and of the family-name pool persons are named from (each
    /// person takes one word of each; full names stay unique). 0: every person gets two fresh
    /// words. With a pool, every name word recurs across persons, so the words of a held-out
    /// person were also seen in training questions: copying a name from the question can be
    /// learnt by a word-level model instead of memorised name by name.
    pub person_name_pool: usize,
    /// Number of distractor passages (each mentions two random entities, states no relation).
    pub distractors: usize,
    /// Fraction of the subjects of each kind held out of training questions, split between
    /// validation and test by `validation_fraction` (in `[0, 1)`).
    pub heldout_fraction: f64,
    /// Fraction of each kind's subjects, among the held-out ones, whose questions form the
    /// validation split (the other held-out subjects ask the test questions), rounded down per
    /// kind. Unset: half of the held-out subjects (rounded down). Setting it only moves
    /// held-out subjects between validation and test: the training subjects, passages and
    /// training questions stay as they are.
    pub validation_fraction: Option<f64>,
    /// Question counts and hop mix.
    pub questions: QuestionConfig,
    /// How the world's oracle reasons in its demonstrations (`"short"`, the default: one
    /// sentence a turn; `"long"`: a few sentences of 20–40 word-level tokens a turn, see
    /// [`ThoughtStyle`]). It changes no entity, passage or question, only the text inside the
    /// oracle's `<think>` (or `<reasoning>`) tags, and so what a warm-started model writes there.
    pub thoughts: ThoughtStyle,
    /// Decision density ρ in (0, 1]: the share of an episode's turns whose action decides its
    /// return. Below 1, every h-hop question gets `round((h + 1)(1 − ρ)/ρ)` routine turns
    /// before its h searches and its answer ([`WorldConfig::routine_turns`]): confirmations
    /// whatever the agent writes acknowledges, whose observation is fixed
    /// ([`crate::search::format::routine_observation`]) and which do not count towards
    /// `task.max_turns`; the oracle's demonstrations make them. 1 (the default) adds none and
    /// changes nothing. It changes no entity, passage or question. Whether the routine turns
    /// really decide nothing for a policy is what `turnwise credit-audit`'s realised density
    /// measures.
    pub decision_density: f64,
}

impl Default for WorldConfig {
    fn default() -> Self {
        WorldConfig {
            seed: 0,
            countries: 30,
            cities: 150,
            companies: 120,
            persons: 450,
            syllables: 32,
            confusability: 0.0,
            person_name_pool: 0,
            distractors: 0,
            heldout_fraction: 0.2,
            validation_fraction: None,
            questions: QuestionConfig::default(),
            thoughts: ThoughtStyle::Short,
            decision_density: 1.0,
        }
    }
}

impl WorldConfig {
    /// The routine turns of an `hops`-hop question under [`WorldConfig::decision_density`] ρ:
    /// its `hops + 1` deciding turns (the searches and the answer) are a share ρ of its turns,
    /// so `round((hops + 1)(1 − ρ)/ρ)` turns are routine (0 at ρ = 1).
    pub fn routine_turns(&self, hops: usize) -> usize {
        let rho = self.decision_density;
        if !(rho > 0.0 && rho < 1.0) {
            return 0;
        }
        ((hops + 1) as f64 * (1.0 - rho) / rho).round() as usize
    }

    /// Checks the settings' ranges and consistency (what [`World::generate`] checks first).
    pub fn validate(&self) -> Result<(), WorldError> {
        let bad = |field, message: &str| {
            Err(WorldError::Config {
                field,
                message: message.to_string(),
            })
        };
        if self.countries == 0 || self.companies == 0 || self.persons == 0 {
            return bad(
                "countries/companies/persons",
                "every kind needs at least one entity",
            );
        }
        if self.cities < self.countries {
            return bad(
                "cities",
                "need at least as many cities as countries (one capital each)",
            );
        }
        if !(2..=SYLLABLES.len()).contains(&self.syllables) {
            return bad("syllables", "must be between 2 and 64");
        }
        if !(0.0..=1.0).contains(&self.confusability) {
            return bad("confusability", "must be in [0, 1]");
        }
        if self.person_name_pool > 0 && self.person_name_pool.pow(2) < 2 * self.persons {
            return bad(
                "person_name_pool",
                "the pool must make at least twice as many full names as persons \
                 (person_name_pool² ≥ 2 × persons), or be 0",
            );
        }
        if !(self.decision_density > 0.0 && self.decision_density <= 1.0) {
            return bad("decision_density", "must be in (0, 1]");
        }
        if !(0.0..1.0).contains(&self.heldout_fraction) {
            return bad("heldout_fraction", "must be in [0, 1)");
        }
        if let Some(v) = self.validation_fraction
            && !(0.0..=self.heldout_fraction).contains(&v)
        {
            return bad(
                "validation_fraction",
                "must be in [0, heldout_fraction]: validation subjects are held-out subjects",
            );
        }
        let w = &self.questions.hop_weights;
        if w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || w.iter().sum::<f64>() <= 0.0 {
            return bad(
                "questions.hop_weights",
                "weights must be non-negative with a positive sum",
            );
        }
        Ok(())
    }
}

/// One generated question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Question {
    /// `"{split}_{index}"`.
    pub id: String,
    /// The split it belongs to.
    pub split: Split,
    /// The template's id.
    pub template: String,
    /// The question text.
    pub text: String,
    /// The subject entity.
    pub subject: EntityId,
    /// The subject's name.
    pub subject_name: String,
    /// The relations followed, in order.
    pub relations: Vec<Relation>,
    /// The entity reached after each hop; the last one is the answer.
    pub chain: Vec<EntityId>,
    /// Names of the entities in `chain`.
    pub chain_names: Vec<String>,
    /// Accepted answers: the answer's name, then its aliases.
    pub golden_answers: Vec<String>,
}

impl Question {
    /// Number of hops.
    pub fn hops(&self) -> usize {
        self.relations.len()
    }

    /// The question as a Search-R1 QA example; hop count, template, subject, chain and split go
    /// to the metadata.
    pub fn to_qa(&self) -> QaExample {
        QaExample {
            id: self.id.clone(),
            question: self.text.clone(),
            golden_answers: self.golden_answers.clone(),
            metadata: serde_json::json!({
                "hops": self.hops(),
                "template": self.template,
                "subject": self.subject_name,
                "chain": self.chain_names,
                "split": self.split.name(),
            }),
        }
    }
}

/// A generated world: entities, passages, splits and questions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct World {
    /// The configuration it was generated from.
    pub config: WorldConfig,
    /// All entities; an entity's index is its id.
    pub entities: Vec<Entity>,
    /// The split each entity belongs to as a question subject.
    pub subject_split: Vec<Split>,
    /// Distractor passages (Search-R1 contents), after the entity passages in the corpus.
    pub distractors: Vec<String>,
    /// All questions: train, then validation, then test.
    pub questions: Vec<Question>,
}

/// The syllable inventory (the first `syllables` of a seeded shuffle are used).
const SYLLABLES: [&str; 64] = [
    "zor", "vak", "te", "lim", "qua", "nor", "mi", "ra", "bel", "ka", "do", "rin", "sa", "vel",
    "tor", "ly", "ne", "mar", "pi", "gos", "lu", "fen", "da", "rak", "so", "wen", "bri", "tal",
    "ha", "mo", "xi", "dun", "ae", "cor", "vin", "tha", "gil", "ro", "pen", "ule", "ska", "dor",
    "fi", "nal", "je", "bar", "quo", "sil", "mun", "ek", "ri", "tav", "yo", "zel", "cra", "bo",
    "lin", "dra", "ve", "nu", "ost", "pra", "ga", "ith",
];

const COMPANY_SUFFIXES: [&str; 5] = ["Corp", "Labs", "Group", "Works", "Systems"];

struct NameMaker<'a> {
    rng: &'a mut SplitMix64,
    syllables: Vec<&'static str>,
    confusability: f64,
    used: HashSet<String>,
    /// Words made so far as syllable lists.
    words: Vec<Vec<usize>>,
}

impl NameMaker<'_> {
    fn render(&self, parts: &[usize]) -> String {
        let s: String = parts.iter().map(|&i| self.syllables[i]).collect();
        let mut c = s.chars();
        match c.next() {
            Some(f) => f.to_uppercase().chain(c).collect(),
            None => s,
        }
    }

    /// A fresh capitalised word, unique among all words made so far.
    fn word(&mut self) -> Option<String> {
        let n = self.syllables.len();
        for _ in 0..1000 {
            let parts: Vec<usize> = if !self.words.is_empty() && self.rng.chance(self.confusability)
            {
                let mut p = self.rng.pick(&self.words).clone();
                let at = self.rng.below(p.len());
                p[at] = self.rng.below(n);
                p
            } else {
                let len = if self.rng.chance(0.7) { 2 } else { 3 };
                (0..len).map(|_| self.rng.below(n)).collect()
            };
            let w = self.render(&parts);
            if self.used.insert(w.clone()) {
                self.words.push(parts);
                return Some(w);
            }
        }
        None
    }
}

/// The passage text of an entity (without title).
fn passage_text(world_entities: &[Entity], e: &Entity) -> String {
    let name = &e.name;
    let obj = |r: Relation| &world_entities[e.get(r).expect("fact present")].name;
    match e.kind {
        EntityKind::Country => format!(
            "{name} is a country. {} {name} is also called the Republic of {name}.",
            Relation::Capital.sentence(name, obj(Relation::Capital))
        ),
        EntityKind::City => {
            let country = obj(Relation::InCountry);
            let mut t = format!(
                "{name} is a city. {}",
                Relation::InCountry.sentence(name, country)
            );
            let c = &world_entities[e.get(Relation::InCountry).expect("city has a country")];
            if c.get(Relation::Capital) == Some(e.id) {
                t.push_str(&format!(" {name} is the capital city of {country}."));
            }
            t
        }
        EntityKind::Company => format!(
            "{name} is a company. {} {}",
            Relation::FoundedBy.sentence(name, obj(Relation::FoundedBy)),
            Relation::BasedIn.sentence(name, obj(Relation::BasedIn))
        ),
        EntityKind::Person => format!(
            "{name} is a person. {} {}",
            Relation::BornIn.sentence(name, obj(Relation::BornIn)),
            Relation::WorksFor.sentence(name, obj(Relation::WorksFor))
        ),
    }
}

const DISTRACTOR_TEMPLATES: [(&str, &str); 4] = [
    (
        "Travel notes",
        "Visitors from {a} often talk about {b}. The trip was long and the weather was mild.",
    ),
    (
        "Local news",
        "A newspaper once compared {a} with {b}. Few readers agreed with the comparison.",
    ),
    (
        "Old guide",
        "{a} and {b} appeared together in an old travel guide. The guide is out of print.",
    ),
    (
        "Letters",
        "A letter about {a} was found next to a map of {b}. Nobody knows who wrote it.",
    ),
];

impl World {
    /// Generates the world described by `config`.
    pub fn generate(config: &WorldConfig) -> Result<World, WorldError> {
        config.validate()?;
        let mut entities = Self::name_entities(config)?;
        let mut by_kind: [Vec<EntityId>; 4] = Default::default();
        for e in &entities {
            by_kind[e.kind.index()].push(e.id);
        }
        Self::relate(config.seed, &mut entities, &by_kind);
        let subject_split = Self::split_subjects(config, entities.len(), &by_kind);
        let distractors = Self::distractors(config, &entities);
        let mut world = World {
            config: config.clone(),
            entities,
            subject_split,
            distractors,
            questions: Vec::new(),
        };
        world.questions = world.make_questions();
        Ok(world)
    }

    /// The entities with their names and aliases, kind by kind (the `names` stream), without
    /// facts.
    fn name_entities(config: &WorldConfig) -> Result<Vec<Entity>, WorldError> {
        let seed = config.seed;
        let mut name_rng = SplitMix64::stream(seed, "names");
        let mut inventory: Vec<&'static str> = SYLLABLES.to_vec();
        name_rng.shuffle(&mut inventory);
        inventory.truncate(config.syllables);
        let person_words = if config.person_name_pool > 0 {
            2 * config.person_name_pool
        } else {
            2 * config.persons
        };
        let needed = config.countries + config.cities + config.companies + person_words;
        let space = config.syllables.pow(2) + config.syllables.pow(3);
        if needed * 2 > space {
            return Err(WorldError::NameSpace {
                needed,
                syllables: config.syllables,
            });
        }
        let mut maker = NameMaker {
            rng: &mut name_rng,
            syllables: inventory,
            confusability: config.confusability,
            used: HashSet::new(),
            words: Vec::new(),
        };
        let name_err = || WorldError::NameSpace {
            needed,
            syllables: config.syllables,
        };
        let counts = [
            config.countries,
            config.cities,
            config.companies,
            config.persons,
        ];
        let mut entities: Vec<Entity> = Vec::new();
        let mut full_names: HashSet<String> = HashSet::new();
        let mut surnames: Vec<String> = Vec::new();
        // Given and family names when persons draw from pools (made before any other name).
        let mut pools: Option<(Vec<String>, Vec<String>)> = None;
        if config.person_name_pool > 0 {
            let mut words = || {
                (0..config.person_name_pool)
                    .map(|_| maker.word().ok_or_else(name_err))
                    .collect::<Result<Vec<_>, _>>()
            };
            pools = Some((words()?, words()?));
        }
        for kind in EntityKind::ALL {
            for _ in 0..counts[kind.index()] {
                let (name, aliases) = loop {
                    let (name, aliases) = match kind {
                        EntityKind::Country => {
                            let w = maker.word().ok_or_else(name_err)?;
                            (w.clone(), vec![format!("Republic of {w}")])
                        }
                        EntityKind::City => (maker.word().ok_or_else(name_err)?, vec![]),
                        EntityKind::Company => {
                            let w = maker.word().ok_or_else(name_err)?;
                            let suffix = *maker.rng.pick(&COMPANY_SUFFIXES);
                            (format!("{w} {suffix}"), vec![w])
                        }
                        EntityKind::Person if pools.is_some() => {
                            let (given, family) = pools.as_ref().expect("checked");
                            let first = maker.rng.pick(given).clone();
                            let last = maker.rng.pick(family).clone();
                            (format!("{first} {last}"), vec![])
                        }
                        EntityKind::Person => {
                            let first = maker.word().ok_or_else(name_err)?;
                            let last =
                                if !surnames.is_empty() && maker.rng.chance(config.confusability) {
                                    maker.rng.pick(&surnames).clone()
                                } else {
                                    maker.word().ok_or_else(name_err)?
                                };
                            (format!("{first} {last}"), vec![])
                        }
                    };
                    if full_names.insert(name.clone()) {
                        break (name, aliases);
                    }
                };
                if kind == EntityKind::Person {
                    surnames.push(name.split_once(' ').expect("two words").1.to_string());
                }
                entities.push(Entity {
                    id: entities.len(),
                    kind,
                    name,
                    aliases,
                    facts: Vec::new(),
                });
            }
        }
        Ok(entities)
    }

    /// Each entity's facts (the `relations` stream): every city in a country, each country's
    /// capital, each company's founder and base, each person's birthplace and employer.
    fn relate(seed: u64, entities: &mut [Entity], by_kind: &[Vec<EntityId>; 4]) {
        let [countries, cities, companies, persons] = by_kind;
        let mut rel_rng = SplitMix64::stream(seed, "relations");
        let mut cities_of: HashMap<EntityId, Vec<EntityId>> = HashMap::new();
        for (i, &city) in cities.iter().enumerate() {
            let country = if i < countries.len() {
                countries[i]
            } else {
                *rel_rng.pick(countries)
            };
            entities[city].facts.push((InCountry, country));
            cities_of.entry(country).or_default().push(city);
        }
        for &country in countries {
            let capital = *rel_rng.pick(&cities_of[&country]);
            entities[country].facts.push((Capital, capital));
        }
        for &company in companies {
            let founder = *rel_rng.pick(persons);
            let base = *rel_rng.pick(cities);
            entities[company].facts.push((FoundedBy, founder));
            entities[company].facts.push((BasedIn, base));
        }
        for &person in persons {
            let born = *rel_rng.pick(cities);
            let employer = *rel_rng.pick(companies);
            entities[person].facts.push((BornIn, born));
            entities[person].facts.push((WorksFor, employer));
        }
    }

    /// Each entity's split as a question subject (the `splits` stream): per kind, a shuffled
    /// partition into held-out (validation, then test) and training subjects.
    fn split_subjects(
        config: &WorldConfig,
        entities: usize,
        by_kind: &[Vec<EntityId>; 4],
    ) -> Vec<Split> {
        let seed = config.seed;
        let mut split_rng = SplitMix64::stream(seed, "splits");
        let mut subject_split = vec![Split::Train; entities];
        for ids in by_kind {
            let mut ids = ids.clone();
            split_rng.shuffle(&mut ids);
            let held = ((ids.len() as f64) * config.heldout_fraction).round() as usize;
            let n_val = match config.validation_fraction {
                None => held / 2,
                // Rounded down (past float error), as `held / 2` is: a fraction of half the
                // held-out one reproduces the unset split whenever `heldout_fraction` cuts an
                // even number of subjects or a whole one.
                Some(v) => ((((ids.len() as f64) * v) + 1e-9).floor() as usize).min(held),
            };
            for (i, &id) in ids.iter().take(held).enumerate() {
                subject_split[id] = if i < n_val {
                    Split::Validation
                } else {
                    Split::Test
                };
            }
        }
        subject_split
    }

    /// The distractor passages (the `distractors` stream): templates naming two random
    /// entities.
    fn distractors(config: &WorldConfig, entities: &[Entity]) -> Vec<String> {
        let seed = config.seed;
        let mut d_rng = SplitMix64::stream(seed, "distractors");
        (0..config.distractors)
            .map(|i| {
                let (title, text) = *d_rng.pick(&DISTRACTOR_TEMPLATES);
                let a = &entities[d_rng.below(entities.len())].name;
                let b = &entities[d_rng.below(entities.len())].name;
                join_contents(
                    &format!("{title} {}", i + 1),
                    &text.replace("{a}", a).replace("{b}", b),
                )
            })
            .collect()
    }

    fn make_questions(&self) -> Vec<Question> {
        let qc = &self.config.questions;
        let mut rng = SplitMix64::stream(self.config.seed, "questions");
        let mut out = Vec::new();
        for (split, count) in [
            (Split::Train, qc.train),
            (Split::Validation, qc.validation),
            (Split::Test, qc.test),
        ] {
            // Candidate (template, subject) pairs per hop count, drawn without replacement
            // until a pool runs out (then it is reshuffled and reused).
            let mut pools: Vec<Vec<(usize, EntityId)>> = vec![Vec::new(); 4];
            for (t, tpl) in TEMPLATES.iter().enumerate() {
                for e in &self.entities {
                    if e.kind == tpl.subject_kind() && self.subject_split[e.id] == split {
                        pools[tpl.hops() - 1].push((t, e.id));
                    }
                }
            }
            let mut weights = qc.hop_weights;
            for (w, pool) in weights.iter_mut().zip(&pools) {
                if pool.is_empty() {
                    *w = 0.0;
                }
            }
            if weights.iter().sum::<f64>() <= 0.0 {
                continue;
            }
            let mut cursors = [0usize; 4];
            for pool in &mut pools {
                rng.shuffle(pool);
            }
            for i in 0..count {
                let h = rng.weighted(&weights);
                if cursors[h] == pools[h].len() {
                    rng.shuffle(&mut pools[h]);
                    cursors[h] = 0;
                }
                let (t, subject) = pools[h][cursors[h]];
                cursors[h] += 1;
                out.push(self.question(
                    &format!("{}_{i}", split.name()),
                    split,
                    &TEMPLATES[t],
                    subject,
                ));
            }
        }
        out
    }

    /// Builds the question `template` asks about `subject` (of the template's subject kind).
    pub fn question(
        &self,
        id: &str,
        split: Split,
        template: &Template,
        subject: EntityId,
    ) -> Question {
        let mut chain = Vec::with_capacity(template.hops());
        let mut at = subject;
        for &r in template.relations {
            at = self.entities[at]
                .get(r)
                .unwrap_or_else(|| panic!("{} has no {r:?}", self.entities[at].name));
            chain.push(at);
        }
        let answer = &self.entities[*chain.last().expect("at least one hop")];
        let subject_name = self.entities[subject].name.clone();
        Question {
            id: id.to_string(),
            split,
            template: template.id.to_string(),
            text: template.text.replace("{s}", &subject_name),
            subject,
            subject_name,
            relations: template.relations.to_vec(),
            chain_names: chain
                .iter()
                .map(|&c| self.entities[c].name.clone())
                .collect(),
            chain,
            golden_answers: std::iter::once(answer.name.clone())
                .chain(answer.aliases.iter().cloned())
                .collect(),
        }
    }

    /// Ids of the entities of one kind.
    pub fn ids_of(&self, kind: EntityKind) -> Vec<EntityId> {
        self.entities
            .iter()
            .filter(|e| e.kind == kind)
            .map(|e| e.id)
            .collect()
    }

    /// The entity with this exact name.
    pub fn by_name(&self, name: &str) -> Option<&Entity> {
        self.entities.iter().find(|e| e.name == name)
    }

    /// The passage text of an entity (2–3 sentences, the name in each).
    pub fn passage(&self, id: EntityId) -> String {
        passage_text(&self.entities, &self.entities[id])
    }

    /// The corpus: one document per entity (id = entity id, title = name), then the distractors
    /// (ids continue after the entities).
    pub fn documents(&self) -> Vec<Document> {
        let mut docs: Vec<Document> = self
            .entities
            .iter()
            .map(|e| Document {
                id: e.id.to_string(),
                contents: join_contents(&e.name, &self.passage(e.id)),
            })
            .collect();
        let n = docs.len();
        docs.extend(self.distractors.iter().enumerate().map(|(i, c)| Document {
            id: (n + i).to_string(),
            contents: c.clone(),
        }));
        docs
    }

    /// Questions of one split.
    pub fn questions_in(&self, split: Split) -> impl Iterator<Item = &Question> {
        self.questions.iter().filter(move |q| q.split == split)
    }

    /// Writes `corpus.jsonl`, `train.jsonl`, `validation.jsonl`, `test.jsonl` (Search-R1 formats)
    /// and `world.json` (the whole world) into `dir`, creating it if needed.
    pub fn write_search_r1(&self, dir: impl AsRef<Path>) -> Result<(), CorpusError> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|e| CorpusError::Io {
            path: dir.to_path_buf(),
            cause: e,
        })?;
        write_corpus(dir.join("corpus.jsonl"), &self.documents())?;
        for split in Split::ALL {
            let qa: Vec<QaExample> = self.questions_in(split).map(Question::to_qa).collect();
            write_qa(dir.join(format!("{}.jsonl", split.name())), &qa)?;
        }
        let path = dir.join("world.json");
        let json = serde_json::to_vec(self).expect("world serialises");
        std::fs::write(&path, json).map_err(|e| CorpusError::Io { path, cause: e })
    }
}

#[cfg(test)]
mod tests;

//! # turnwise-env
//!
//! What the agent acts in: corpora, search (BM25, dense), the Search-R1-compatible retrieval
//! server and client, the search-agent environment, the generated multi-hop world, text games and
//! the LLM judge.

pub mod client;
pub mod corpus;
pub mod env;
pub mod games;
pub mod judge;
pub mod search;
pub mod server;
pub mod world;

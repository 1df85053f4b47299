//! `turnwise serve-retriever`: `POST /retrieve` over real HTTP, on a small in-memory corpus.
//!
//! Input: the body. Invariants beyond "no panic": no 500; every body is JSON; an error names
//! what is wrong; a 200 holds one result list per query, each of at most `topk` documents
//! (Search-R1's default 3 when `topk` is absent, null or 0).

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use serde_json::Value;
use turnwise_env::search::Document;
use turnwise_env::server::{BackgroundServer, ServerConfig, TermOverlapRetriever};

fn server() -> SocketAddr {
    static SERVER: OnceLock<BackgroundServer> = OnceLock::new();
    SERVER
        .get_or_init(|| {
            let docs = [
                ("Paris", "Paris is the capital of France."),
                ("Berlin", "Berlin is the capital of Germany."),
                ("Rada Cradovel", "Rada Cradovel was born in Olvenia."),
                ("Olvenia", "Olvenia is a country whose capital is Tarsk."),
                ("Tarsk", "Tarsk lies on the river Vell."),
            ]
            .iter()
            .enumerate()
            .map(|(i, (t, x))| Document {
                id: i.to_string(),
                contents: turnwise_env::corpus::join_contents(t, x),
            })
            .collect();
            let config = ServerConfig {
                max_queries: 64,
                ..ServerConfig::with_addr("127.0.0.1:0".parse().expect("an address"))
            };
            BackgroundServer::start(Arc::new(TermOverlapRetriever::new(docs)), config)
                .expect("the retriever starts")
        })
        .local_addr()
}

/// One input (see the module docs).
pub fn run(data: &[u8]) {
    let what = "POST /retrieve";
    let Some(v) = crate::http::post_checked(server(), "/retrieve", data) else {
        return;
    };
    let request: Value = serde_json::from_slice(data).expect("an accepted body is JSON");
    let queries = request["queries"]
        .as_array()
        .expect("accepted queries")
        .len();
    let topk = match request["topk"].as_u64() {
        None | Some(0) => 3,
        Some(k) => k as usize,
    };
    let results = v["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: 200 without result: {v}"));
    assert_eq!(results.len(), queries, "{what}: one list per query");
    for r in results {
        let hits = r.as_array().unwrap_or_else(|| panic!("{what}: {r}"));
        assert!(
            hits.len() <= topk,
            "{what}: {} hits for topk {topk}",
            hits.len()
        );
    }
}

//! Serving a policy from a checkpoint folder, as the trainer needs it without depending on the
//! server: the harness rollout backend (`rollout.backend = "harness"`) plays its agent program
//! against the trainer's policy served on loopback, and an LLM judge may be served inside the
//! run (`judge.serve`). Both start it through a [`PolicyHost`], which `turnwise serve`
//! implements ([`crate::serve::LocalHost`]) and the program installs once ([`install`]: the
//! `turnwise` binary does at start; a library user or a test that trains with either calls it
//! before building the trainer).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use anyhow::{Result, anyhow};

/// How a policy is served: the name it answers to and the weight version it reports until its
/// first reload. It listens on a free loopback port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOptions {
    /// The model name answers carry and `/v1/models` lists.
    pub name: String,
    /// The weight version reported until the first reload (`None`: the server's default).
    pub weight_version: Option<String>,
}

/// A policy being served; dropping it stops the server.
pub trait ServedPolicy: Send + Sync {
    /// The server's base URL (`http://ip:port`).
    fn url(&self) -> String;
}

/// A policy loaded from a folder, ready to be served.
pub trait LoadedPolicy: Send {
    /// Starts serving it on a free loopback port; returns once the socket is bound.
    fn start(self: Box<Self>, options: &HostOptions) -> Result<Box<dyn ServedPolicy>>;
}

/// Loads policies to serve: a run directory (its latest complete checkpoint), a checkpoint or
/// Hugging Face folder, a GGUF file, or a packaged model's name.
pub trait PolicyHost: Send + Sync {
    /// Loads what `spec` names.
    fn load(&self, spec: &Path) -> Result<Box<dyn LoadedPolicy>>;
}

static HOST: OnceLock<Arc<dyn PolicyHost>> = OnceLock::new();

/// Installs the process's policy host. The first one installed stays: a later call changes
/// nothing and returns `false`.
pub fn install(host: Arc<dyn PolicyHost>) -> bool {
    HOST.set(host).is_ok()
}

/// The installed policy host; `what` (the setting that needs it) names the error when none is.
pub fn installed(what: &str) -> Result<Arc<dyn PolicyHost>> {
    HOST.get().cloned().ok_or_else(|| {
        anyhow!(
            "{what} serves a policy, but no policy host is installed in this program: call \
             turnwise::rollout::host::install(Arc::new(turnwise::serve::LocalHost)) before \
             building the trainer (the turnwise command does at start)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_host_the_setting_that_needs_one_is_named() {
        // The library's own tests install no host.
        let e = installed("judge.serve").err().expect("no host installed");
        let text = e.to_string();
        assert!(text.starts_with("judge.serve serves a policy"), "{text}");
        assert!(text.contains("turnwise::rollout::host::install"), "{text}");
    }
}

//! `turnwise`: the command-line tool. Errors are reported with their whole cause chain and a
//! non-zero exit status.

mod commands;

use clap::Parser;

// candle's matmuls and our own code allocate many short-lived buffers; mimalloc is measurably
// faster than the system allocator here (see ../shared/notes/candle-on-this-machine.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The error and its causes joined by `: `, leaving out a cause whose text the message before it
/// already holds (errors that print their source in their own message).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// `turnwise presets | head -1`: when the reader of stdout goes away, `println!` panics with
/// "failed printing to stdout: Broken pipe". Exit quietly (status 0, as ripgrep does) instead of
/// printing a panic and a backtrace; every other panic keeps the default report.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}

fn main() -> std::process::ExitCode {
    #[cfg(unix)]
    turnwise_model::device::reexec_with_fast_settings();
    // candle 0.11 re-reads /proc/cpuinfo on every CPU matmul unless RAYON_NUM_THREADS is set
    // (measured: 2.6x slower sampling); set it to the core count before any thread starts.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: no other thread exists yet, so nothing reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
    quiet_on_broken_pipe();
    // A run that serves a policy (the harness backend, `judge.serve`) starts it through this.
    turnwise::rollout::host::install(std::sync::Arc::new(turnwise::serve::LocalHost));
    let cli = commands::Cli::parse();
    commands::init_logging(cli.quiet);
    match commands::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

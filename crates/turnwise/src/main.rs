//! `turnwise`: the command-line tool. Errors are reported with their whole cause chain and a
//! non-zero exit status.

mod commands;

use clap::Parser;

// candle's matmuls and our own code allocate many short-lived buffers; mimalloc is measurably
// faster than the system allocator here (see ../shared/notes/candle-on-this-machine.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // candle 0.11 re-reads /proc/cpuinfo on every CPU matmul unless RAYON_NUM_THREADS is set
    // (measured: 2.6x slower sampling); set it to the core count before any thread starts.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        // SAFETY: no other thread exists yet, so nothing reads the environment concurrently.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", n.to_string()) };
    }
    let cli = commands::Cli::parse();
    commands::init_logging(cli.quiet);
    match commands::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

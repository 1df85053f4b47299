//! `turnwise`: the command-line tool. Errors are reported with their whole cause chain and a
//! non-zero exit status.

mod commands;

use clap::Parser;

// candle's matmuls and our own code allocate many short-lived buffers; mimalloc is measurably
// faster than the system allocator here (see ../shared/notes/candle-on-this-machine.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
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

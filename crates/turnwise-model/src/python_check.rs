//! Tests that compare with Python libraries (transformers, PEFT): which interpreter to run,
//! and whether it has what a test needs.

/// The Python interpreter (`$TURNWISE_PYTHON`, else `python3`) when it imports every module of
/// `modules` (comma-separated, as in an `import` line); otherwise prints why the calling test is
/// skipped and returns `None`.
pub(crate) fn python_with(modules: &str) -> Option<String> {
    let python = std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into());
    match std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
    {
        Ok(o) if o.status.success() => Some(python),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            eprintln!(
                "skipped: {python} cannot import {modules} ({})",
                err.lines().last().unwrap_or("")
            );
            None
        }
        Err(e) => {
            eprintln!("skipped: cannot run {python}: {e}");
            None
        }
    }
}

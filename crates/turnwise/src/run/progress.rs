//! [`Progress`]: a progress bar with an ETA on a terminal, a log line every few percent
//! elsewhere, nothing in quiet mode.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How a [`Progress`] shows itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    /// An indicatif bar on stderr, with elapsed time, ETA and a message.
    Bar,
    /// No bar: an `info` log line through `tracing` each time another `every_percent` percent
    /// is done (for logs, CI and `nohup`).
    Log {
        /// The step between two lines, in percent (1 to 100).
        every_percent: u64,
    },
    /// Nothing at all (quiet mode); `tracing` logs of the caller still go through.
    Silent,
}

impl ProgressMode {
    /// `Silent` when `quiet`, else `Bar` when stderr is a terminal, else `Log` every 10%.
    pub fn detect(quiet: bool) -> Self {
        if quiet {
            Self::Silent
        } else if std::io::stderr().is_terminal() {
            Self::Bar
        } else {
            Self::Log { every_percent: 10 }
        }
    }
}

/// Progress of one long phase (warm start, RL steps, evaluation) of `total` units.
///
/// The methods take `&self`, so a `Progress` can be shared with callbacks.
#[derive(Debug)]
pub struct Progress {
    bar: ProgressBar,
    mode: ProgressMode,
    name: String,
    /// The last percent mark logged (Log mode).
    logged: AtomicU64,
    /// Every unit is reported by [`Progress::step_line`]: no percent lines of its own.
    per_step: bool,
}

/// `1:02:03` or `2:05`.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, (s % 3600) / 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

/// The highest multiple of `every` percent reached by `pos` out of `total`.
fn percent_mark(pos: u64, total: u64, every: u64) -> u64 {
    if total == 0 {
        return 0;
    }
    let every = every.clamp(1, 100);
    let pct = (u128::from(pos.min(total)) * 100 / u128::from(total)) as u64;
    pct / every * every
}

impl Progress {
    /// A progress of `total` units named `name`, shown as [`ProgressMode::detect`] decides.
    pub fn new(name: impl Into<String>, total: u64, quiet: bool) -> Self {
        Self::with_mode(name, total, ProgressMode::detect(quiet))
    }

    /// A progress shown in the given mode.
    pub fn with_mode(name: impl Into<String>, total: u64, mode: ProgressMode) -> Self {
        let name = name.into();
        let bar = match mode {
            ProgressMode::Bar => {
                let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
                let style = ProgressStyle::with_template(
                    "{prefix:>10.bold} [{elapsed_precise}] {wide_bar:.cyan/blue} {pos}/{len} ETA {eta} {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
                bar.set_style(style);
                bar.set_prefix(name.clone());
                bar.enable_steady_tick(Duration::from_millis(500));
                bar
            }
            ProgressMode::Log { .. } | ProgressMode::Silent => {
                ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden())
            }
        };
        Self {
            bar,
            mode,
            name,
            logged: AtomicU64::new(0),
            per_step: false,
        }
    }

    /// A progress whose every unit reports itself with [`Progress::step_line`] (the RL steps):
    /// a bar on a terminal, and elsewhere exactly one log line per unit, with no percent lines.
    pub fn per_step(name: impl Into<String>, total: u64, quiet: bool) -> Self {
        let mut p = Self::new(name, total, quiet);
        p.per_step = true;
        p
    }

    /// Reports one unit: printed above the bar (Bar); logged with the elapsed time and the ETA
    /// (Log); dropped (Silent).
    pub fn step_line(&self, line: impl AsRef<str>) {
        match self.mode {
            ProgressMode::Bar => self.bar.println(line.as_ref()),
            ProgressMode::Log { .. } => {
                tracing::info!("{} [{}]", line.as_ref(), self.elapsed_and_eta());
            }
            ProgressMode::Silent => {}
        }
    }

    /// The mode.
    pub fn mode(&self) -> ProgressMode {
        self.mode
    }

    /// Units done so far.
    pub fn position(&self) -> u64 {
        self.bar.position()
    }

    /// The total.
    pub fn total(&self) -> u64 {
        self.bar.length().unwrap_or(0)
    }

    /// Adds `delta` units.
    pub fn inc(&self, delta: u64) {
        self.bar.inc(delta);
        self.after_move();
    }

    /// Sets the units done.
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
        self.after_move();
    }

    /// Sets the message shown after the bar (and in the log lines), e.g. the last loss.
    pub fn set_message(&self, msg: impl Into<String>) {
        self.bar.set_message(msg.into());
    }

    /// Prints a line above the bar (Bar), logs it (Log), or drops it (Silent).
    pub fn println(&self, line: impl AsRef<str>) {
        match self.mode {
            ProgressMode::Bar => self.bar.println(line.as_ref()),
            ProgressMode::Log { .. } => tracing::info!("{}", line.as_ref()),
            ProgressMode::Silent => {}
        }
    }

    /// Runs `f` with the bar cleared, so that what `f` writes to the terminal (logs) is not
    /// mixed with the bar.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// `1:02 elapsed, ETA 3:04` (no ETA before the first unit or after the last).
    fn elapsed_and_eta(&self) -> String {
        let (pos, total) = (self.position(), self.total());
        let elapsed = self.bar.elapsed();
        let mut out = format!("{} elapsed", clock(elapsed));
        if pos > 0 && pos < total {
            let eta = elapsed.mul_f64((total - pos) as f64 / pos as f64);
            out.push_str(&format!(", ETA {}", clock(eta)));
        }
        out
    }

    /// The line logged in Log mode: with the share done (`pct`), or, at the end, with "done"
    /// after the position (the final message comes last: "warm start: 30/30 done, 0:03
    /// elapsed, 30 steps in 3 s").
    fn status_line(&self, pct: Option<u64>) -> String {
        let mut line = format!("{}: {}/{}", self.name, self.position(), self.total());
        match pct {
            Some(p) => line.push_str(&format!(" ({p}%)")),
            None => line.push_str(" done"),
        }
        line.push_str(", ");
        line.push_str(&self.elapsed_and_eta());
        let msg = self.bar.message();
        if !msg.is_empty() {
            line.push_str(", ");
            line.push_str(&msg);
        }
        line
    }

    fn after_move(&self) {
        let ProgressMode::Log { every_percent } = self.mode else {
            return;
        };
        if self.per_step {
            return;
        }
        let mark = percent_mark(self.position(), self.total(), every_percent);
        if mark == 0 || mark >= 100 {
            // 100% is logged by `finish`.
            return;
        }
        if self.logged.fetch_max(mark, Ordering::Relaxed) < mark {
            // The line shows the exact share done, not the mark that triggered it.
            let pct = percent_mark(self.position(), self.total(), 1);
            tracing::info!("{}", self.status_line(Some(pct)));
        }
    }

    /// Ends the phase with a final message, at the current position (a phase cut short does not
    /// show 100%): the bar stays on screen with it (Bar), a last line is logged (Log), nothing
    /// (Silent).
    pub fn finish(&self, msg: impl Into<String>) {
        let msg = msg.into();
        match self.mode {
            ProgressMode::Bar => self.bar.abandon_with_message(msg),
            ProgressMode::Log { .. } => {
                self.bar.set_message(msg);
                self.bar.abandon();
                tracing::info!("{}", self.status_line(None));
            }
            ProgressMode::Silent => self.bar.abandon(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Runs `f` with a tracing subscriber that captures `info` lines, and returns them.
    fn captured(f: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .without_time()
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn log_mode_logs_every_n_percent_with_eta_and_message() {
        let lines = captured(|| {
            let p = Progress::with_mode("rl", 40, ProgressMode::Log { every_percent: 25 });
            for i in 0..40 {
                p.set_message(format!("loss {:.2}", 1.0 / (i + 1) as f64));
                p.inc(1);
            }
            p.println("an extra line");
            p.finish("all steps");
        });
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert!(lines[0].contains("rl: 10/40 (25%)"), "{}", lines[0]);
        assert!(lines[0].contains("ETA "), "{}", lines[0]);
        assert!(lines[0].contains("loss 0.10"), "{}", lines[0]);
        assert!(lines[1].contains("rl: 20/40 (50%)"));
        assert!(lines[2].contains("rl: 30/40 (75%)"));
        assert!(lines[3].contains("an extra line"));
        assert!(lines[4].contains("rl: 40/40 done, ") && lines[4].ends_with(", all steps"));
        assert!(!lines[4].contains("ETA"));
    }

    #[test]
    fn jumps_log_once_and_silent_mode_prints_nothing() {
        let lines = captured(|| {
            let p = Progress::with_mode("eval", 7, ProgressMode::Log { every_percent: 10 });
            p.set_position(5); // 71%: one line, not seven
            p.set_position(5);
            p.inc(1); // 85%
            assert_eq!(p.position(), 6);
            assert_eq!(p.total(), 7);
            let q = Progress::with_mode("quiet", 10, ProgressMode::Silent);
            q.inc(10);
            q.println("hidden");
            q.finish("hidden");
            tracing::info!("the caller's own log");
        });
        assert_eq!(lines.len(), 3, "{lines:#?}");
        // The exact share done, not the 10 % mark that triggered the line.
        assert!(lines[0].contains("eval: 5/7 (71%)"), "{}", lines[0]);
        assert!(lines[1].contains("eval: 6/7 (85%)"), "{}", lines[1]);
        assert!(lines[2].contains("the caller's own log"));
    }

    #[test]
    fn bar_mode_and_detection_do_not_panic() {
        assert_eq!(ProgressMode::detect(true), ProgressMode::Silent);
        // Under the test harness stderr is not a terminal in CI; either answer is fine here.
        assert_ne!(ProgressMode::detect(false), ProgressMode::Silent);
        let p = Progress::with_mode("sft", 3, ProgressMode::Bar);
        p.inc(2);
        p.set_message("loss 0.5");
        let r = p.suspend(|| 7);
        assert_eq!(r, 7);
        p.finish("done");
        assert_eq!(p.position(), 2);
        let zero = Progress::with_mode("empty", 0, ProgressMode::Log { every_percent: 10 });
        zero.inc(1);
        zero.finish("");
    }

    #[test]
    fn marks_and_clock() {
        assert_eq!(percent_mark(0, 10, 10), 0);
        assert_eq!(percent_mark(9, 10, 25), 75);
        assert_eq!(percent_mark(20, 10, 10), 100);
        assert_eq!(percent_mark(1, 0, 10), 0);
        assert_eq!(percent_mark(u64::MAX, u64::MAX, 0), 100);
        assert_eq!(clock(Duration::from_secs(125)), "2:05");
        assert_eq!(clock(Duration::from_secs(3723)), "1:02:03");
    }
}

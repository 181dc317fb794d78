//! `lightfoot __watch PARENT mounts|filesystems [MAX_CACHE]`: the watcher process that
//! `lightfoot run` starts as root (src/run/watch/ says what it does). Its stdout is how it
//! talks to `lightfoot run`: a first line once its marks are in place (or why it could not
//! start), then the report when its stdin is closed (CMD has ended).
//!
//! Hidden from `--help` and the completions as `__generate` is, and for the same reason: see
//! generate.rs.

use std::ffi::OsString;
use std::io::Write;

use clap::Parser;

use lightfoot::run::watch::{Marks, Watch, FAILED, READY};

/// The first argument that selects this command.
pub use lightfoot::run::watch::COMMAND;

/// The watcher of `lightfoot run` (started by it, not by hand).
#[derive(Parser)]
#[command(name = "lightfoot __watch", bin_name = "lightfoot __watch")]
struct WatchArgs {
    /// The pid of `lightfoot run`, whose process tree is watched.
    parent: u32,

    /// What to mark: `lightfoot run`'s mounts (it has a mount namespace of its own), or whole
    /// file systems.
    #[arg(value_parser = super::parse_enum::<Marks>)]
    marks: Marks,

    /// --max-cache, in bytes.
    max_cache: Option<u64>,
}

/// Runs `lightfoot __watch …`; `args` are the process's arguments after the program name,
/// [`COMMAND`] first.
pub fn run(args: impl IntoIterator<Item = OsString>) -> i32 {
    // COMMAND stands where clap expects the program name; bin_name above is what it prints.
    let a = WatchArgs::parse_from(args);
    let mut out = std::io::stdout();
    let watch = match Watch::start(a.parent, a.marks, a.max_cache.is_some()) {
        Ok(w) => w,
        Err(e) => {
            let _ = writeln!(out, "{FAILED}{e}");
            return 1;
        }
    };
    let _ = writeln!(out, "{READY}{}", serde_json::to_string(watch.filesystems()).unwrap_or_default());
    let _ = out.flush();
    // CMD's end: `lightfoot run` closes our stdin (or dies, which closes it too).
    let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
    let outcome = watch.finish();
    let _ = writeln!(out, "{}", serde_json::to_string(&outcome).unwrap_or_default());
    0
}

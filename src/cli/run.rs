//! `lightfoot run [OPTIONS] -- CMD [ARGS…]`: runs CMD so that the page cache holds what it held
//! before once CMD ends (src/run says how; docs/run.md what it covers).

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use clap::Args;

use super::human::bytes as human;
use lightfoot::error::io_message;
use lightfoot::io::sys;
use lightfoot::run::watch::Watcher;
use lightfoot::run::{self, FileReport};

/// lightfoot's own failure (not CMD's), as `env` and `timeout` report it.
const EXIT_OWN_FAILURE: i32 = 125;
const EXIT_NOT_EXECUTABLE: i32 = 126;
const EXIT_NOT_FOUND: i32 = 127;

#[derive(Args, Debug)]
#[command(
    about = "Run a command so that it leaves the page cache as it found it",
    long_about = "Run CMD with its arguments so that when it ends the page cache holds what it held \
before: pages of files that were cached before CMD first touched them stay cached, pages its reads \
and writes brought in are dropped, while it runs (behind each read, at each close) and at the end. \
CMD's output, exit status and errors are its own.\n\n\
How: a preload library (liblightfoot_preload.so, found beside this binary or in ../lib/lightfoot/ \
from it; LIGHTFOOT_PRELOAD overrides) is added to LD_PRELOAD for CMD and every program it starts. \
It records which 2 MiB blocks of each regular file held pages when the program first read or \
wrote it, drops the others behind the program, and leaves records that a final sweep uses when CMD \
ends: dirty pages are written back and every block that held no page before is dropped. Pipes, \
sockets, terminals and O_DIRECT files are left alone.\n\n\
The watcher (root; --watch): what the library cannot see, statically linked and Go programs \
(restic), mmap, io_uring, programs that clear their environment. A process of lightfoot's own, in \
a process group of its own, watches the mounts that have a page cache (fanotify): an open by \
CMD's process tree waits until the file's first sight is taken; while CMD runs, the blocks it \
brought in are dropped behind each descriptor's position and written back when dirty; at the \
end every file is written back and dropped to its first sight. CMD (with lightfoot run) gets a mount \
namespace of its own, a copy of the caller's, whose mounts are the ones watched: the rest of the \
host's opens never wait for the watcher; CMD's each wait about 45 µs here (--watch never leaves \
the watcher out).\n\n\
Not covered without root (docs/run.md): programs that make their own system calls, mmap and \
io_uring I/O, programs that clear their environment, setuid programs. Files the user may not \
write (their residency is not visible) are reported as not covered.",
    after_long_help = "Exit status: CMD's own; 128+N if CMD was killed by signal N; 125 lightfoot's own \
failure; 126 CMD not executable; 127 CMD not found. Signals sent to lightfoot (TERM, INT, HUP, QUIT, \
USR1, USR2) are passed on to CMD; a terminal's Ctrl-C reaches CMD directly.\n\n\
Examples:\n  lightfoot run -- tar cf /backup/home.tar /home\n  lightfoot run -v -- rsync -a /srv/ /mnt/backup/srv/\n  lightfoot run --json -- sh -c 'cat big.img | gzip > big.img.gz'\n\nSee docs/run.md; every error: docs/errors.md."
)]
pub struct RunArgs {
    /// After CMD ends, print each file it read or wrote on stderr: cached before, after, and how
    /// it was covered (-vv: also debug messages)
    #[arg(short, long, action = clap::ArgAction::Count)]
    verbose: u8,

    /// After CMD ends, print a JSON summary on stderr (stdout is CMD's): the files, their page
    /// cache before and after, the bytes moved and evicted, CMD's exit status
    #[arg(long)]
    json: bool,

    /// Whether to start the watcher, which covers what the preload library cannot see
    /// (static and Go programs, mmap, io_uring): auto (when root), always (fail without root),
    /// never
    #[arg(long, value_enum, value_name = "WHEN", default_value = "auto")]
    watch: Watch,

    /// Bound what CMD holds in the page cache beyond each stream's own block and readahead:
    /// write-behind's blocks not yet waited for, across every process of the run (the library
    /// waits for its oldest when more are pending); the watcher waits for the writeback of
    /// dirty blocks behind each stream and drops clean ones at once. 0: every block a writer
    /// leaves is waited for then. Default: up to 8 MiB per writer
    #[arg(long, value_name = "SIZE", value_parser = lightfoot::copy::endpoint::parse_size)]
    max_cache: Option<u64>,

    /// The command and its arguments (after `--`)
    #[arg(value_name = "CMD", required = true, trailing_var_arg = true, allow_hyphen_values = true, num_args = 1..)]
    command: Vec<OsString>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Watch {
    Auto,
    Always,
    Never,
}

/// Why the watcher is off without root, and what that leaves out.
const NOT_ROOT: &str = "off: it needs root (fanotify); statically linked programs, Go programs \
(restic), mmap and io_uring I/O, programs that clear their environment and setuid programs are not covered";

pub fn run(a: RunArgs) -> i32 {
    super::init_logging(a.verbose);
    let fail = |msg: String| {
        eprintln!("lightfoot run: {msg}");
        EXIT_OWN_FAILURE
    };
    let lib = match run::find_preload() {
        Ok(p) => p,
        Err(e) => return fail(e.to_string()),
    };
    if lib.as_os_str().as_encoded_bytes().iter().any(|&b| b == b':' || b == b' ') {
        return fail(format!(
            "{}: LD_PRELOAD cannot name a path with ':' or a space (set LIGHTFOOT_PRELOAD to a copy elsewhere)",
            lib.display()
        ));
    }
    let dir = match run::make_run_dir() {
        Ok(d) => d,
        Err(e) => return fail(e.to_string()),
    };
    let code = run_in(&a, &lib, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    code
}

fn run_in(a: &RunArgs, lib: &std::path::Path, dir: &std::path::Path) -> i32 {
    // Before any thread: the forwarder below is the only one that takes these signals.
    if let Err(e) = sys::block_forwarded() {
        eprintln!("lightfoot run: signals: {}", io_message(&e));
        return EXIT_OWN_FAILURE;
    }
    let mut preload = OsString::new();
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        // The user's preloads first: ours chains to them through RTLD_NEXT.
        preload.push(old);
        preload.push(":");
    }
    preload.push(lib);
    let watcher = match (a.watch, sys::euid() == 0) {
        (Watch::Never, _) => Err("off (--watch never)".to_string()),
        (Watch::Auto, false) => Err(NOT_ROOT.to_string()),
        (Watch::Always, false) => {
            eprintln!("lightfoot run: --watch always, but the watcher is {NOT_ROOT}");
            return EXIT_OWN_FAILURE;
        }
        // CMD (with this process) in a mount namespace of its own, a copy of this one: the
        // watcher marks its mounts, so only the opens made in it wait for the watcher, not
        // the rest of the host's. Before any thread (unshare refuses a threaded process).
        (_, true) => match Watcher::start(a.max_cache, sys::unshare_mounts().is_ok())
            .map_err(|e| e.to_string())
            .and_then(|w| {
                sys::become_subreaper()
                    .map_err(|e| format!("cannot become the subreaper of CMD's tree: {}", io_message(&e)))?;
                Ok(w)
            }) {
            Ok(w) => Ok(w),
            Err(e) if a.watch == Watch::Always => {
                eprintln!("lightfoot run: the watcher: {e}");
                return EXIT_OWN_FAILURE;
            }
            Err(e) => {
                eprintln!(
                    "lightfoot run: the watcher could not start ({e}): only the preload library covers CMD"
                );
                Err(format!("off: {e}"))
            }
        },
    };
    let cmd = &a.command;
    let mut command = Command::new(&cmd[0]);
    command.args(&cmd[1..]).env("LD_PRELOAD", &preload).env("LIGHTFOOT_RUN_DIR", dir);
    if let Some(max) = a.max_cache {
        // The run's count of write-behind's pending blocks, mapped by every process of it.
        let pending = dir.join("pending");
        if let Err(e) = std::fs::File::create(&pending).and_then(|f| f.set_len(4096)) {
            eprintln!("lightfoot run: create {}: {}", pending.display(), io_message(&e));
            return EXIT_OWN_FAILURE;
        }
        command.env("LIGHTFOOT_MAX_CACHE", max.to_string());
    }
    sys::unblock_forwarded_on_exec(&mut command);
    let child = command.spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            if let Ok(w) = watcher {
                let _ = w.finish(false);
            }
            let name = cmd[0].to_string_lossy();
            return match e.kind() {
                std::io::ErrorKind::NotFound => {
                    eprintln!("lightfoot run: {name}: command not found");
                    EXIT_NOT_FOUND
                }
                std::io::ErrorKind::PermissionDenied => {
                    eprintln!("lightfoot run: {name}: not executable: {}", io_message(&e));
                    EXIT_NOT_EXECUTABLE
                }
                _ => {
                    eprintln!("lightfoot run: {name}: cannot start: {}", io_message(&e));
                    EXIT_NOT_EXECUTABLE
                }
            };
        }
    };
    let pid = Arc::new(AtomicU32::new(child.id()));
    let done = Arc::new(AtomicBool::new(false));
    {
        let (pid, done) = (pid.clone(), done.clone());
        std::thread::spawn(move || loop {
            let (sig, from_a_process) = sys::next_forwarded();
            // A terminal's signal already reached CMD (same process group); once CMD is reaped
            // its pid may be another process's.
            if from_a_process && !done.load(Ordering::Acquire) {
                let _ = sys::send_signal(pid.load(Ordering::Relaxed), sig);
            }
        });
    }
    // With the watcher, this process is the subreaper of CMD's tree: orphans are reaped as
    // they end, and the watcher (a child too) may end first if it fails.
    let mut watcher_reaped = false;
    let status = match &watcher {
        Ok(w) => loop {
            match sys::wait_any_child() {
                Ok((p, st)) if p == child.id() => break Ok(st),
                Ok((p, _)) => watcher_reaped |= p == w.pid(),
                Err(e) => break Err(e),
            }
        },
        Err(_) => child.wait(),
    };
    done.store(true, Ordering::Release);
    let status = match status {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lightfoot run: waiting for {}: {}", cmd[0].to_string_lossy(), io_message(&e));
            return EXIT_OWN_FAILURE;
        }
    };
    let code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let (watched, watch_state) = match watcher {
        Ok(w) => match w.finish(watcher_reaped) {
            Ok(o) => {
                let state = serde_json::json!({ "on": true, "filesystems": o.filesystems, "notes": o.notes });
                (o.files, state)
            }
            Err(e) => {
                eprintln!("lightfoot run: {e}");
                (Vec::new(), serde_json::json!({ "on": false, "why": e.to_string() }))
            }
        },
        Err(why) => (Vec::new(), serde_json::json!({ "on": false, "why": why })),
    };
    sys::reap_ended_children();
    let files = match run::sweep(dir, watched) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("lightfoot run: the final sweep failed: {e}");
            return if code == 0 { EXIT_OWN_FAILURE } else { code };
        }
    };
    for f in files.iter().filter(|f| f.note.is_some()) {
        eprintln!("lightfoot run: {}: {}", f.path.display(), f.note.as_deref().unwrap_or_default());
    }
    if a.verbose > 0 {
        match watch_state["on"].as_bool() {
            Some(true) => {
                eprintln!("lightfoot run: watcher: on, file systems {}", watch_state["filesystems"]);
                for n in watch_state["notes"].as_array().into_iter().flatten() {
                    eprintln!("lightfoot run: watcher: {}", n.as_str().unwrap_or_default());
                }
            }
            _ => eprintln!("lightfoot run: watcher: {}", watch_state["why"].as_str().unwrap_or_default()),
        }
        for f in &files {
            print_file(f);
        }
    }
    if a.json {
        let v = serde_json::json!({ "exit_status": code, "watcher": watch_state, "files": files });
        eprintln!("{v}");
    }
    code
}

fn print_file(f: &FileReport) {
    let after = f.cached_after.map_or_else(|| "unknown".to_string(), human);
    let moved = match (f.bytes_read, f.bytes_written) {
        (Some(r), Some(w)) if r + w > 0 => format!("; read {}, wrote {}", human(r), human(w)),
        _ => String::new(),
    };
    let evicted = f.evicted.map_or_else(String::new, |e| format!(", {} evicted", human(e)));
    eprintln!(
        "lightfoot run: {}: cached {} before, {} after{evicted}{}{moved}; {}",
        f.path.display(),
        human(f.cached_before),
        after,
        if f.written { " (written)" } else { "" },
        f.mechanism
    );
}

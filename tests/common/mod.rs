//! Helpers shared by the integration tests of the binary.
#![allow(dead_code)]

pub mod certs;
pub mod s3;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Output, Stdio};

use lightfoot::io::residency;

pub const MIB: u64 = 1 << 20;

/// Polls `f` until it holds or `timeout` has passed; whether it held. The one place where the
/// tests wait by the clock for something to happen: every wait on a condition (a file to
/// appear, a process to end, a server to listen, a counter to move) goes through here, through
/// [`within`] or [`wait_until`], and the few sleeps left in the tests are workloads' lengths
/// and paces, each saying why no condition would do. Looks every 5 ms at first, backing off to
/// every 100 ms: a condition that comes quickly is seen at once, and one that is costly to
/// check (a spawned `ss`) is not checked hundreds of times.
pub fn poll(timeout: std::time::Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    let mut pause = std::time::Duration::from_millis(5);
    while std::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(100));
    }
    f()
}

/// [`poll`] for up to `secs` seconds.
pub fn within(secs: u64, f: impl FnMut() -> bool) -> bool {
    poll(std::time::Duration::from_secs(secs), f)
}

/// Waits until `f` holds; fails the test, naming `what` (what was waited for), if it does not
/// within `timeout`.
#[track_caller]
pub fn wait_until(what: &str, timeout: std::time::Duration, f: impl FnMut() -> bool) {
    assert!(poll(timeout, f), "timed out after {timeout:?} waiting for {what}");
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_lightfoot")
}

/// Runs lightfoot to completion, under `timeout 300` (a hang fails the test with status 124).
pub fn lightfoot(args: &[&str]) -> Output {
    Command::new("timeout")
        .args(["-k", "10", "300"])
        .arg(bin())
        .args(args)
        .output()
        .expect("run lightfoot under timeout")
}

pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Asserts that a command succeeded; its output.
#[track_caller]
pub fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}", text(&out));
    text(&out)
}

/// Asserts that a command failed with exit status 1 and a message holding each of `words`.
#[track_caller]
pub fn fails_with(out: &Output, words: &[&str]) {
    assert_eq!(out.status.code(), Some(1), "expected exit 1: {}", text(out));
    let t = text(out);
    for w in words {
        assert!(t.contains(w), "message lacks '{w}': {t}");
    }
}

/// Asserts that `name` is installed (`make test` installs Debian's `package`).
pub fn need(name: &str, package: &str) {
    let found = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    assert!(found.status.success(), "{name} is missing: `make test` installs it (Debian package {package})");
}

/// A client tool to run to completion (`output()`, `status()`), under `timeout 300` like
/// [`libnbd`]. A program that must run on and be killed is spawned without it ([`need`]
/// first): killing `timeout` would leave its child running.
pub fn tool(name: &str, package: &str) -> Command {
    need(name, package);
    let mut c = Command::new("timeout");
    c.args(["-k", "10", "300", name]);
    c
}

/// Runs a Python script with libnbd's module (the system interpreter's: Debian's
/// python3-libnbd), `$URI` set to `uri`. Under `timeout 300`: a client left waiting for a
/// reply fails its test (status 124) instead of holding CI until its limit.
pub fn libnbd(script: &str, uri: &str) -> Output {
    libnbd_within(300, script, uri)
}

/// [`libnbd`] under `timeout SECS`.
pub fn libnbd_within(secs: u64, script: &str, uri: &str) -> Output {
    libnbd_command(secs, script, uri).output().expect("run timeout and /usr/bin/python3")
}

/// The command [`libnbd_within`] runs, for a client to spawn and talk to through pipes.
pub fn libnbd_command(secs: u64, script: &str, uri: &str) -> Command {
    let probe = Command::new("/usr/bin/python3").args(["-c", "import nbd"]).output();
    assert!(
        probe.map(|o| o.status.success()).unwrap_or(false),
        "python3-libnbd is missing: `make test` installs it"
    );
    let mut c = Command::new("timeout");
    c.args(["-k", "10", &secs.to_string(), "/usr/bin/python3", "-c", script]).env("URI", uri);
    c
}

/// Spawns `cmd` with pipes to its stdin, stdout and stderr and waits for the first line it
/// prints: a client that says how far it got, then waits on its stdin to go on. Returns the
/// child (stdin open, stdout taken), the rest of its stdout, and that line (empty if it ended
/// first).
pub fn spawn_until_line(cmd: &mut Command) -> (Child, BufReader<ChildStdout>, String) {
    let mut child =
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    (child, stdout, line)
}

/// Skips the running test, or the part of it named in `reason` that cannot run here: says so
/// on stderr (`SKIPPED copy::full_disk_...: needs root to mount a small tmpfs`) and appends
/// the same line, without `SKIPPED`, to the file `$LIGHTFOOT_SKIP_LOG` names. `make test` sets
/// it (a file under target/, emptied first) and ends with the count and the lines, so a skip
/// never passes for a pass. The caller returns (or goes on without the part). Every skip of the
/// tests goes through here: [`root_or_skip`] and [`tool_or_skip`] for root and tools, and the
/// callers themselves for a kernel feature that is absent.
pub fn skip(reason: &str) {
    use std::io::Write;
    // The harness runs each test on a thread named after it.
    let test = std::thread::current().name().filter(|n| *n != "main").unwrap_or("?").to_string();
    let line = format!("{}::{test}: {reason}", env!("CARGO_CRATE_NAME"));
    eprintln!("SKIPPED {line}");
    if let Some(log) = std::env::var_os("LIGHTFOOT_SKIP_LOG") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("LIGHTFOOT_SKIP_LOG={}: {e}", Path::new(&log).display()));
        // One write of the whole line: O_APPEND keeps the lines of test binaries and threads
        // writing at once whole.
        f.write_all(format!("{line}\n").as_bytes()).expect("write to LIGHTFOOT_SKIP_LOG");
    }
}

/// True as root. Otherwise skips ([`skip`]) with `why`, what the test needs root for
/// ("needs root to mount a small tmpfs"), and is false: the caller returns, or goes on without
/// the part that needs root. As root nothing is skipped: whatever else a root-only test needs
/// is asserted, so a precondition missing as root fails the test instead of passing it by.
pub fn root_or_skip(why: &str) -> bool {
    if euid() == 0 {
        return true;
    }
    skip(why);
    false
}

/// True when `name` is on PATH. Otherwise as root it fails the test: `make test` installs
/// every tool the tests use (Debian package `package`) as root, so a tool missing then is a
/// set-up gone wrong, not something to pass by. Without root it skips ([`skip`], saying which
/// tool and package) and is false: the caller returns.
#[track_caller]
pub fn tool_or_skip(name: &str, package: &str) -> bool {
    let found = Command::new("sh").arg("-c").arg(format!("command -v {name}")).output().unwrap();
    if found.status.success() {
        return true;
    }
    let why = format!("{name} is missing (Debian package {package}; scripts/install-deps.sh installs it)");
    assert!(euid() != 0, "{why}: as root `make test` installs it, so it is not skipped");
    skip(&why);
    false
}

pub fn euid() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// The threads of process `pid` named `name` (their /proc/PID/task/TID directories).
pub fn threads_named(pid: u32, name: &str) -> Vec<PathBuf> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return vec![] };
    tasks
        .flatten()
        .map(|t| t.path())
        .filter(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim_end() == name))
        .collect()
}

/// Where the blocked thread or process `task` (a /proc/PID or /proc/PID/task/TID directory)
/// waits: its system call's number and first argument (`202 0x55d0c8a0` for a futex, `0 0x3`
/// for a read of descriptor 3); `None` while it runs, or where /proc does not say (it takes
/// ptrace's permission: root, or a descendant of this process).
pub fn waiting_in(task: &Path) -> Option<String> {
    let call = std::fs::read_to_string(task.join("syscall")).ok()?;
    let mut fields = call.split_whitespace();
    let (nr, arg) = (fields.next()?, fields.next()?);
    (nr != "running" && nr != "-1").then(|| format!("{nr} {arg}"))
}

/// The kernel function the process `pid` sleeps in (/proc/PID/wchan: `wait_for_partner` for
/// an open of a FIFO waiting for its other end); empty while it runs.
pub fn wchan(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default()
}

/// How often `task` has given up the CPU to wait (`voluntary_ctxt_switches`).
fn voluntary_switches(task: &Path) -> u64 {
    let status = std::fs::read_to_string(task.join("status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Sends signal `sig` (`INT`, `TERM`) to the lightfoot process `pid` and waits until its
/// handler has run: the copy has set its cancel flag, the server has begun its shutdown.
/// lightfoot takes these signals through the ctrlc crate, whose thread (`ctrl-c`) waits for
/// one, runs the handler and waits again; the signal's own handler only wakes it. So: first
/// wait for that thread to wait (the handler is in place: a signal sent earlier would kill
/// the process), then signal, then wait for the thread to be back where it waited, having
/// waited again since (its count of waits went up).
#[track_caller]
pub fn signal_handled(pid: u32, sig: &str) {
    let ten = std::time::Duration::from_secs(10);
    let mut waiting = None;
    wait_until(&format!("lightfoot {pid} to have its signal handler thread waiting"), ten, || {
        waiting = threads_named(pid, "ctrl-c")
            .pop()
            .and_then(|t| Some((waiting_in(&t)?, voluntary_switches(&t), t)));
        waiting.is_some()
    });
    let (at, waits, task) = waiting.unwrap();
    let st = Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
    wait_until(&format!("lightfoot {pid} to run its SIG{sig} handler"), ten, || {
        voluntary_switches(&task) > waits && waiting_in(&task).as_deref() == Some(at.as_str())
    });
}

/// A scratch directory on the same filesystem as the build (ext4 here), readable by all.
pub fn scratch() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = tempfile::tempdir_in(base).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

/// Writes a sample: `size` bytes, data in alternate `piece`s (pseudo-random), holes between,
/// plus one allocated all-zero piece. Evicted from the cache afterwards.
pub fn sample(path: &Path, size: u64, piece: u64) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut rng = lightfoot::testing::conformance::Rng::new(size ^ piece);
    let mut buf = vec![0u8; piece as usize];
    let mut at = 0;
    let mut i = 0;
    while at < size {
        let n = piece.min(size - at) as usize;
        if i % 2 == 0 {
            rng.fill(&mut buf[..n]);
            if i == 2 {
                buf[..n].fill(0);
            }
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&buf[..n]).unwrap();
        }
        at += n as u64;
        i += 1;
    }
    f.sync_all().unwrap();
    evict(path);
}

/// Writes `size` bytes of pseudo-random data (no holes, no zero blocks).
pub fn random_file(path: &Path, size: u64) {
    let mut buf = vec![0u8; size as usize];
    lightfoot::testing::conformance::Rng::new(size).fill(&mut buf);
    std::fs::write(path, buf).unwrap();
}

/// Writes back and drops every page of `path`, and asserts none is left. Readahead that a
/// reader which just ended started can still be in flight: its pages are locked while the read
/// runs and a drop skips them (a clean-clone run once found 8 MiB left after a 40 MB reader),
/// so the drop is repeated while pages are left (at [`poll`]'s pace), for up to 2 s, as the
/// sweep of `lightfoot run` does.
pub fn evict(path: &Path) {
    let f = residency::open(path).unwrap();
    poll(std::time::Duration::from_secs(2), || {
        residency::evict(&f, path, 0, None, true).unwrap();
        cached(path, 0, None) == 0
    });
    assert_eq!(cached(path, 0, None), 0, "could not evict {}", path.display());
}

/// Bytes of `[off, off+len)` in the page cache.
pub fn cached(path: &Path, off: u64, len: Option<u64>) -> u64 {
    let f = residency::open(path).unwrap();
    residency::measure(&f, path, off, len).unwrap().cached_bytes()
}

/// Brings exactly `[off, off+len)` into the cache: buffered reads with readahead off, so
/// nothing past the range is loaded.
/// Asserts that a working set of `want` bytes kept `kept` of them in the page cache, but for
/// a few pages: on these VMs a background DAMON job pages out file cache it judges cold,
/// sometimes seconds after a read (../shared/KERNEL-NOTES.md), and clean-clone runs lost 2 and
/// 4 pages of 16 and 8 MiB working sets that way while nothing in the job touched them. The
/// job's own evictions go by 2 MiB blocks or whole writes, far beyond the 1/256 allowed.
#[track_caller]
pub fn assert_kept(kept: u64, want: u64, what: &str) {
    assert!(kept <= want, "{what}: more cached than the working set ({kept} > {want})");
    assert!(lost_few(kept, want), "{what}: working set lost {} bytes of {want}", want - kept);
}

/// Whether `kept` of a `want`-byte working set is all but the few pages [`assert_kept`]
/// allows the host's reclaim to take.
pub fn lost_few(kept: u64, want: u64) -> bool {
    want.saturating_sub(kept) <= want / 256
}

/// A control for a working set: a file warmed next to it that the job under test never
/// touches. The background reclaim of these VMs (see [`assert_kept`]) takes pages from both
/// alike; the job's own evictions only from the working set. A working set that lost pages
/// while its control lost some too says nothing about the job: run it again.
pub struct Control {
    path: PathBuf,
    len: u64,
}

/// How a [`Control`] is read before the job: as its working set is.
#[derive(Clone, Copy)]
pub enum Warmth {
    /// Warmed as [`warm`] does (twice: active pages).
    Warm,
    /// Read once, as cold to the host's reclaim as pages another program read once.
    ReadOnce,
}

impl Control {
    /// Writes a `len`-byte file named `name` in `dir` and reads it as `warmth` says.
    pub fn new(dir: &Path, name: &str, len: u64, warmth: Warmth) -> Control {
        let path = dir.join(name);
        random_file(&path, len);
        evict(&path);
        match warmth {
            Warmth::Warm => warm(&path, 0, len),
            Warmth::ReadOnce => drop(std::fs::read(&path).unwrap()),
        }
        Control { path, len }
    }

    /// Whether the control kept all but the few pages [`assert_kept`] allows.
    pub fn intact(&self) -> bool {
        lost_few(cached(&self.path, 0, None), self.len)
    }
}

/// Runs `job` up to three times and returns the bytes of its working set still cached (what
/// `job` returns: it warms the working set, runs the command under test and measures). It runs
/// again only when the working set lost more than [`lost_few`] allows *and* a control file
/// warmed beside it, which the command never touches, lost pages too: the host's reclaim of
/// idle cache (KERNEL-NOTES), not the command. A working set that alone lost pages is returned
/// at once, for the caller's [`assert_kept`] to fail.
pub fn kept_despite_host_reclaim(dir: &Path, want: u64, what: &str, mut job: impl FnMut() -> u64) -> u64 {
    despite_host_reclaim(dir, Warmth::Warm, what, || (job(), want)).0
}

/// [`kept_despite_host_reclaim`] for a working set whose size the job learns: `job` returns
/// the bytes kept and the bytes there were; the control is read as `warmth` says.
pub fn despite_host_reclaim(
    dir: &Path,
    warmth: Warmth,
    what: &str,
    mut job: impl FnMut() -> (u64, u64),
) -> (u64, u64) {
    for attempt in 1.. {
        let control = Control::new(dir, "control", 4 * MIB, warmth);
        let (kept, want) = job();
        if lost_few(kept, want) || control.intact() || attempt == 3 {
            return (kept, want);
        }
        eprintln!("{what}: the control lost pages too (host reclaim): again");
    }
    unreachable!()
}

pub fn warm(path: &Path, off: u64, len: u64) {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    lightfoot::io::sys::fadvise(f.as_fd(), 0, 0, lightfoot::io::sys::Advice::Random).unwrap();
    let mut buf = vec![0u8; MIB as usize];
    // Twice, as a working set is used: the second pass makes the pages active, so the host's
    // own reclaim of idle cache (these machines run one in the background) takes other pages
    // first. Read once, 3 of 16 MiB once went missing during a full `make test` while the copy
    // under test read elsewhere; alone, the test passed 5 of 5.
    for _ in 0..2 {
        let mut at = off;
        while at < off + len {
            let n = MIB.min(off + len - at) as usize;
            f.read_exact_at(&mut buf[..n], at).unwrap();
            at += n as u64;
        }
    }
}

pub fn same_contents(a: &Path, b: &Path) -> bool {
    // Compared through O_DIRECT-free plain reads after the measurements: callers check the
    // cache before calling this.
    std::fs::read(a).unwrap() == std::fs::read(b).unwrap()
}

/// Allocated bytes of a file (st_blocks × 512).
pub fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// A filesystem mounted (as root) on a new directory `name` in `dir` with `mount ARGS... DIR`;
/// unmounted on drop, so a test that fails halfway leaves no mount behind.
pub struct Mount {
    pub path: PathBuf,
}

impl Mount {
    pub fn new<S: AsRef<std::ffi::OsStr>>(dir: &Path, name: &str, args: &[S]) -> Mount {
        let path = dir.join(name);
        std::fs::create_dir(&path).unwrap();
        let st = Command::new("mount").args(args).arg(&path).status().expect("run mount");
        assert!(
            st.success(),
            "mount {:?} {}",
            args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
            path.display()
        );
        Mount { path }
    }

    /// A new filesystem made by `mkfs ARGS...` on an image file of `size` bytes in `dir`,
    /// mounted through a loop device on `dir/name`.
    pub fn made(dir: &Path, name: &str, size: u64, mkfs: &[&str]) -> Mount {
        let image = dir.join(format!("{name}.img"));
        std::fs::File::create(&image).unwrap().set_len(size).unwrap();
        let out = Command::new(mkfs[0]).args(&mkfs[1..]).arg(&image).output().expect("run mkfs");
        assert!(out.status.success(), "{mkfs:?}: {}", text(&out));
        Mount::new(dir, name, &["-o", "loop", image.to_str().unwrap()])
    }
}

impl Drop for Mount {
    /// Unmounts, waiting up to 2 s while it is busy (a loop device over a file in it detaches
    /// a moment after its own file system is unmounted), then lazily: a test never leaves a
    /// mount behind.
    fn drop(&mut self) {
        let unmounted = poll(std::time::Duration::from_secs(2), || {
            let out = Command::new("umount").arg(&self.path).stderr(Stdio::null()).status();
            out.is_ok_and(|s| s.success())
        });
        if !unmounted {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

/// A loop device over a new file of `size` bytes; detached on drop.
pub struct Loop {
    pub dev: String,
    _dir: tempfile::TempDir,
}

impl Loop {
    pub fn new(size: u64) -> Loop {
        let dir = scratch();
        let img = dir.path().join("loop.img");
        std::fs::File::create(&img).unwrap().set_len(size).unwrap();
        let out = Command::new("losetup").args(["-f", "--show"]).arg(&img).output().expect("run losetup");
        assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
        Loop { dev: String::from_utf8(out.stdout).unwrap().trim().to_string(), _dir: dir }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

/// A `lightfoot serve` of one file on a Unix socket beside it, killed if the test ends early.
pub struct Served {
    pub child: std::process::Child,
    pub sock: PathBuf,
}

impl Served {
    /// Starts `lightfoot serve --unix FILE.sock EXTRA... FILE` and waits for its socket.
    pub fn start(file: &Path, extra: &[&str]) -> Served {
        Self::start_with_env(file, extra, &[])
    }

    /// `start`, with these environment variables set for the server.
    pub fn start_with_env(file: &Path, extra: &[&str], env: &[(&str, &str)]) -> Served {
        let sock = file.with_extension("sock");
        let child = Command::new(bin())
            .args(["serve", "--unix"])
            .arg(&sock)
            .args(extra)
            .arg(file)
            .envs(env.iter().copied())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        assert!(within(10, || sock.exists()), "server did not create {}", sock.display());
        Served { child, sock }
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    /// SIGTERM (a clean shutdown); returns the exit status and stderr.
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (self.child.wait().unwrap(), err)
    }

    /// SIGKILL: whatever the server held and had not flushed is lost.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A server running in this process on a Unix socket in a scratch directory, over whatever
/// backend `open` returns per connection (see `Export::new`); shut down when dropped.
pub struct InProcess {
    pub server: std::sync::Arc<lightfoot::server::Server>,
    pub sock: PathBuf,
    handle: Option<std::thread::JoinHandle<lightfoot::Result<()>>>,
    _dir: tempfile::TempDir,
}

impl InProcess {
    /// `tune` may change the server's settings before it starts (threads are 4, connections
    /// 16).
    pub fn start(
        open: impl Fn() -> lightfoot::Result<std::sync::Arc<dyn lightfoot::backend::Backend>>
            + Send
            + Sync
            + 'static,
        tune: impl FnOnce(&mut lightfoot::server::Server),
    ) -> InProcess {
        let dir = scratch();
        let sock = dir.path().join("s");
        let export = lightfoot::server::Export::new("", None, true, open).unwrap();
        let mut server = lightfoot::server::Server::new(export, 4, 16);
        tune(&mut server);
        let server = std::sync::Arc::new(server);
        let listener = lightfoot::server::Listener::unix(&sock).unwrap();
        let s = server.clone();
        let handle = Some(std::thread::spawn(move || s.serve(&listener)));
        InProcess { server, sock, handle, _dir: dir }
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    /// Shuts the server down (its final flush included) and returns how that went.
    pub fn stop(mut self) -> lightfoot::Result<()> {
        self.server.shutdown();
        self.handle.take().unwrap().join().unwrap()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.server.shutdown();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// What `lightfoot serve` opens per connection over `below` with `--prefetch` and/or
/// `--coalesce`, from the same [`lightfoot::filters::Stack`]: one filter of each for the
/// export, a front of each per connection.
pub fn stack_opener(
    below: std::sync::Arc<dyn lightfoot::backend::Backend>,
    prefetch: bool,
    coalesce: bool,
) -> impl Fn() -> lightfoot::Result<std::sync::Arc<dyn lightfoot::backend::Backend>> + Send + Sync + 'static {
    use lightfoot::filters::{Stack, StackConfig};
    let cfg = StackConfig {
        read_only: false,
        prefetch: prefetch.then(Default::default),
        coalesce: coalesce.then(Default::default),
    };
    let stack = Stack::new(cfg, move |_| Ok(below.clone())).expect("filters over a shared backend");
    move || stack.open()
}

//! `lightfoot copy` with NBD endpoints, against real servers: lightfoot serve, qemu-nbd and
//! nbdkit, by URI and as captive servers. Contents are compared byte for byte; holes must stay
//! holes; server failures and bad endpoints must fail cleanly.

// A test crate of its own, outside the library's `deny(unsafe_code)`: it calls libc where std
// has no way (marked at each call); each `unsafe` block says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

const SIZE: u64 = 24 * MIB;

/// A server process listening on a Unix socket; killed on drop.
struct Peer {
    child: Child,
    uri: String,
}

impl Peer {
    /// Starts `cmd` (which must listen on `sock`) and waits for the socket.
    fn start(mut cmd: Command, sock: &Path, export: &str) -> Peer {
        let child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("start server");
        assert!(within(10, || sock.exists()), "no socket from {cmd:?}");
        Peer { child, uri: format!("nbd+unix:///{export}?socket={}", sock.display()) }
    }

    /// `lightfoot serve [-r] FILE`.
    fn lightfoot(file: &Path, read_only: bool) -> Peer {
        let sock = file.with_extension("lf.sock");
        let mut cmd = Command::new(bin());
        cmd.args(["serve", "--unix"]).arg(&sock);
        if read_only {
            cmd.arg("-r");
        }
        cmd.arg(file);
        Peer::start(cmd, &sock, "")
    }

    /// `nbdkit [ARGS]` in the foreground on a socket in `dir`.
    fn nbdkit(dir: &Path, name: &str, args: &[&str]) -> Peer {
        let sock = dir.join(format!("{name}.sock"));
        let mut cmd = Command::new("nbdkit");
        cmd.args(["-f", "-U"]).arg(&sock).args(args);
        Peer::start(cmd, &sock, "")
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn copy(args: &[&str]) -> std::process::Output {
    let mut all = vec!["copy", "--"];
    all.extend_from_slice(args);
    lightfoot(&all)
}

fn ok(out: &std::process::Output) {
    assert!(out.status.success(), "copy failed: {}", text(out));
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn file_to_lightfoot_serve_and_back() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    sample(&src, SIZE, MIB);
    // The destination holds old data everywhere: holes in SRC must not show it.
    let dst = dir.path().join("dst.img");
    random_file(&dst, SIZE);
    {
        let server = Peer::lightfoot(&dst, false);
        ok(&copy(&[s(&src), &server.uri]));
    }
    assert!(same_contents(&src, &dst));
    // One fast zero punched the old data; then only data was written.
    assert!(allocated(&dst) <= allocated(&src), "dst {} > src {}", allocated(&dst), allocated(&src));

    let back = dir.path().join("back.img");
    {
        let server = Peer::lightfoot(&src, true);
        let out = lightfoot(&["copy", "--json", &server.uri, s(&back)]);
        ok(&out);
        let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(j["source"]["name"], server.uri.as_str());
        assert_eq!(j["bytes"], SIZE);
    }
    assert!(same_contents(&src, &back));
    assert!(allocated(&back) <= allocated(&src));
}

#[test]
fn qemu_nbd_raw_and_qcow2() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    sample(&src, SIZE, 3 * MIB);
    let raw = dir.path().join("dst.raw");
    std::fs::File::create(&raw).unwrap().set_len(SIZE).unwrap();
    ok(&copy(&[s(&src), "[", "qemu-nbd", "-f", "raw", s(&raw), "]"]));
    assert!(same_contents(&src, &raw));
    assert!(allocated(&raw) <= allocated(&src));

    let qcow2 = dir.path().join("dst.qcow2");
    let made =
        Command::new("qemu-img").args(["create", "-q", "-f", "qcow2", s(&qcow2), &SIZE.to_string()]).status();
    assert!(made.unwrap().success());
    ok(&copy(&[s(&src), "[", "qemu-nbd", "-f", "qcow2", s(&qcow2), "]"]));
    let cmp = Command::new("qemu-img").args(["compare", "-q", s(&src), s(&qcow2)]).status().unwrap();
    assert!(cmp.success(), "qemu-img compare: the qcow2 differs from the source");

    let back = dir.path().join("back.img");
    ok(&copy(&["[", "qemu-nbd", "-r", "-f", "qcow2", s(&qcow2), "]", s(&back)]));
    assert!(same_contents(&src, &back));
    assert!(allocated(&back) <= allocated(&src));
}

#[test]
fn nbdkit_sources() {
    let dir = scratch();
    // pattern: every 8-byte word holds its own offset, big-endian.
    let out = dir.path().join("pattern.img");
    ok(&copy(&["[", "nbdkit", "pattern", "8M", "]", s(&out)]));
    let data = std::fs::read(&out).unwrap();
    assert_eq!(data.len() as u64, 8 * MIB);
    for (i, w) in data.chunks_exact(8).enumerate() {
        assert_eq!(u64::from_be_bytes(w.try_into().unwrap()), i as u64 * 8, "word {i}");
    }

    // sparse-random: compared with nbdcopy's copy of the same seed; mostly holes.
    let ours = dir.path().join("sparse.img");
    let theirs = dir.path().join("sparse-ref.img");
    let server = ["nbdkit", "sparse-random", "64M", "seed=7"];
    let mut args = vec!["["];
    args.extend_from_slice(&server);
    args.extend_from_slice(&["]", s(&ours)]);
    ok(&copy(&args));
    let st = Command::new("nbdcopy").arg("--").arg("[").args(server).arg("]").arg(&theirs).status().unwrap();
    assert!(st.success());
    assert!(same_contents(&ours, &theirs));
    assert!(allocated(&ours) < 32 * MIB, "sparse-random copy allocated {}", allocated(&ours));
    assert!(allocated(&ours) <= allocated(&theirs) + MIB);

    // memory: a file in and out of a running nbdkit.
    let src = dir.path().join("src.img");
    sample(&src, SIZE, MIB);
    let mem = Peer::nbdkit(dir.path(), "mem", &["memory", &SIZE.to_string()]);
    ok(&copy(&[s(&src), &mem.uri]));
    let back = dir.path().join("back.img");
    ok(&copy(&[&mem.uri, s(&back)]));
    assert!(same_contents(&src, &back));
    assert!(allocated(&back) <= allocated(&src));
}

#[test]
fn nbd_to_nbd_between_two_servers() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    sample(&src, SIZE, 2 * MIB);
    let from = Peer::lightfoot(&src, true);
    // nbdkit memory without fast zero: holes are zeroed with WRITE_ZEROES. Fill it with junk
    // first so a skipped hole would show.
    let to = Peer::nbdkit(
        dir.path(),
        "to",
        &["--filter=nozero", "memory", &SIZE.to_string(), "fastzeromode=none"],
    );
    let junk = dir.path().join("junk.img");
    random_file(&junk, SIZE);
    ok(&copy(&[s(&junk), &to.uri]));
    ok(&copy(&[&from.uri, &to.uri]));
    let back = dir.path().join("back.img");
    ok(&copy(&[&to.uri, s(&back)]));
    assert!(same_contents(&src, &back));
}

/// The spec lets the maximum payload be any number: a maximum of 40000 with 4 KiB blocks cut
/// every request into a 40000-byte piece and a piece starting at 40000, which the server
/// refused (EINVAL). Pieces are whole minimum blocks now.
#[test]
fn a_maximum_payload_that_is_not_whole_blocks() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 4 * MIB);
    let odd = Peer::nbdkit(
        dir.path(),
        "odd",
        &[
            "--filter=blocksize-policy",
            "memory",
            &(4 * MIB).to_string(),
            "blocksize-minimum=4096",
            "blocksize-preferred=4096",
            "blocksize-maximum=40000",
            "blocksize-error-policy=error",
        ],
    );
    ok(&copy(&[s(&src), &odd.uri]));
    let back = dir.path().join("back.img");
    ok(&copy(&[&odd.uri, s(&back)]));
    assert!(same_contents(&src, &back));
}

#[test]
fn a_killed_server_fails_the_copy() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 64 * MIB);
    let log = dir.path().join("slow.log");
    let logfile = format!("logfile={}", s(&log));
    let mut server = Peer::nbdkit(
        dir.path(),
        "slow",
        &["--filter=log", "--filter=delay", "file", s(&src), "rdelay=2", &logfile],
    );
    let dst = dir.path().join("dst.img");
    let copy = Command::new(bin())
        .args(["copy", "--workers", "16", &server.uri, s(&dst)])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Reads take 2 s each: once the 16 workers' first reads have reached the server, the copy
    // is under way and far from done.
    wait_until("the copy's first 16 reads", Duration::from_secs(10), || begun(&log, "Read") >= 16);
    server.child.kill().unwrap();
    let out = copy.wait_with_output().unwrap();
    fails_with(&out, &[&server.uri, "at offset", "incomplete"]);
}

/// The child processes of `pid` (all its threads' children).
fn children(pid: u32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return vec![] };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<i32>>())
        .collect()
}

/// Requests of `kind` (`Read`; `Preconnect` for a connection accepted) that nbdkit's log
/// filter has written to `log` as begun (its lines for a request's start end in `...`).
fn begun(log: &Path, kind: &str) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    text.lines().filter(|l| l.contains(&format!(" {kind} id=")) && l.ends_with(" ...")).count()
}

/// Whether process `pid` has a socket whose row (split on blanks) in the /proc/net table
/// `table` (`tcp`, `unix`) `fits`; `inode` is the index of the row's inode field.
fn has_socket(pid: u32, table: &str, inode: usize, fits: impl Fn(&[&str]) -> bool) -> bool {
    let ours: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|l| Some(l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_string()))
        .collect();
    let rows = std::fs::read_to_string(format!("/proc/net/{table}")).unwrap_or_default();
    rows.lines().skip(1).any(|row| {
        let f: Vec<&str> = row.split_whitespace().collect();
        f.get(inode).is_some_and(|i| ours.iter().any(|o| o == i)) && fits(&f)
    })
}

#[test]
fn a_captive_server_that_dies_is_named_with_how_it_ended() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 64 * MIB);
    let dst = dir.path().join("dst.img");
    let log = dir.path().join("captive.log");
    let logfile = format!("logfile={}", s(&log));
    let captive =
        ["[", "nbdkit", "--filter=log", "--filter=delay", "file", s(&src), "rdelay=2", &logfile, "]"];
    let copy = Command::new(bin())
        .args(["copy", "--workers", "16", "--"])
        .args(captive)
        .arg(&dst)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = None;
    assert!(
        within(10, || {
            server = children(copy.id()).first().copied();
            server.is_some()
        }),
        "no captive server started"
    );
    let server = server.unwrap();
    // Reads take 2 s each: once the 16 workers' first reads have reached the server, the copy
    // is under way and far from done.
    wait_until("the copy's first 16 reads", Duration::from_secs(10), || begun(&log, "Read") >= 16);
    // libc's kill: the server is the copy's child, not ours, so no `Child` of ours can kill it.
    // SAFETY: kill takes integers and touches no memory of ours; `server` is the captive
    // server's pid, still a child of the running copy.
    assert_eq!(unsafe { libc::kill(server, libc::SIGKILL) }, 0);
    let out = copy.wait_with_output().unwrap();
    fails_with(
        &out,
        &[
            "[ nbdkit --filter=log --filter=delay",
            "connection lost",
            "ended during the copy (signal: 9",
            "incomplete",
        ],
    );
}

#[test]
fn server_errors_name_the_uri_and_offset() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 8 * MIB);
    let eio = Peer::nbdkit(
        dir.path(),
        "eio",
        &["--filter=error", "file", s(&src), "error-pread=EIO", "error-pread-rate=100%"],
    );
    let out = copy(&[&eio.uri, s(&dir.path().join("a.img"))]);
    fails_with(&out, &[&eio.uri, "at offset", "EIO"]);

    let full = Peer::nbdkit(
        dir.path(),
        "full",
        &["--filter=error", "memory", "8M", "error-pwrite=ENOSPC", "error-pwrite-rate=100%"],
    );
    let out = copy(&[s(&src), &full.uri]);
    fails_with(&out, &[&full.uri, "at offset", "ENOSPC"]);
}

#[test]
fn bad_endpoints_fail_before_writing() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    random_file(&src, 8 * MIB);
    let nowhere = format!("nbd+unix:///?socket={}", dir.path().join("none.sock").display());
    fails_with(&copy(&[s(&src), &nowhere]), &["connect", &nowhere, "no such file"]);

    let out = copy(&[s(&src), "nbds://localhost/x?tls-type=psk"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("TLS-PSK"));
    let out = copy(&[s(&src), "[", "qemu-nbd", s(&src)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    fails_with(&copy(&["[", "no-such-server", "]", "null:"]), &["command 'no-such-server' not found"]);
    let missing = dir.path().join("missing.qcow2");
    fails_with(&copy(&["[", "qemu-nbd", "-f", "qcow2", s(&missing), "]", "null:"]), &["exited"]);

    // Too small and read-only destinations are refused before anything is written.
    let small = Peer::nbdkit(dir.path(), "small", &["memory", "1M"]);
    fails_with(&copy(&[s(&src), &small.uri]), &["smaller than the source"]);
    let target = dir.path().join("ro.img");
    random_file(&target, 8 * MIB);
    let before = std::fs::read(&target).unwrap();
    {
        let ro = Peer::lightfoot(&target, true);
        fails_with(&copy(&[s(&src), &ro.uri]), &["read-only"]);
    }
    assert_eq!(std::fs::read(&target).unwrap(), before);

    // An export the server does not have.
    let sock = dir.path().join("q.sock");
    let mut cmd = Command::new("qemu-nbd");
    cmd.args(["-r", "-x", "disk", "-k"]).arg(&sock).args(["-f", "raw"]).arg(&src);
    let q = Peer::start(cmd, &sock, "other");
    fails_with(&copy(&[&q.uri, "null:"]), &["no export named 'other'"]);
}

#[test]
fn captive_lightfoot_serve_and_stdout() {
    let dir = scratch();
    let src = dir.path().join("src.img");
    sample(&src, SIZE, MIB);
    // The captive server's own output must not end up in the copy on standard output.
    let out = Command::new(bin())
        .args(["copy", "--", "[", bin(), "serve", "-v", s(&src), "]", "-"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(out.stdout, std::fs::read(&src).unwrap());
}

/// Two network namespaces joined by a veth pair, one for each end of an NBD connection, so
/// that nothing touches the host's own network (and concurrent test runs, each with its own
/// namespaces, cannot meet). Taking one end's link down makes the other end's packets vanish
/// (the veth drops them, and its route stays), as when a peer's host dies or its network goes,
/// with no FIN or RST. Removed on drop.
struct Netns {
    client: String,
    server: String,
}

impl Netns {
    const CLIENT: &'static str = "10.251.0.1";
    const SERVER: &'static str = "10.251.0.2";

    fn new() -> Netns {
        let base = format!("lfka{}", std::process::id());
        let ns = Netns { client: format!("{base}c"), server: format!("{base}s") };
        let ip = |args: &[&str]| {
            let st = Command::new("ip").args(args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["netns", "add", &ns.client]);
        ip(&["netns", "add", &ns.server]);
        ip(&[
            "-n", &ns.client, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns",
            &ns.server,
        ]);
        for (n, addr) in [(&ns.client, Netns::CLIENT), (&ns.server, Netns::SERVER)] {
            ip(&["-n", n, "addr", "add", &format!("{addr}/30"), "dev", "veth0"]);
            ip(&["-n", n, "link", "set", "veth0", "up"]);
        }
        ns
    }

    /// `prog` run inside namespace `ns`.
    fn command(ns: &str, prog: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, prog]);
        c
    }

    /// From now on every packet to `ns` is dropped: its end of the link goes down.
    fn silence(ns: &str) {
        assert!(Command::new("ip")
            .args(["-n", ns, "link", "set", "veth0", "down"])
            .status()
            .unwrap()
            .success());
    }

    /// The sockets `ss ARGS` lists inside namespace `ns` (a line each, no header).
    fn ss(ns: &str, args: &[&str]) -> Vec<String> {
        let out = Netns::command(ns, "ss").arg("-H").args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The client's established TCP connections to `port`, and the bytes it has sent on them
    /// that the server has not acknowledged (its Send-Q).
    fn established(&self, port: u16) -> (usize, u64) {
        let lines =
            Netns::ss(&self.client, &["-tn", "state", "established", &format!("( dport = :{port} )")]);
        let unacked = lines.iter().filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum();
        (lines.len(), unacked)
    }

    /// Something listens on TCP `port` in the server's namespace.
    fn listening(&self, port: u16) -> bool {
        !Netns::ss(&self.server, &["-tln", &format!("( sport = :{port} )")]).is_empty()
    }

    /// The server's established TCP connections on `port`.
    fn served(&self, port: u16) -> usize {
        self.served_unacked(port).0
    }

    /// The server's established TCP connections on `port`, and the bytes it has sent on them
    /// that the client has not acknowledged.
    fn served_unacked(&self, port: u16) -> (usize, u64) {
        let lines =
            Netns::ss(&self.server, &["-tn", "state", "established", &format!("( sport = :{port} )")]);
        let unacked = lines.iter().filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok()).sum();
        (lines.len(), unacked)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.client]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.server]).status();
    }
}

/// A child process killed (and reaped) on drop, so that a failed assertion leaves nothing
/// running (a process inside a namespace would also keep it alive).
struct Kill(Option<Child>);

impl Kill {
    fn spawn(mut cmd: Command) -> Kill {
        Kill(Some(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn")))
    }

    fn running(&mut self) -> bool {
        self.0.as_mut().unwrap().try_wait().unwrap().is_none()
    }

    /// Kills it if it still runs; its output.
    fn finish(mut self) -> std::process::Output {
        let mut c = self.0.take().unwrap();
        let _ = c.kill();
        c.wait_with_output().unwrap()
    }
}

impl Drop for Kill {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A peer that goes silent without closing the connection (its host died, the network went)
/// is found out by TCP keepalive, on both sides: the client's copy fails instead of waiting
/// for replies for ever, and the server ends the connection instead of waiting for requests
/// for ever. Keepalive is shortened to 1 s idle, 1 s between probes, 2 probes for the test
/// (the defaults find it in 90 s); without keepalive neither side ever notices. The cut
/// comes once the client has nothing unacknowledged: keepalive does not cover that case
/// (TCP's retransmissions do, after minutes).
#[test]
fn a_peer_gone_silent_over_tcp_is_found_out() {
    if !root_or_skip("needs root for network namespaces") {
        return;
    }
    const KEEPALIVE: (&str, &str) = ("LIGHTFOOT_TCP_KEEPALIVE", "1,1,2");

    // The client: nbdkit answers reads only after 60 s; its side goes silent while the copy
    // waits for the first replies. 16 workers, one read in flight each, and 16 nbdkit threads,
    // each taking one: nbdkit's log shows when the copy has sent all it will send.
    let ns = Netns::new();
    let dir = scratch();
    let log = dir.path().join("nbdkit.log");
    let logfile = format!("logfile={}", s(&log));
    let mut cmd = Netns::command(&ns.server, "nbdkit");
    cmd.args(["-f", "-t", "16", "-i", Netns::SERVER, "-p", "10871", "--filter=log", "--filter=delay"]);
    cmd.args(["pattern", "64M", "rdelay=60", &logfile]);
    let server = Kill::spawn(cmd);
    assert!(within(10, || ns.listening(10871)), "nbdkit did not listen");
    let mut cmd = Netns::command(&ns.client, bin());
    cmd.args(["copy", "--connections", "1", "--workers", "16"]);
    cmd.args([&format!("nbd://{}:10871/", Netns::SERVER), "null:"]);
    cmd.env(KEEPALIVE.0, KEEPALIVE.1);
    let mut client = Kill::spawn(cmd);
    // Connected, and its requests received and acknowledged: nothing left for retransmission
    // to wait on.
    assert!(within(10, || ns.established(10871).0 == 1), "the copy did not connect");
    wait_until("nbdkit to take the copy's 16 reads", Duration::from_secs(10), || begun(&log, "Read") >= 16);
    assert!(within(10, || ns.established(10871) == (1, 0)), "the copy's requests were not all acknowledged");
    Netns::silence(&ns.server);
    let gone = within(20, || !client.running());
    let out = client.finish();
    drop(server);
    assert!(gone, "the copy still waited 20 s after the server went silent: {}", text(&out));
    fails_with(&out, &["nbd://10.251.0.2:10871/", "connection lost", "timed out"]);
    drop(ns);

    // The server: an idle client (connected, nothing in flight) that goes silent.
    let ns = Netns::new();
    let dir = scratch();
    let file = dir.path().join("disk.img");
    std::fs::write(&file, vec![7u8; MIB as usize]).unwrap();
    let mut cmd = Netns::command(&ns.server, bin());
    cmd.args(["serve", "--listen", &format!("{}:10872", Netns::SERVER), s(&file)]);
    cmd.env(KEEPALIVE.0, KEEPALIVE.1);
    let mut server = Kill::spawn(cmd);
    assert!(within(10, || ns.listening(10872)), "lightfoot serve did not listen");
    // nbdsh connects (the handshake done) before it runs its commands: it says so, then idles
    // (a sleep that is the workload: a client connected with nothing in flight).
    let mut cmd = Netns::command(&ns.client, "/usr/bin/nbdsh");
    let idle = "import time; print('connected', flush=True); time.sleep(120)";
    cmd.args(["-u", &format!("nbd://{}:10872/", Netns::SERVER), "-c", idle]);
    cmd.env("PATH", "/usr/bin:/bin:/usr/sbin:/sbin");
    let mut idle = Kill::spawn(cmd);
    let mut said = String::new();
    let stdout = idle.0.as_mut().unwrap().stdout.as_mut().unwrap();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut said).unwrap();
    assert_eq!(said, "connected\n", "nbdsh did not connect");
    // Every byte of the handshake acknowledged, both ways: the server waits on nothing.
    let quiet = || ns.established(10872) == (1, 0) && ns.served_unacked(10872) == (1, 0);
    assert!(within(10, quiet), "the handshake's last bytes were not acknowledged");
    Netns::silence(&ns.client);
    // Its FIN would be lost with the link: the server hears nothing more from it.
    drop(idle);
    let ended = within(20, || ns.served(10872) == 0);
    let alive = server.running();
    drop(server);
    assert!(ended, "the server kept the silent client's connection for 20 s");
    assert!(alive, "the server itself ended");
}

/// Ctrl-C during a copy whose server is alive but no longer answering (here: nbdkit holding
/// every read for 100 s) ends the copy about 2 s later, the ordinary way: exit 130, the
/// interrupted request named, the destination called incomplete. Before, the first Ctrl-C
/// waited for the replies (100 s here, for ever for a wedged server) and only a second one
/// ended it, without the clean-up.
#[test]
fn ctrl_c_ends_a_copy_whose_server_stopped_answering() {
    let dir = scratch();
    let log = dir.path().join("stuck.log");
    let logfile = format!("logfile={}", s(&log));
    let server = Peer::nbdkit(
        dir.path(),
        "stuck",
        &["--filter=log", "--filter=delay", "pattern", "64M", "rdelay=100", &logfile],
    );
    let dst = dir.path().join("dst.img");
    // Once all its requests are sent and waiting: 16 workers, a read in flight each (a worker
    // yet to send its read would stop at the flag, and the copy say only "interrupted").
    let held = |_| begun(&log, "Read") >= 16;
    let out =
        interrupted_copy(&["--workers", "16"], &server.uri, &dst, "nbdkit to hold the copy's 16 reads", held);
    for w in [&server.uri, "at offset", "interrupted while waiting for the server", "is incomplete"] {
        assert!(text(&out).contains(w), "message lacks '{w}': {}", text(&out));
    }
}

/// The same in the handshake: a server that accepts the connection and never greets.
#[test]
fn ctrl_c_ends_a_handshake_that_never_comes() {
    let dir = scratch();
    let sock = dir.path().join("mute.sock");
    // The connection is accepted; nothing is ever sent on it.
    let mute = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    mute.set_nonblocking(true).unwrap();
    let mut accepted = None;
    let dst = dir.path().join("dst.img");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let out = interrupted_copy(&[], &uri, &dst, "the copy to connect", |_| {
        accepted = accepted.take().or_else(|| mute.accept().ok());
        accepted.is_some()
    });
    assert!(text(&out).contains("interrupted during the handshake"), "{}", text(&out));
    assert!(!dst.exists(), "the destination was created before the source was open");
}

/// A Ctrl-C that comes while the source's handshake is slow but finishes (nbdkit opens each
/// connection after 1 s) stops the copy before the destination is created.
#[test]
fn ctrl_c_during_a_slow_handshake_leaves_the_destination_alone() {
    let dir = scratch();
    let log = dir.path().join("slow.log");
    let logfile = format!("logfile={}", s(&log));
    let server = Peer::nbdkit(
        dir.path(),
        "slow",
        &["--filter=log", "--filter=delay", "pattern", "64M", "delay-open=1000ms", &logfile],
    );
    let dst = dir.path().join("dst.img");
    // One connection: its handshake ends within the 2 s grace. Ctrl-C once nbdkit has
    // accepted it, 1 s before it opens.
    let accepted = |_| begun(&log, "Preconnect") > 0;
    let out =
        interrupted_copy(&["--connections", "1"], &server.uri, &dst, "nbdkit to accept the copy", accepted);
    assert!(text(&out).contains("interrupted before the destination was opened"), "{}", text(&out));
    assert!(!dst.exists(), "the destination was created after Ctrl-C");
}

/// The same while the connect itself waits: a TCP server whose listen queue is full (backlog
/// 0 and one connection nobody accepts), so the kernel drops the SYNs and would retry them for
/// about two minutes. Before, a blocking `connect` did not hear Ctrl-C and only a second one
/// ended the copy.
#[test]
fn ctrl_c_ends_a_tcp_connect_that_waits() {
    use std::os::fd::AsRawFd;
    let dir = scratch();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    // libc's listen: std listens with a backlog of 128 and cannot change it; listening again
    // sets it to 0.
    // SAFETY: integer arguments only, on a socket `listener` owns and keeps open.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let addr = listener.local_addr().unwrap();
    let _queued = std::net::TcpStream::connect(addr).unwrap();
    let full = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300));
    assert_eq!(
        full.map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::TimedOut),
        "the listen queue is not full"
    );
    let dst = dir.path().join("dst.img");
    // Once the copy's SYN is out (its socket in /proc/net/tcp: `st` 02, SYN_SENT, to the port).
    let port = format!(":{:04X}", addr.port());
    let syn_sent = |pid| has_socket(pid, "tcp", 9, |f| f[2].ends_with(&port) && f[3] == "02");
    let out = interrupted_copy(&[], &format!("nbd://{addr}"), &dst, "the copy's SYN", syn_sent);
    assert!(text(&out).contains("interrupted while connecting"), "{}", text(&out));
    assert!(!dst.exists(), "the destination was created before the source was open");
}

/// And a Unix socket whose listen queue is full (backlog 0, one connection nobody accepts),
/// where a blocking connect waits for room for ever.
#[test]
fn ctrl_c_ends_a_unix_connect_that_waits() {
    use std::os::fd::AsRawFd;
    let dir = scratch();
    let sock = dir.path().join("full.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    // libc's listen: std listens with a backlog of 128 and cannot change it; listening again
    // sets it to 0.
    // SAFETY: integer arguments only, on a socket `listener` owns and keeps open.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let _queued = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    let full = lightfoot::io::sys::unix_connect_nonblocking(&sock);
    assert_eq!(full.map_err(|e| e.raw_os_error()), Err(Some(libc::EAGAIN)), "the listen queue is not full");
    let dst = dir.path().join("dst.img");
    // Once the copy tries: it holds a Unix stream socket (/proc/net/unix: `Type` 0001) that is
    // neither connected nor listening (`St` 01, `Flags` 0), which it makes just to connect.
    let trying = |pid| has_socket(pid, "unix", 6, |f| f[3] == "00000000" && f[4] == "0001" && f[5] == "01");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let out = interrupted_copy(&[], &uri, &dst, "the copy to try to connect", trying);
    assert!(text(&out).contains("interrupted while connecting"), "{}", text(&out));
    assert!(!dst.exists(), "the destination was created before the source was open");
}

/// `lightfoot copy [ARGS] FROM DST`, sent SIGINT (Ctrl-C) once `ready` (given its pid) says
/// it has got as far as the test needs (`what`): it must end within 15 s, with exit status
/// 130. Its output.
fn interrupted_copy(
    args: &[&str],
    from: &str,
    dst: &Path,
    what: &str,
    mut ready: impl FnMut(u32) -> bool,
) -> std::process::Output {
    let mut cmd = Command::new(bin());
    cmd.arg("copy").args(args).args([from, s(dst)]);
    let mut copy = Kill::spawn(cmd);
    let pid = copy.0.as_ref().unwrap().id();
    wait_until(what, Duration::from_secs(10), || ready(pid));
    assert!(Command::new("kill").args(["-INT", &pid.to_string()]).status().unwrap().success());
    let ended = within(15, || !copy.running());
    let out = copy.finish();
    assert!(ended, "the copy still waited 15 s after Ctrl-C: {}", text(&out));
    assert_eq!(out.status.code(), Some(130), "{}", text(&out));
    out
}

//! Real S3-compatible stores for the tests: SeaweedFS on loopback ports of their own, in a
//! scratch folder, killed when the test ends.
//!
//! - [`Seaweed`]: `weed server -s3`, master, volume server, filer and S3 gateway in one
//!   process.
//! - [`Cluster`]: the same as separate processes, with two volume servers that each hold a
//!   replica of every object, for the fault tests to kill and restart one part at a time.
//!
//! Both are a [`Gateway`]: what a test does through the S3 API. [`S3Served`] is a
//! `lightfoot serve` of an image in either. `scripts/build-seaweedfs.sh` builds `weed` once per
//! machine (`make test` runs it first; `WEED=` points at one already built).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use super::{bin, within, Served};

pub struct Seaweed {
    child: Child,
    /// `http://127.0.0.1:PORT` of the S3 gateway.
    pub endpoint: String,
    /// `https://localhost:PORT`, when started with a certificate.
    pub https_endpoint: Option<String>,
    pub s3_port: u16,
    _dir: tempfile::TempDir,
}

/// The `weed` binary (built and cached on first use).
pub fn weed() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/build-seaweedfs.sh");
    let out =
        Command::new(&script).stderr(Stdio::inherit()).output().expect("run scripts/build-seaweedfs.sh");
    assert!(
        out.status.success(),
        "scripts/build-seaweedfs.sh failed: the object-storage tests need SeaweedFS"
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// A port `p` such that `p` and `p + 10000` (SeaweedFS's gRPC port for it) are free now, and
/// never given before in this process: the tests of one binary run at once, and a port free
/// when one store looked may be bound by another's process before its own starts.
fn free_port_pair() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap();
    loop {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p > 55000 || given.iter().any(|&g| [p, p + 10000].contains(&g) || g + 10000 == p) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 10000)).is_ok() {
            given.push(p);
            return p;
        }
    }
}

impl Seaweed {
    /// Starts a store and waits until its S3 gateway answers and has a volume to write to.
    /// No identities: every request is let in, signed or not.
    pub fn start() -> Seaweed {
        Self::start_with(None)
    }

    /// [`Self::start`] with identities (`-s3.config`, SeaweedFS's JSON): `s3_config` names
    /// them and what each may do.
    pub fn start_with(s3_config: Option<&str>) -> Seaweed {
        Self::start_full(s3_config, None)
    }

    /// [`Self::start_with`], and with `tls` (a certificate and its key, PEM) an HTTPS port as
    /// well, at [`Seaweed::https_endpoint`].
    pub fn start_full(s3_config: Option<&str>, tls: Option<(&Path, &Path)>) -> Seaweed {
        let dir = tempfile::Builder::new().prefix("lightfoot-weed").tempdir().unwrap();
        let (master, volume, filer, s3) =
            (free_port_pair(), free_port_pair(), free_port_pair(), free_port_pair());
        let log = std::fs::File::create(dir.path().join("weed.log")).unwrap();
        let mut extra = Vec::new();
        if let Some(json) = s3_config {
            let path = dir.path().join("s3.json");
            std::fs::write(&path, json).unwrap();
            extra.push(format!("-s3.config={}", path.display()));
        }
        let https = tls.map(|(cert, key)| {
            let port = free_port_pair();
            extra.push(format!("-s3.port.https={port}"));
            extra.push(format!("-s3.cert.file={}", cert.display()));
            extra.push(format!("-s3.key.file={}", key.display()));
            format!("https://localhost:{port}")
        });
        let child = Command::new(weed())
            .arg("-logtostderr=true")
            .arg("server")
            .arg(format!("-dir={}", dir.path().display()))
            // Volume slots are counted against free disk in units of the volume size limit
            // (30 GB by default): with less than that free, -volume.max=0 gave no slot, and
            // each bucket takes volumes of its own. Small volumes and a fixed count of them
            // do not depend on the disk.
            .args([
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-volume.max=64",
                "-master.volumeSizeLimitMB=1024",
                "-s3",
            ])
            .arg(format!("-master.port={master}"))
            .arg(format!("-volume.port={volume}"))
            .arg(format!("-filer.port={filer}"))
            .arg(format!("-s3.port={s3}"))
            // The filer's and the gateway's sockets go into the scratch folder, not /tmp, where
            // every killed store would leave them (and its logs to weed.log: -logtostderr,
            // before `server`). Its gRPC sockets, /tmp/seaweedfs-*-grpc-PORT.sock, have no flag.
            .arg(format!("-filer.localSocket={}", dir.path().join("filer.sock").display()))
            .arg(format!("-s3.localSocket={}", dir.path().join("s3.sock").display()))
            .args(["-s3.port.iceberg=0", "-s3.port.lance=0"])
            .args(&extra)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start weed server");
        let w = Seaweed {
            child,
            endpoint: format!("http://127.0.0.1:{s3}"),
            https_endpoint: https,
            s3_port: s3,
            _dir: dir,
        };
        assert!(
            within(60, || w.request("GET", "/", b"").is_some_and(|(code, _)| code == 200)),
            "SeaweedFS did not start"
        );
        w
    }

    /// The SIGKILL of the whole store (every component is in this one process).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Gateway for Seaweed {
    fn s3_port(&self) -> u16 {
        self.s3_port
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One anonymous HTTP/1.1 request to `127.0.0.1:port`; the status and body, `None` when
/// nothing answered within 30 s.
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Some((code, body))
}

/// What a test does through a store's S3 gateway, whichever store it is.
pub trait Gateway {
    /// The S3 gateway's port on 127.0.0.1.
    fn s3_port(&self) -> u16;

    /// `http://127.0.0.1:PORT` of the S3 gateway.
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.s3_port())
    }

    /// Makes bucket `name` and waits until an object can be written into it (the first
    /// volume is allocated on the first write).
    fn bucket(&self, name: &str) {
        let (code, body) = self.request("PUT", &format!("/{name}"), b"").expect("create bucket");
        assert!(code == 200, "create bucket {name}: {code} {body}");
        assert!(
            within(60, || self
                .request("PUT", &format!("/{name}/.probe"), b"x")
                .is_some_and(|(c, _)| c == 200)),
            "bucket {name} takes no writes"
        );
        self.request("DELETE", &format!("/{name}/.probe"), b"");
    }

    /// One anonymous HTTP/1.1 request (this store accepts them: no identities configured);
    /// the status and body.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> Option<(u16, String)> {
        http(self.s3_port(), method, path, body)
    }

    /// The object names under `prefix` (ListObjectsV2, one page: tests keep under 1,000).
    fn list(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let (code, body) =
            self.request("GET", &format!("/{bucket}?list-type=2&prefix={prefix}"), b"").expect("list");
        assert_eq!(code, 200, "{body}");
        body.split("<Key>")
            .skip(1)
            .filter_map(|s| s.split_once("</Key>").map(|(k, _)| k.to_string()))
            .collect()
    }

    /// The environment a client of this store runs with.
    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", "lightfoot-test".into()),
            ("AWS_SECRET_ACCESS_KEY", "lightfoot-test-secret".into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// Runs lightfoot with this store's environment to completion, under `timeout SECS` (a
    /// hang fails the test with status 124).
    fn lightfoot(&self, secs: u64, args: &[&str]) -> Output {
        self.command("timeout").args(["-k", "10", &secs.to_string(), bin()]).args(args).output().unwrap()
    }

    /// `cmd` with this store's environment (and no profile of the user's).
    fn command(&self, cmd: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new(cmd);
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
            c.env_remove(k);
        }
        c.env("AWS_CONFIG_FILE", "/dev/null").env("AWS_SHARED_CREDENTIALS_FILE", "/dev/null");
        c.envs(self.env());
        c
    }
}

/// One `weed` process of a [`Cluster`], with the arguments to start it again as it was (same
/// ports, same folder), its output appended to `NAME.log`.
struct Daemon {
    name: &'static str,
    weed: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Daemon {
    /// `weed COMMAND ARGS...` on loopback, listening there and advertised there to the others
    /// (the default is the machine's first address), logging to stderr only (the default
    /// also writes files in /tmp that outlive the test).
    fn new(weed: &Path, dir: &Path, name: &'static str, command: &str, args: Vec<String>) -> Daemon {
        let mut all = vec![
            "-logtostderr=true".to_string(),
            command.to_string(),
            "-ip=127.0.0.1".into(),
            "-ip.bind=127.0.0.1".into(),
        ];
        all.extend(args);
        Daemon {
            name,
            weed: weed.to_path_buf(),
            args: all,
            log: dir.join(format!("{name}.log")),
            child: None,
        }
    }

    fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running already", self.name);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(&self.weed)
            .args(&self.args)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start weed {}: {e}", self.name));
        self.child = Some(child);
    }

    /// SIGKILL, and reaped: nothing of it is left when this returns.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn alive(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The last lines of its log, for a failed assertion.
    fn tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let last = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("weed {}, the end of its log:\n{last}", self.name)
    }
}

/// SeaweedFS as separate processes: a master with `-defaultReplication=001` (every volume
/// on two volume servers of one rack), two volume servers, a filer and an S3 gateway. Writes
/// need both replicas; reads need one. The parts can be killed (SIGKILL) and volume servers
/// started again on their ports and folders, as after a crash.
pub struct Cluster {
    s3_port: u16,
    master_port: u16,
    volume_ports: [u16; 2],
    master: Daemon,
    volumes: [Daemon; 2],
    filer: Daemon,
    s3: Daemon,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts the parts in order, each once the one it needs answers: the master; both volume
    /// servers, until the master lists them (with replication 001 a volume grows only on two
    /// servers, and the filer's first write would fail with one); then the filer and the
    /// gateway, until the gateway answers S3 requests. About 5 s. The first write into a bucket
    /// ([`Gateway::bucket`] waits for it) takes 10 s more: a new filer announces itself to the
    /// master only after 10 s of seeing no other filer, and the gateway's writes wait for the
    /// lock ring that announcement forms ("FILER LOCK: no lock server found" until then).
    pub fn start() -> Cluster {
        let weed = weed();
        let dir = tempfile::Builder::new().prefix("lightfoot-weed-cluster").tempdir().unwrap();
        let d = dir.path();
        let [master_port, v0, v1, filer_port, s3_port] = [(); 5].map(|_| free_port_pair());
        let folder = |name: &str| {
            let p = d.join(name);
            std::fs::create_dir(&p).unwrap();
            p.display().to_string()
        };
        let daemon = |name, command, args| Daemon::new(&weed, d, name, command, args);
        let master = daemon(
            "master",
            "master",
            vec![
                format!("-port={master_port}"),
                format!("-mdir={}", folder("master")),
                "-defaultReplication=001".into(),
                "-peers=none".into(),
                "-telemetry=false".into(),
            ],
        );
        let volumes = [("volume0", v0), ("volume1", v1)].map(|(name, port)| {
            daemon(
                name,
                "volume",
                vec![
                    format!("-port={port}"),
                    format!("-dir={}", folder(name)),
                    format!("-master=127.0.0.1:{master_port}"),
                    // A bucket is a collection with volumes of its own (two at a time with
                    // 001), beside the filer's six: room for a few buckets.
                    "-max=16".into(),
                ],
            )
        });
        let filer = daemon(
            "filer",
            "filer",
            vec![
                format!("-port={filer_port}"),
                format!("-master=127.0.0.1:{master_port}"),
                format!("-defaultStoreDir={}", folder("filer")),
                // Not its default /tmp/seaweedfs-filer-PORT.sock, which a kill leaves behind.
                format!("-localSocket={}", d.join("filer.sock").display()),
            ],
        );
        let s3 = daemon(
            "s3",
            "s3",
            vec![
                format!("-port={s3_port}"),
                format!("-filer=127.0.0.1:{filer_port}"),
                format!("-localSocket={}", d.join("s3.sock").display()),
                // Off: their default ports (8181, 9101) are the same for every gateway.
                "-port.iceberg=0".into(),
                "-port.lance=0".into(),
            ],
        );
        let mut c =
            Cluster { s3_port, master_port, volume_ports: [v0, v1], master, volumes, filer, s3, _dir: dir };
        c.master.start();
        // Ours and alive: were it to die on a port taken meanwhile, another store's master
        // there would answer, and take our volume servers.
        let up = within(30, || {
            c.master.alive()
                && http(master_port, "GET", "/dir/status", b"").is_some_and(|(code, _)| code == 200)
        });
        assert!(up && c.master.alive(), "the master did not start: {}", c.master.tail());
        for v in &mut c.volumes {
            v.start();
        }
        let mut want = c.volume_ports.to_vec();
        want.sort_unstable();
        let both = within(30, || c.data_nodes() == want);
        assert!(both, "the master lists volume servers {:?}, not {want:?}", c.data_nodes());
        c.filer.start();
        c.s3.start();
        // An S3 answer (a list of buckets) from ours: another store's server could hold the port.
        let answers = within(60, || {
            c.s3.alive()
                && c.request("GET", "/", b"")
                    .is_some_and(|(code, body)| code == 200 && body.contains("ListAllMyBucketsResult"))
        });
        assert!(
            answers && c.s3.alive(),
            "the S3 gateway does not answer: {}\n{}",
            c.s3.tail(),
            c.filer.tail()
        );
        c
    }

    /// The ports of the volume servers the master counts as up, in order.
    fn data_nodes(&self) -> Vec<u16> {
        let Some((200, body)) = http(self.master_port, "GET", "/dir/status", b"") else {
            return Vec::new();
        };
        let status: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let mut ports: Vec<u16> = status["Topology"]["DataCenters"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|dc| dc["Racks"].as_array().into_iter().flatten())
            .flat_map(|rack| rack["DataNodes"].as_array().into_iter().flatten())
            .filter_map(|n| n["Url"].as_str()?.rsplit_once(':')?.1.parse().ok())
            .collect();
        ports.sort_unstable();
        ports
    }

    /// SIGKILLs volume server `i` (0 or 1) and waits until the master has dropped it: from
    /// then on, the volumes hold one replica and take no writes.
    pub fn kill_volume(&mut self, i: usize) {
        self.volumes[i].kill();
        let port = self.volume_ports[i];
        assert!(
            within(30, || !self.data_nodes().contains(&port)),
            "the master still lists the killed volume server {port}"
        );
    }

    /// Starts volume server `i` again (same port, same folder) and waits until the master
    /// lists it.
    pub fn restart_volume(&mut self, i: usize) {
        self.volumes[i].start();
        let port = self.volume_ports[i];
        assert!(
            within(30, || self.data_nodes().contains(&port)),
            "volume server {port} did not come back: {}",
            self.volumes[i].tail()
        );
    }

    /// SIGKILLs the S3 gateway: every S3 request is refused from then on.
    pub fn kill_gateway(&mut self) {
        self.s3.kill();
    }
}

impl Gateway for Cluster {
    fn s3_port(&self) -> u16 {
        self.s3_port
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.s3.kill();
        self.filer.kill();
        for v in &mut self.volumes {
            v.kill();
        }
        self.master.kill();
    }
}

/// `lightfoot serve` of an `s3://` image on a Unix socket in a folder, with the store's
/// environment: a [`Served`] whose stderr goes to a file beside the socket (a pipe nobody
/// reads would stop a server that logs many errors).
pub struct S3Served {
    served: Served,
    pub sock: PathBuf,
    log: PathBuf,
}

impl S3Served {
    pub fn start(w: &impl Gateway, dir: &Path, uri: &str, extra: &[&str]) -> S3Served {
        let tag = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let sock = dir.join(format!("s3-{}.sock", std::process::id() ^ tag));
        let log = sock.with_extension("log");
        let child = w
            .command(bin())
            .args(["serve", "--unix"])
            .arg(&sock)
            .args(extra)
            .arg(uri)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut s = S3Served { served: Served { child, sock: sock.clone() }, sock, log };
        // Not waiting out the bound for a server that exited (it does, when its open fails).
        within(30, || s.sock.exists() || !s.alive());
        assert!(s.sock.exists(), "server did not create {}: {}", s.sock.display(), s.stderr());
        assert!(s.alive(), "server exited: {}", s.stderr());
        s
    }

    pub fn uri(&self) -> String {
        self.served.uri()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.served.child.try_wait(), Ok(None))
    }

    /// What the server wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM; asserts a clean exit and returns what the server wrote to stderr.
    pub fn stop(self) -> String {
        let (st, _) = self.served.stop();
        let err = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(st.success(), "server: {st}: {err}");
        err
    }

    /// SIGKILL: nothing the server held is written anywhere after this.
    pub fn kill9(self) {
        self.served.kill9();
    }
}

/// A proxy on loopback in front of `port` that makes every request look a year older, as a
/// client with a skewed clock sends it: the year in each `x-amz-date` header goes back by one
/// (same length, so nothing else moves). The store sees a signed request dated a year ago and
/// answers as it would that client (SeaweedFS checks the date before the signature). A header
/// split across two reads would pass unchanged: the test then fails, it cannot pass wrongly.
/// Returns the proxy's port; it serves until the test process ends.
pub fn skewing_proxy(port: u16) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let proxy = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let Ok(store) = TcpStream::connect(("127.0.0.1", port)) else { continue };
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), store.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 1 << 16];
                while let Ok(n) = c_in.read(&mut buf) {
                    if n == 0 || s_out.write_all(a_year_back(&mut buf[..n])).is_err() {
                        break;
                    }
                }
                let _ = s_out.shutdown(std::net::Shutdown::Write);
            });
            let (mut s_in, mut c_out) = (store, client);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut s_in, &mut c_out);
                let _ = c_out.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    proxy
}

/// `bytes` with the year of every `x-amz-date: YYYYMMDDTHHMMSSZ` one less (29 February
/// becomes the 28th).
fn a_year_back(bytes: &mut [u8]) -> &[u8] {
    const NAME: &[u8] = b"x-amz-date:";
    let mut i = 0;
    while i + NAME.len() + 17 <= bytes.len() {
        if bytes[i..i + NAME.len()].eq_ignore_ascii_case(NAME) {
            let mut d = i + NAME.len();
            while d < bytes.len() && bytes[d] == b' ' {
                d += 1;
            }
            if d + 8 <= bytes.len() {
                if let Some(year) =
                    std::str::from_utf8(&bytes[d..d + 4]).ok().and_then(|y| y.parse::<u32>().ok())
                {
                    bytes[d..d + 4].copy_from_slice(format!("{:04}", year - 1).as_bytes());
                    if &bytes[d + 4..d + 8] == b"0229" {
                        bytes[d + 7] = b'8';
                    }
                }
            }
        }
        i += 1;
    }
    bytes
}

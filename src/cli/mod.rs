//! Command line: `lightfoot copy`, `lightfoot serve`, `lightfoot cache stat|evict`, `lightfoot
//! run`, `lightfoot bitmap`. The only place that prints and chooses exit codes: 0 success, 1 failure, 2 usage
//! error, 130 interrupted, 141 broken pipe (copy to `-`); `run` exits with its command's status.

use clap::{Parser, Subcommand};

mod bitmap;
mod cache;
mod copy;
mod generate;
mod human;
mod progress;
mod run;
mod serve;
mod watch;

#[derive(Parser)]
#[command(
    name = "lightfoot",
    version,
    about = "Copy and serve disk images without trampling the page cache",
    long_about = "Copy and serve disk images and large files without trampling the host's page \
cache. By default every command is cache-neutral (pages cached before the job stay cached, pages \
the job brought in are gone when it ends) and durable (success means the data reached stable \
storage).",
    propagate_version = true,
    after_long_help = "Exit status: 0 success, 1 failure, 2 usage error, 130 interrupted (copy), 141 \
DST - closed early (copy); run: CMD's own, 125 its own failure, 126/127 CMD not executable/not \
found. `lightfoot COMMAND --help` tells more. Documentation: docs/ (README.md, docs/copy.md, \
docs/serve.md, docs/cache.md, docs/cache-policy.md, docs/run.md, docs/bitmap.md; every error message: \
docs/errors.md)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Copy(copy::CopyArgs),
    Serve(serve::ServeArgs),
    #[command(
        subcommand,
        after_long_help = "Exit status: 0 if every file was done, 1 otherwise, 2 usage error. See docs/cache.md \
and docs/errors.md."
    )]
    Cache(cache::CacheCommand),
    Run(run::RunArgs),
    #[command(
        subcommand,
        after_long_help = "Run these while no server writes through the bitmaps (they are refused \
otherwise). Exit status: 0 success, 1 failure, 2 usage error. See docs/bitmap.md and docs/incremental.md."
    )]
    Bitmap(bitmap::BitmapCommand),
}

/// Exit status for a usage error (clap's own and lightfoot's: [`usage_error`]).
pub const EXIT_USAGE: i32 = 2;
/// Exit status for an interrupted job (128 + SIGINT, as shells report it).
pub const EXIT_INTERRUPTED: i32 = 130;
/// stdout's reader went away: the status a process killed by SIGPIPE reports (128 + 13).
pub const EXIT_BROKEN_PIPE: i32 = 141;

pub fn run() -> i32 {
    // `lightfoot __generate …` (man pages and completions, for `make install`) is not part of
    // `Cli`, so neither --help nor the completions offer it (generate.rs says why).
    if std::env::args_os().nth(1).is_some_and(|a| a == generate::COMMAND) {
        return generate::run(std::env::args_os().skip(1));
    }
    // `lightfoot __watch …` is `lightfoot run`'s watcher process, hidden the same way.
    if std::env::args_os().nth(1).is_some_and(|a| a == watch::COMMAND) {
        return watch::run(std::env::args_os().skip(1));
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Copy(args) => copy::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Cache(cmd) => cache::run(cmd),
        Command::Run(args) => run::run(args),
        Command::Bitmap(cmd) => bitmap::run(cmd),
    }
}

/// Logging to stderr: warnings by default, `-v` info (the mechanisms chosen and why), `-vv`
/// debug. `RUST_LOG` overrides.
pub fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("lightfoot={level}")));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .without_time()
        .try_init();
}

/// Parses one of lightfoot's named values (`--cache`, `--fadvise`, mechanisms).
pub fn parse_enum<T: std::str::FromStr<Err = lightfoot::Error>>(s: &str) -> Result<T, String> {
    s.parse().map_err(|e: lightfoot::Error| e.to_string())
}

/// The object-storage options `copy` and `serve` share (docs/object-storage.md).
#[derive(clap::Args)]
pub struct S3Args {
    /// Block objects of this size for an s3:// image, named KEY/%016x as nbdkit's S3 plugin
    /// names them (a missing object reads as zeroes): the layout of a new image (serve, or
    /// copy's DST), or of one nbdkit made (no manifest), with --size. Later opens read it from
    /// the image's manifest. Without it a new s3:// image is one object (copy's DST; serve
    /// only reads one).
    #[arg(long, value_name = "SIZE", help_heading = "Object storage", value_parser = parse_object_size)]
    pub object_size: Option<u64>,

    /// The size of an s3:// block image that has no manifest: a new one (serve) or one nbdkit
    /// made (its size=). A multiple of --object-size.
    #[arg(
        long,
        value_name = "SIZE",
        help_heading = "Object storage",
        value_parser = lightfoot::copy::endpoint::parse_size,
        requires = "object_size"
    )]
    pub size: Option<u64>,

    /// Take the lease of an s3:// block image even though another writer holds it: for a
    /// writer that died without releasing it. A live writer loses it and stops writing within
    /// about 10 s; until then both may write.
    #[arg(long, help_heading = "Object storage")]
    pub break_lease: bool,

    /// Write an s3:// block image without taking its lease: nothing then stops a second
    /// writer. Needed on stores that do not enforce conditional writes (checked at open).
    #[arg(long, help_heading = "Object storage", conflicts_with = "break_lease")]
    pub without_lease: bool,
}

impl S3Args {
    /// The options of an open; `writable` for a server's image (a copy's destination sets it
    /// itself).
    pub fn options(&self, writable: bool) -> lightfoot::backend::s3::S3Options {
        lightfoot::backend::s3::S3Options {
            writable,
            size: self.size,
            object_size: self.object_size,
            break_lease: self.break_lease,
            without_lease: self.without_lease,
            ..Default::default()
        }
    }
}

/// The mechanism overrides `copy` and `serve` share (docs/cache-policy.md, "Overrides").
#[derive(clap::Args)]
pub struct MechanismArgs {
    /// Never use RWF_DONTCACHE (fall back to O_DIRECT reads and write-behind writes).
    #[arg(long, help_heading = "Advanced")]
    no_dontcache: bool,

    /// Force the read mechanism: buffered, dontcache, direct or evict-behind.
    #[arg(long, value_name = "MECH", help_heading = "Advanced", value_parser = parse_enum::<lightfoot::io::ReadMech>)]
    read_mechanism: Option<lightfoot::io::ReadMech>,

    /// Force the write mechanism: buffered, dontcache, write-behind or direct.
    #[arg(long, value_name = "MECH", help_heading = "Advanced", value_parser = parse_enum::<lightfoot::io::WriteMech>)]
    write_mechanism: Option<lightfoot::io::WriteMech>,
}

impl MechanismArgs {
    /// The overrides as the io layer takes them, with the environment applied.
    pub fn tuning(
        &self,
        fadvise: Option<lightfoot::io::Fadvise>,
        many_in_flight: bool,
    ) -> lightfoot::io::Tuning {
        lightfoot::io::Tuning {
            no_dontcache: self.no_dontcache,
            no_cachestat: false,
            read: self.read_mechanism,
            write: self.write_mechanism,
            fadvise,
            many_in_flight,
        }
        .with_env()
    }
}

/// Prints an error the way every command does.
pub fn report(err: &dyn std::fmt::Display) {
    eprintln!("lightfoot: {err}");
}

/// A usage error that clap cannot see (arguments that are wrong together, or an endpoint that
/// does not parse), printed as clap prints its own, with `command`'s usage; the exit status.
pub fn usage_error(command: &str, msg: impl std::fmt::Display) -> i32 {
    use clap::CommandFactory;
    let mut cli = Cli::command();
    cli.build();
    let err = match cli.find_subcommand_mut(command) {
        Some(sub) => sub.error(clap::error::ErrorKind::ValueValidation, msg),
        None => cli.error(clap::error::ErrorKind::ValueValidation, msg),
    };
    let _ = err.print();
    EXIT_USAGE
}

/// Writes `text` to standard output. A reader that went away (`| head -1`) is not a failure
/// (print! would panic); another error is said on stderr.
pub fn print_out(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            report(&format!("write standard output: {}", lightfoot::error::io_message(&e)));
        }
    }
}

/// `--object-size`: the bytes of each block object of an s3:// image.
fn parse_object_size(s: &str) -> Result<u64, String> {
    let n = lightfoot::copy::endpoint::parse_size(s).map_err(|e| e.to_string())?;
    if !(512..=1 << 30).contains(&n) {
        return Err(format!("object size must be between 512 and 1G, not {s}"));
    }
    Ok(n)
}

//! `lightfoot __generate man|completion`: the man pages and shell completions, rendered from
//! the clap definitions that parse the command line, so each flag is written once and feeds
//! `--help`, the pages and the completions alike. `make install` runs it with the binary it
//! installs, so the pages always describe that binary.
//!
//! Why a command of the binary: the definitions live in the binary's `cli` module, and the
//! library stays free of clap. An xtask or an example would have to include `src/cli` by path
//! (and compile every command's `run` with it); a `build.rs` could not see them at all.
//!
//! Why not a hidden clap subcommand of [`super::Cli`]: clap_complete writes hidden
//! subcommands into the completions too, so `lightfoot <TAB>` would offer `__generate`.
//! [`super::run`] hands the arguments here when the first one is [`COMMAND`], before clap
//! parses; `--help`, the pages and the completions never see it.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Command, CommandFactory, Parser};
use clap_complete::{Generator, Shell};
use clap_mangen::roff::{bold, roman, Roff};
use clap_mangen::Man;

/// The first argument that selects this command.
pub const COMMAND: &str = "__generate";

/// Write lightfoot's man pages or shell completions (for `make install`).
#[derive(Parser)]
#[command(name = "lightfoot __generate", bin_name = "lightfoot __generate")]
enum Generate {
    /// Write lightfoot.1 and one page per command (lightfoot-copy.1, lightfoot-cache-stat.1, …)
    /// into DIR.
    Man {
        /// The pages' date, YYYY-MM-DD (`make install` passes the day the binary was built, or
        /// SOURCE_DATE_EPOCH's).
        #[arg(long)]
        date: String,

        /// An existing directory, e.g. /usr/local/share/man/man1.
        dir: PathBuf,
    },
    /// Print the completion script for SHELL.
    Completion { shell: Shell },
}

/// Runs `lightfoot __generate …`; `args` are the process's arguments after the program name,
/// [`COMMAND`] first.
pub fn run(args: impl IntoIterator<Item = OsString>) -> i32 {
    // COMMAND stands where clap expects the program name; bin_name above is what it prints.
    let result = match Generate::parse_from(args) {
        Generate::Man { date, dir } => man_pages(&dir, &date),
        Generate::Completion { shell } => completion(shell),
    };
    match result {
        Ok(()) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => super::EXIT_BROKEN_PIPE,
        Err(e) => {
            super::report(&e);
            1
        }
    }
}

fn completion(shell: Shell) -> std::io::Result<()> {
    let mut cmd = super::Cli::command();
    cmd.set_bin_name("lightfoot");
    cmd.build();
    let mut script = Vec::new();
    shell.try_generate(&cmd, &mut script)?;
    std::io::stdout().lock().write_all(&script)
}

/// One page per command, as git and nbdkit do (`lightfoot-cache-stat.1`), so `man
/// lightfoot-copy` shows only what `copy` takes.
fn man_pages(dir: &Path, date: &str) -> std::io::Result<()> {
    // No pages for the `help` subcommand: it only prints what the pages already say.
    let mut root = super::Cli::command().disable_help_subcommand(true);
    root.build();
    let mut commands = Vec::new();
    collect(&root, &mut commands);
    let names: Vec<&str> = commands.iter().map(page_name).collect();
    for cmd in &commands {
        let mut page = Vec::new();
        render(cmd, &names, date, &mut page)?;
        let page = one_preamble(&String::from_utf8_lossy(&page));
        let path = dir.join(format!("{}.1", page_name(cmd)));
        std::fs::write(&path, page)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

fn collect(cmd: &Command, out: &mut Vec<Command>) {
    out.push(cmd.clone());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        collect(sub, out);
    }
}

/// `lightfoot-cache-stat` for `lightfoot cache stat` (clap sets it when building).
fn page_name(cmd: &Command) -> &str {
    cmd.get_display_name().unwrap_or_else(|| cmd.get_name())
}

/// clap_mangen's sections, with two of ours: DETAILS (clap_mangen's EXTRA joins every line of
/// the text after the options into one paragraph, and that text has tables and examples laid
/// out by hand) and SEE ALSO.
fn render(cmd: &Command, pages: &[&str], date: &str, w: &mut dyn Write) -> std::io::Result<()> {
    let name = page_name(cmd);
    let version = cmd.get_version().unwrap_or_default();
    // Titles in capitals, as man-pages(7) asks. Source names lightfoot, not the subcommand
    // (clap_mangen's default would say "copy 0.1.0").
    let man = Man::new(cmd.clone())
        .title(name.to_uppercase())
        .date(date)
        .source(format!("lightfoot {version}"))
        .manual("lightfoot manual");
    man.render_title(w)?;
    // Neither hyphenated nor justified: a hyphen added to cachestat(2) or
    // LIGHTFOOT_NO_DONTCACHE would be copied with it, and justified synopses spread apart.
    let mut layout = Roff::default();
    layout.control("nh", []).control("ad", ["l"]);
    layout.to_writer(w)?;
    man.render_name_section(w)?;
    man.render_synopsis_section(w)?;
    man.render_description_section(w)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(w)?;
    }
    if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
        man.render_subcommands_section(w)?;
    }
    details(cmd, w)?;
    man.render_version_section(w)?;
    see_also(name, pages, w)
}

/// Each of clap_mangen's sections comes with the roff crate's preamble (two lines defining
/// the apostrophe string `Aq`): the page keeps the first.
fn one_preamble(page: &str) -> String {
    let mut definitions = 0;
    let mut out = String::with_capacity(page.len());
    for line in page.lines() {
        if line.contains(" .ds Aq ") {
            definitions += 1;
            if definitions > 2 {
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// The text after the options (`after_long_help`): paragraphs stay paragraphs, prose is
/// filled to the reader's width, and indented lines (tables, examples) are kept as they are.
fn details(cmd: &Command, w: &mut dyn Write) -> std::io::Result<()> {
    let Some(text) = cmd.get_after_long_help().or_else(|| cmd.get_after_help()) else {
        return Ok(());
    };
    let mut roff = Roff::default();
    roff.control("SH", ["DETAILS"]);
    for (i, paragraph) in text.to_string().split("\n\n").enumerate() {
        if i > 0 {
            roff.control("PP", []);
        }
        let mut verbatim = false;
        for line in paragraph.lines() {
            let indented = line.starts_with(' ');
            if indented != verbatim {
                roff.control(if indented { "nf" } else { "fi" }, []);
                verbatim = indented;
            }
            roff.text([roman(line)]);
        }
        if verbatim {
            roff.control("fi", []);
        }
    }
    roff.to_writer(w)
}

fn see_also(name: &str, pages: &[&str], w: &mut dyn Write) -> std::io::Result<()> {
    let mut roff = Roff::default();
    roff.control("SH", ["SEE ALSO"]);
    let others: Vec<&str> = pages.iter().copied().filter(|p| *p != name).collect();
    for (i, page) in others.iter().enumerate() {
        let sep = if i + 1 < others.len() { "(1)," } else { "(1)" };
        roff.text([bold(*page), roman(sep)]);
    }
    roff.control("PP", []);
    roff.text([roman(
        "The guides in lightfoot's source tree: README.md, and docs/ (copy.md, serve.md, \
         cache.md, cache-policy.md, tls.md, run.md, bitmap.md, incremental.md).",
    )]);
    roff.to_writer(w)
}

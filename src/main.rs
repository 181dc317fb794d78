//! The `lightfoot` binary: parses the command line, runs one command, prints, exits.
//! Everything else lives in the library.

mod cli;

fn main() {
    std::process::exit(cli::run());
}

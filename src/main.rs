//! The `lightfoot` binary: parses the command line, runs one command, prints, exits.
//! Everything else lives in the library.

// A crate of its own: the library's `deny(unsafe_code)` does not reach it. The binary has no
// business with `unsafe`; the system calls it needs are wrapped in `lightfoot::io::sys`.
#![deny(unsafe_code)]

mod cli;

fn main() {
    std::process::exit(cli::run());
}

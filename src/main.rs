//! The imgbuild command line: flags become library calls; results become
//! text or `--output json`. Errors become one message and a non-zero exit.

mod cli;

fn main() {
    std::process::exit(cli::run());
}

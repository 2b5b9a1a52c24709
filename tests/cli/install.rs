//! `make install`, the man page and the shell completions: what a user
//! installs must work where it lands.

use std::path::Path;
use std::process::Command;

use crate::common;
use common::{root, text};

fn installed(prefix: &Path) {
    let o = Command::new("make")
        .arg("install")
        .arg(format!("PREFIX={}", prefix.display()))
        .arg(format!("BIN={}", env!("CARGO_BIN_EXE_imgbuild")))
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "{}\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
}

#[test]
fn make_install_puts_a_working_binary_man_page_and_completions_under_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("usr");
    installed(&prefix);

    let o = Command::new(prefix.join("bin/imgbuild"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(o.status.success());
    let help = text(&o.stdout);
    assert!(
        help.contains("Usage: imgbuild") && help.contains("plan"),
        "{help}"
    );
    assert!(
        help.contains("Exit codes: 0 ok, 1 failure, 2 usage error"),
        "{help}"
    );

    // man renders the page (man-db is installed by `make deps`).
    let page = prefix.join("share/man/man1/imgbuild.1");
    let o = Command::new("man")
        .arg("-l")
        .arg(&page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .output()
        .expect("man is installed (make deps)");
    assert!(o.status.success(), "{}", text(&o.stderr));
    // man justifies lines with extra spaces: compare words.
    let rendered = text(&o.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for needle in [
        "imgbuild - Per-node Talos Linux images",
        "SUBCOMMANDS",
        "imgbuild-plan",
        "Exit codes",
    ] {
        assert!(rendered.contains(needle), "{needle} missing:\n{rendered}");
    }
    assert!(
        !rendered.contains("\\f"),
        "raw roff escapes in:\n{rendered}"
    );

    // bash accepts the completion script, and it completes subcommands.
    let bash = prefix.join("share/bash-completion/completions/imgbuild");
    let o = Command::new("bash").arg("-n").arg(&bash).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let script = format!(
        "source {}; COMP_WORDS=(imgbuild pl); COMP_CWORD=1; _imgbuild imgbuild pl imgbuild; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        bash.display()
    );
    let o = Command::new("bash").args(["-c", &script]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).lines().any(|l| l == "plan"),
        "{}",
        text(&o.stdout)
    );

    let zsh = std::fs::read_to_string(prefix.join("share/zsh/site-functions/_imgbuild")).unwrap();
    assert!(zsh.starts_with("#compdef imgbuild"), "{zsh:.80}");
    let fish =
        std::fs::read_to_string(prefix.join("share/fish/vendor_completions.d/imgbuild.fish"))
            .unwrap();
    assert!(fish.contains("complete -c imgbuild"), "{fish:.200}");
    // Where the shells exist, they parse their scripts too.
    for (shell, file) in [
        ("zsh", "share/zsh/site-functions/_imgbuild"),
        ("fish", "share/fish/vendor_completions.d/imgbuild.fish"),
    ] {
        if Command::new(shell).arg("--version").output().is_ok() {
            let o = Command::new(shell)
                .arg("-n")
                .arg(prefix.join(file))
                .output()
                .unwrap();
            assert!(o.status.success(), "{shell}: {}", text(&o.stderr));
        }
    }
}

#[test]
fn completions_for_an_unknown_shell_are_a_usage_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o.stderr).contains("bash"), "{}", text(&o.stderr));
}

/// `make demo` and `make install` run the binaries where cargo put them,
/// also when CARGO_TARGET_DIR moves them (a shared target folder, a CI
/// cache). `make -n` shows the commands without building anything.
#[test]
fn make_runs_the_binaries_where_cargo_puts_them() {
    let dry_run = |target: &str, target_dir: Option<&Path>| {
        let mut make = Command::new("make");
        make.args(["-n", target, "PREFIX=/nonexistent"])
            .arg(format!("CARGO={}", env!("CARGO")))
            .current_dir(root());
        match target_dir {
            Some(dir) => make.env("CARGO_TARGET_DIR", dir),
            None => make.env_remove("CARGO_TARGET_DIR"),
        };
        let o = make.output().unwrap();
        assert!(o.status.success(), "make -n {target}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    let elsewhere = tempfile::tempdir().unwrap();
    let at = |rel: &str| elsewhere.path().join(rel).display().to_string();
    let demo = dry_run("demo", Some(elsewhere.path()));
    for cmd in [
        "debug/imgbuild-sim factory",
        "debug/imgbuild-sim proxmox",
        "debug/imgbuild --config",
    ] {
        assert!(
            demo.contains(&at(cmd)),
            "{cmd} not under {}:\n{demo}",
            at("")
        );
    }
    assert!(!demo.contains("target/debug"), "{demo}");
    let install = dry_run("install", Some(elsewhere.path()));
    assert!(
        install.contains(&format!("bin=\"{}\"", at("release/imgbuild"))),
        "{install}"
    );
    // As this test runs: the demo runs the very binary under test.
    let built = Path::new(env!("CARGO_BIN_EXE_imgbuild"));
    let here = std::env::var_os("CARGO_TARGET_DIR").map(std::path::PathBuf::from);
    let demo = dry_run("demo", here.as_deref());
    assert!(
        demo.contains(&format!("{} --config", built.display())),
        "{} not in:\n{demo}",
        built.display()
    );
}

#[test]
fn version_names_the_build_s_commit_and_the_talos_minors_it_knows() {
    let o = Command::new(env!("CARGO_BIN_EXE_imgbuild"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(o.status.success());
    let v = text(&o.stdout);
    assert!(
        v.starts_with(&format!("imgbuild {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{v}"
    );
    // A test build is a debug build: it says so rather than a stale commit.
    assert!(
        v.contains("(commit unknown (a debug build); Talos v1.9–v1.14)"),
        "{v}"
    );
}

//! Library code returns typed errors (issue 36): no `Result<_, String>`, no
//! `Box<dyn Error>` and no anyhow in `src/talos` and `src/up`, so a caller
//! matches on what went wrong instead of on a sentence.

use std::path::{Path, PathBuf};

use crate::common::root;

/// The `.rs` files under `dir` (or `dir` itself), sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    if dir.is_file() {
        out.push(dir.to_path_buf());
        return;
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The text with `//` comments blanked (line numbers kept), so prose that
/// names the banned shapes is not mistaken for code.
fn without_comments(src: &str) -> String {
    src.lines()
        .map(|line| match line.find("//") {
            Some(at) if !line[..at].contains('"') => &line[..at],
            _ => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The type arguments of the generic whose `<` is at `open`, split at
/// top-level commas, whitespace collapsed; `None` if it never closes.
fn type_args(text: &str, open: usize) -> Option<Vec<String>> {
    let mut depth = 0usize;
    let mut args = vec![String::new()];
    for c in text[open..].chars() {
        match c {
            '<' | '(' | '[' => {
                depth += 1;
                if depth == 1 {
                    continue;
                }
            }
            '>' | ')' | ']' => {
                depth -= 1;
                if depth == 0 {
                    let args = args
                        .into_iter()
                        .map(|a| a.split_whitespace().collect::<Vec<_>>().join(" "))
                        .filter(|a| !a.is_empty())
                        .collect();
                    return Some(args);
                }
            }
            ',' if depth == 1 => {
                args.push(String::new());
                continue;
            }
            _ => {}
        }
        args.last_mut().unwrap().push(c);
    }
    None
}

/// Why the generic (`Result<`, `Ok::<`) at `at` is untyped, if it is.
fn untyped(text: &str, at: usize) -> Option<String> {
    let open = at + text[at..].find('<')?;
    let args = type_args(text, open)?;
    let err = args.get(1)?;
    let stringly = ["String", "std::string::String", "alloc::string::String"];
    let boxed = err.starts_with("Box<dyn") && err.contains("Error");
    (stringly.contains(&err.as_str()) || boxed || err.starts_with("anyhow::"))
        .then(|| format!("{}<{}>", text[at..open].trim(), args.join(", ")))
}

/// Every untyped error in `src`: `(line, what)`.
fn untyped_errors(src: &str) -> Vec<(usize, String)> {
    let text = without_comments(src);
    let mut found = Vec::new();
    for word in ["Result", "Ok::", "Err::"] {
        found.extend(generic_errors(&text, word));
    }
    for (i, line) in text.lines().enumerate() {
        if line.contains("anyhow") {
            found.push((i + 1, "anyhow".into()));
        }
    }
    found.sort();
    found
}

/// Each `word<…>` (`Result<T, E>`, or a turbofish `Ok::<T, E>` that
/// spells a result's types) whose error type is untyped.
fn generic_errors(text: &str, word: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(hit) = text[from..].find(word) {
        let at = from + hit;
        from = at + word.len();
        let before = text[..at].chars().next_back();
        let after = text[from..].trim_start();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') || !after.starts_with('<') {
            continue;
        }
        if let Some(what) = untyped(text, at) {
            found.push((text[..at].matches('\n').count() + 1, what));
        }
    }
    found
}

#[test]
fn the_scanner_sees_through_whitespace_newlines_and_nested_types() {
    let src = "fn a() -> Result<(), String> {}\n\
               fn b() -> Result<\n    Vec<(String, u8)>,\n    String,\n> {}\n\
               fn c() -> Result<Vec<u8>, Box<dyn std::error::Error>> {}\n\
               // fn d() -> Result<(), String> {}\n\
               fn e() -> Result<String, MyError> {}\n\
               fn f() -> io::Result<String> {}\n\
               let g = async { Ok::<_, String>(1) };\n";
    let lines: Vec<usize> = untyped_errors(src).into_iter().map(|(l, _)| l).collect();
    assert_eq!(lines, [1, 2, 6, 10]);
}

#[test]
fn no_string_errors_in_talos_and_up() {
    let mut files = Vec::new();
    for part in ["src/talos", "src/up", "src/up.rs"] {
        rust_files(&root().join(part), &mut files);
    }
    assert!(files.len() > 20, "found only {files:?}");
    let mut found = Vec::new();
    for path in &files {
        let src = std::fs::read_to_string(path).unwrap();
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        for (line, what) in untyped_errors(&src) {
            found.push(format!("{rel}:{line}: {what}"));
        }
    }
    assert!(
        found.is_empty(),
        "untyped errors ({}), return a thiserror enum instead:\n{}",
        found.len(),
        found.join("\n")
    );
}

//! The module structure, measured (issue 21). The import graph of `src/` at
//! file granularity — the library (crate root `src/lib.rs`) and the binary
//! (`src/main.rs` and `src/cli/`, whose `imgbuild::` paths point into the
//! library) — has no cycle, the library's top-level modules keep the layer
//! order of docs/architecture.md, the library never reaches into the binary,
//! and that document's module table lists exactly the modules and imports the
//! code has.
//!
//! The sources are read as text (std only): a small Rust lexer drops comments,
//! string and char literals and `#[cfg(test)]` items, then `use` trees,
//! `crate::`/`super::`/`self::`/`imgbuild::` paths, paths through a child
//! module or through a name a `use` brought in become edges, each resolved to
//! the longest module prefix that is a file (`crate::disk::Magic` → `disk`).
//! A `mod x;` declaration alone is not an edge.
//!
//! The simulators (`sim/src`, crate root `sim/src/main.rs`) are a graph of
//! their own, read by the same checker: no cycle, no file over 1,200 lines,
//! no `#[path]`, and the document's `## Simulator modules` table exact.
//!
//! `cargo test --test repo architecture:: -- --nocapture` prints the figures; when
//! the document is stale, the failure prints the table rows to paste.
// A test's stderr is libtest's to capture, not the CLI's one writer.
#![allow(clippy::disallowed_macros)]

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::OnceLock;

// ---------------------------------------------------------------- lexer

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    /// `::`
    Sep,
    Punct(char),
    /// A string, char or number literal, a lifetime or a label: content dropped.
    Lit,
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// From `i`, just past an opening `"`, to just past the closing one.
fn skip_string(c: &[char], mut i: usize, line: &mut usize) -> usize {
    while i < c.len() {
        match c[i] {
            '\\' => {
                if c.get(i + 1) == Some(&'\n') {
                    *line += 1;
                }
                i += 2;
            }
            '"' => return i + 1,
            ch => {
                if ch == '\n' {
                    *line += 1;
                }
                i += 1;
            }
        }
    }
    i
}

/// From `i`, at a `'`, past a char literal or a lifetime/label.
fn skip_quote(c: &[char], i: usize) -> usize {
    if c.get(i + 1) == Some(&'\\') {
        // '\n', '\'', '\\', '\u{1F600}': the escaped char, then up to the quote.
        let mut j = i + 3;
        while j < c.len() && c[j] != '\'' {
            j += 1;
        }
        j + 1
    } else if c.get(i + 2) == Some(&'\'') {
        i + 3
    } else {
        let mut j = i + 1;
        while j < c.len() && is_ident_char(c[j]) {
            j += 1;
        }
        j
    }
}

fn lex(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let n = c.len();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < n {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
            i = skip_string(&c, i + 1, &mut line);
        } else if ch == '\'' {
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
            i = skip_quote(&c, i);
        } else if ch.is_ascii_digit() {
            while i < n
                && (is_ident_char(c[i])
                    || (c[i] == '.' && c.get(i + 1).is_some_and(|d| d.is_ascii_digit())))
            {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Lit,
                line,
            });
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < n && is_ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let at = c.get(i).copied();
            let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
            match (word.as_str(), at) {
                ("b" | "c", Some('"')) => {
                    out.push(Token {
                        tok: Tok::Lit,
                        line,
                    });
                    i = skip_string(&c, i + 1, &mut line);
                }
                ("b", Some('\'')) => {
                    out.push(Token {
                        tok: Tok::Lit,
                        line,
                    });
                    i = skip_quote(&c, i);
                }
                ("r" | "br" | "cr", Some('"' | '#')) if c.get(i + hashes) == Some(&'"') => {
                    // Raw string: ends at a quote followed by as many hashes.
                    out.push(Token {
                        tok: Tok::Lit,
                        line,
                    });
                    i += hashes + 1;
                    while i < n {
                        if c[i] == '"'
                            && c[i + 1..].iter().take_while(|&&h| h == '#').count() >= hashes
                        {
                            i += 1 + hashes;
                            break;
                        }
                        if c[i] == '\n' {
                            line += 1;
                        }
                        i += 1;
                    }
                }
                ("r", Some('#'))
                    if c.get(i + 1).is_some_and(|&f| f.is_alphabetic() || f == '_') =>
                {
                    // Raw identifier r#type.
                    let start = i + 1;
                    i = start;
                    while i < n && is_ident_char(c[i]) {
                        i += 1;
                    }
                    out.push(Token {
                        tok: Tok::Ident(c[start..i].iter().collect()),
                        line,
                    });
                }
                _ => out.push(Token {
                    tok: Tok::Ident(word),
                    line,
                }),
            }
        } else if ch == ':' && next == Some(':') {
            out.push(Token {
                tok: Tok::Sep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
    out
}

// ---------------------------------------------------------------- scanner

/// A path a file refers to, as written, with the inline-module scope it was
/// written in (relative to the file's own module).
#[derive(Debug, Clone)]
struct Ref {
    scope: Vec<String>,
    segs: Vec<String>,
    line: usize,
    /// For a `use` leaf: the name it binds (`None` for a glob or `as _`).
    binds: Option<String>,
    is_use: bool,
}

#[derive(Debug, Default)]
struct Scan {
    /// `mod x;` at file level, outside `#[cfg(test)]`: (name, line).
    mods: Vec<(String, usize)>,
    /// `#[cfg(test)] mod x;`: files that are test code only.
    test_mods: Vec<String>,
    /// Inline `mod x { … }` outside tests, as paths relative to the file's module.
    inline: BTreeSet<Vec<String>>,
    refs: Vec<Ref>,
    /// `#![cfg(test)]` at the top: the whole file is test code.
    test_only: bool,
}

fn ident(t: &[Token], i: usize) -> Option<&str> {
    match t.get(i).map(|t| &t.tok) {
        Some(Tok::Ident(w)) => Some(w),
        _ => None,
    }
}

fn punct(t: &[Token], i: usize, p: char) -> bool {
    matches!(t.get(i).map(|t| &t.tok), Some(Tok::Punct(c)) if *c == p)
}

fn sep(t: &[Token], i: usize) -> bool {
    matches!(t.get(i).map(|t| &t.tok), Some(Tok::Sep))
}

/// The index of the bracket closing the one at `open`.
fn matching(t: &[Token], open: usize) -> usize {
    let mut depth = 0i32;
    for (k, tok) in t.iter().enumerate().skip(open) {
        match tok.tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    t.len()
}

/// `cfg(test)` or `cfg(all(test, …))`: code that exists only in tests.
fn is_cfg_test(body: &[Token]) -> bool {
    let words: Vec<&Tok> = body.iter().map(|t| &t.tok).collect();
    let id = |k: usize, w: &str| matches!(words.get(k), Some(Tok::Ident(x)) if x == w);
    let p = |k: usize, c: char| matches!(words.get(k), Some(Tok::Punct(x)) if *x == c);
    id(0, "cfg") && p(1, '(') && (id(2, "test") || (id(2, "all") && p(3, '(') && id(4, "test")))
}

const ITEM_WORDS: &[&str] = &[
    "fn",
    "mod",
    "impl",
    "struct",
    "enum",
    "union",
    "use",
    "const",
    "static",
    "trait",
    "type",
    "macro_rules",
    "extern",
];

/// From `i` (just past a `#[cfg(test)]`), past the item or statement it gates.
/// Records `mod x;` it gates as a test-only file.
fn skip_gated(t: &[Token], mut i: usize, test_mods: &mut Vec<String>) -> usize {
    // Further attributes on the same item.
    while punct(t, i, '#') && punct(t, i + 1, '[') {
        i = matching(t, i + 1) + 1;
    }
    let mut k = i;
    while matches!(ident(t, k), Some("pub" | "async" | "unsafe" | "default")) {
        k += 1;
        if punct(t, k, '(') {
            k = matching(t, k) + 1;
        }
    }
    if ident(t, k) == Some("mod") && punct(t, k + 2, ';') {
        test_mods.push(ident(t, k + 1).unwrap_or_default().to_string());
    }
    let item = ident(t, k).is_some_and(|w| ITEM_WORDS.contains(&w));
    let mut depth = 0i32;
    while i < t.len() {
        match t[i].tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(c @ (')' | ']' | '}')) => {
                if depth == 0 {
                    return i; // the gated thing was the last in its list
                }
                depth -= 1;
                if depth == 0 && c == '}' {
                    return i + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return i + 1,
            Tok::Punct(',') if depth == 0 && !item => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// One `use` tree from `i`; its leaves go to `out`. Returns the index past it.
fn use_tree(
    t: &[Token],
    mut i: usize,
    prefix: &mut Vec<String>,
    out: &mut Vec<(Vec<String>, Option<String>, usize)>,
) -> usize {
    let base = prefix.len();
    if sep(t, i) {
        prefix.push("::".into()); // `::name`: an external crate
        i += 1;
    }
    loop {
        let line = t.get(i).map_or(0, |t| t.line);
        if let Some(w) = ident(t, i) {
            prefix.push(w.to_string());
            i += 1;
            if sep(t, i) {
                i += 1;
                continue;
            }
            let mut binds = prefix.last().cloned();
            if binds.as_deref() == Some("self") {
                prefix.pop();
                binds = prefix.last().cloned();
            }
            if ident(t, i) == Some("as") {
                binds = ident(t, i + 1).filter(|&a| a != "_").map(str::to_string);
                i += 2;
            }
            out.push((prefix.clone(), binds, line));
        } else if punct(t, i, '*') {
            out.push((prefix.clone(), None, line));
            i += 1;
        } else if punct(t, i, '{') {
            i += 1;
            while i < t.len() && !punct(t, i, '}') {
                i = use_tree(t, i, prefix, out);
                if punct(t, i, ',') {
                    i += 1;
                }
            }
            i += 1;
        } else {
            panic!(
                "line {line}: unexpected {:?} in a use tree",
                t.get(i).map(|t| &t.tok)
            );
        }
        break;
    }
    prefix.truncate(base);
    i
}

fn scan(src: &str) -> Scan {
    let t = lex(src);
    let mut s = Scan::default();
    // Inline modules open around here: (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let scope =
        |inline: &[(String, usize)]| inline.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    let mut depth = 0usize;
    let mut path_attr = false;
    let mut i = 0;
    while i < t.len() {
        match &t[i].tok {
            Tok::Punct('#') => {
                let inner = punct(&t, i + 1, '!');
                let open = if inner { i + 2 } else { i + 1 };
                if !punct(&t, open, '[') {
                    i += 1;
                    continue;
                }
                let close = matching(&t, open);
                let body = &t[open + 1..close.min(t.len())];
                i = close + 1;
                if is_cfg_test(body) {
                    if inner && depth == 0 && inline.is_empty() {
                        s.test_only = true;
                        return s;
                    }
                    i = skip_gated(&t, i, &mut s.test_mods);
                } else if ident(body, 0) == Some("path") && punct(body, 1, '=') {
                    path_attr = true;
                }
            }
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
            }
            Tok::Ident(w) if w == "mod" && ident(&t, i + 1).is_some() => {
                let name = ident(&t, i + 1).unwrap().to_string();
                let line = t[i].line;
                if punct(&t, i + 2, ';') {
                    assert!(
                        !path_attr,
                        "line {line}: #[path] on `mod {name};` is not understood by this checker"
                    );
                    assert!(
                        inline.is_empty(),
                        "line {line}: `mod {name};` inside an inline module is not understood by this checker"
                    );
                    s.mods.push((name, line));
                } else if punct(&t, i + 2, '{') {
                    depth += 1;
                    inline.push((name, depth));
                    s.inline.insert(scope(&inline));
                }
                path_attr = false;
                i += 3;
            }
            Tok::Ident(w) if w == "use" && !punct(&t, i + 1, '<') => {
                let mut leaves = Vec::new();
                i = use_tree(&t, i + 1, &mut Vec::new(), &mut leaves);
                for (segs, binds, line) in leaves {
                    s.refs.push(Ref {
                        scope: scope(&inline),
                        segs,
                        line,
                        binds,
                        is_use: true,
                    });
                }
            }
            Tok::Ident(first)
                if !sep(&t, i.wrapping_sub(1)) && sep(&t, i + 1) && ident(&t, i + 2).is_some() =>
            {
                let mut segs = vec![first.clone()];
                let line = t[i].line;
                let mut k = i + 1;
                while sep(&t, k) && ident(&t, k + 1).is_some() {
                    segs.push(ident(&t, k + 1).unwrap().to_string());
                    k += 2;
                }
                s.refs.push(Ref {
                    scope: scope(&inline),
                    segs,
                    line,
                    binds: None,
                    is_use: false,
                });
                i = k;
            }
            _ => i += 1,
        }
    }
    s
}

// ---------------------------------------------------------------- graph

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Crate {
    Lib,
    Bin,
    /// The simulators' binary (`sim/src/main.rs`), a crate of its own graph.
    Sim,
}

#[derive(Debug)]
struct Module {
    krate: Crate,
    /// Path from the crate root (`["disk", "sparse"]`); empty for the root.
    path: Vec<String>,
    /// Relative to the repository (`src/disk/sparse.rs`).
    file: String,
    lines: usize,
    scan: Scan,
}

impl Module {
    /// `disk::sparse`, `cli::board`; the roots are `lib` and `main`.
    fn name(&self) -> String {
        match (self.path.is_empty(), self.krate) {
            (true, Crate::Lib) => "lib".into(),
            (true, Crate::Bin | Crate::Sim) => "main".into(),
            _ => self.path.join("::"),
        }
    }
}

#[derive(Debug)]
struct Edge {
    file: String,
    line: usize,
}

#[derive(Debug)]
struct Graph {
    modules: Vec<Module>,
    /// (from, to) → where the first reference is.
    edges: BTreeMap<(usize, usize), Edge>,
}

/// Loads the module tree of the crate rooted at `root` from `files` (path →
/// text), following `mod x;` declarations. Returns the test-only files seen.
fn load_crate(
    krate: Crate,
    root: &str,
    files: &BTreeMap<String, String>,
    modules: &mut Vec<Module>,
) -> Vec<String> {
    let mut test_files = Vec::new();
    let mut todo = vec![(root.to_string(), Vec::<String>::new())];
    while let Some((file, path)) = todo.pop() {
        let text = &files[&file];
        let scan = scan(text);
        if scan.test_only {
            test_files.push(file.clone());
            continue;
        }
        let dir = {
            let p = Path::new(&file);
            let parent = p.parent().unwrap().to_str().unwrap().to_string();
            match p.file_name().unwrap().to_str().unwrap() {
                "mod.rs" | "lib.rs" | "main.rs" => parent,
                name => format!("{parent}/{}", name.trim_end_matches(".rs")),
            }
        };
        let child_file = |name: &str, line: usize| {
            let found: Vec<String> = [format!("{dir}/{name}.rs"), format!("{dir}/{name}/mod.rs")]
                .into_iter()
                .filter(|f| files.contains_key(f))
                .collect();
            match found.len() {
                1 => Some(found[0].clone()),
                0 => None,
                _ => panic!("{file}:{line}: both {found:?} exist for `mod {name};`"),
            }
        };
        for (name, line) in &scan.mods {
            let child = child_file(name, *line)
                .unwrap_or_else(|| panic!("{file}:{line}: no file for `mod {name};`"));
            let mut p = path.clone();
            p.push(name.clone());
            todo.push((child, p));
        }
        test_files.extend(scan.test_mods.iter().filter_map(|name| child_file(name, 0)));
        modules.push(Module {
            krate,
            path,
            lines: text.lines().count(),
            file,
            scan,
        });
    }
    test_files
}

fn build_graph(files: &BTreeMap<String, String>) -> Graph {
    if files.contains_key("sim/src/main.rs") {
        return graph_of(&[(Crate::Sim, "sim/src/main.rs")], files);
    }
    let mut roots = vec![(Crate::Lib, "src/lib.rs")];
    if files.contains_key("src/main.rs") {
        roots.push((Crate::Bin, "src/main.rs"));
    }
    graph_of(&roots, files)
}

/// The graph of the crates rooted at `roots`; every file of `files` must be
/// reached from one of them.
fn graph_of(roots: &[(Crate, &str)], files: &BTreeMap<String, String>) -> Graph {
    let mut modules = Vec::new();
    let mut test_files = Vec::new();
    for &(krate, root) in roots {
        test_files.extend(load_crate(krate, root, files, &mut modules));
    }
    modules.sort_by(|a, b| (a.krate, &a.path).cmp(&(b.krate, &b.path)));
    let claimed: BTreeSet<&str> = modules
        .iter()
        .map(|m| m.file.as_str())
        .chain(test_files.iter().map(String::as_str))
        .collect();
    let orphans: Vec<&String> = files
        .keys()
        .filter(|f| !claimed.contains(f.as_str()))
        .collect();
    assert!(
        orphans.is_empty(),
        "files no `mod` declaration reaches: {orphans:?}"
    );
    let index: HashMap<(Crate, Vec<String>), usize> = modules
        .iter()
        .enumerate()
        .map(|(k, m)| ((m.krate, m.path.clone()), k))
        .collect();

    let mut edges = BTreeMap::new();
    for (from, m) in modules.iter().enumerate() {
        // An absolute path (crate, segments), or None for something outside both crates.
        type Abs = Option<(Crate, Vec<String>)>;
        let start = |r: &Ref, aliases: &HashMap<String, Abs>| -> Abs {
            let mut here = m.path.clone();
            here.extend(r.scope.iter().cloned());
            let segs = &r.segs;
            let first = segs[0].as_str();
            let rest = || segs[1..].to_vec();
            match first {
                "crate" => Some((m.krate, rest())),
                // The simulators' graph holds no library: its `imgbuild::`
                // paths (the generated protobuf types) lead outside.
                "imgbuild" if m.krate == Crate::Sim => None,
                "imgbuild" => Some((Crate::Lib, rest())),
                "self" => Some((m.krate, [here, rest()].concat())),
                "super" => {
                    let ups = segs.iter().take_while(|s| *s == "super").count();
                    assert!(
                        ups <= here.len(),
                        "{}:{}: super:: above the crate root",
                        m.file,
                        r.line
                    );
                    here.truncate(here.len() - ups);
                    Some((m.krate, [here, segs[ups..].to_vec()].concat()))
                }
                _ => {
                    let mut child = here.clone();
                    child.push(first.to_string());
                    let inline_child = child[m.path.len()..].to_vec();
                    if let Some(target) = aliases.get(first) {
                        target.clone().map(|(k, mut p)| {
                            p.extend(rest());
                            (k, p)
                        })
                    } else if index.contains_key(&(m.krate, child.clone()))
                        || m.scan.inline.contains(&inline_child)
                    {
                        Some((m.krate, [child, rest()].concat()))
                    } else {
                        None
                    }
                }
            }
        };
        // Names the file's `use`s bind; a few rounds so `use a; use a::b;` resolves.
        let mut aliases: HashMap<String, Abs> = HashMap::new();
        for _ in 0..3 {
            for r in m.scan.refs.iter().filter(|r| r.is_use) {
                if let Some(name) = &r.binds {
                    let mut without = aliases.clone();
                    without.remove(name);
                    aliases.insert(name.clone(), start(r, &without));
                }
            }
        }
        for r in &m.scan.refs {
            let Some((krate, path)) = start(r, &aliases) else {
                continue;
            };
            let to = (0..=path.len())
                .rev()
                .find_map(|n| index.get(&(krate, path[..n].to_vec())))
                .copied()
                .unwrap_or_else(|| panic!("{}:{}: {:?} is in no module", m.file, r.line, r.segs));
            if to != from {
                edges.entry((from, to)).or_insert(Edge {
                    file: m.file.clone(),
                    line: r.line,
                });
            }
        }
    }
    Graph { modules, edges }
}

impl Graph {
    fn name(&self, k: usize) -> String {
        self.modules[k].name()
    }

    fn find(&self, name: &str) -> Option<usize> {
        self.modules.iter().position(|m| m.name() == name)
    }

    fn targets(&self, from: usize) -> Vec<usize> {
        self.edges
            .range((from, 0)..(from + 1, 0))
            .map(|(&(_, to), _)| to)
            .collect()
    }

    /// Strongly connected components with more than one module (Tarjan).
    fn circles(&self) -> Vec<Vec<usize>> {
        struct St<'a> {
            g: &'a Graph,
            index: Vec<Option<usize>>,
            low: Vec<usize>,
            on: Vec<bool>,
            stack: Vec<usize>,
            next: usize,
            out: Vec<Vec<usize>>,
        }
        fn visit(s: &mut St, v: usize) {
            s.index[v] = Some(s.next);
            s.low[v] = s.next;
            s.next += 1;
            s.stack.push(v);
            s.on[v] = true;
            for w in s.g.targets(v) {
                match s.index[w] {
                    None => {
                        visit(s, w);
                        s.low[v] = s.low[v].min(s.low[w]);
                    }
                    Some(iw) if s.on[w] => s.low[v] = s.low[v].min(iw),
                    _ => {}
                }
            }
            if Some(s.low[v]) == s.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = s.stack.pop().unwrap();
                    s.on[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    s.out.push(comp);
                }
            }
        }
        let n = self.modules.len();
        let mut s = St {
            g: self,
            index: vec![None; n],
            low: vec![0; n],
            on: vec![false; n],
            stack: Vec::new(),
            next: 0,
            out: Vec::new(),
        };
        for v in 0..n {
            if s.index[v].is_none() {
                visit(&mut s, v);
            }
        }
        s.out.sort();
        s.out
    }

    /// For every edge inside a circle, the shortest cycle through it, each
    /// cycle once (rotated to start at its smallest module).
    fn cycles(&self) -> Vec<Vec<usize>> {
        let mut out = BTreeSet::new();
        for comp in self.circles() {
            let inside: BTreeSet<usize> = comp.iter().copied().collect();
            for &u in &comp {
                for v in self.targets(u).into_iter().filter(|v| inside.contains(v)) {
                    // Shortest path v ⇝ u inside the circle.
                    let mut prev: HashMap<usize, usize> = HashMap::new();
                    let mut queue = VecDeque::from([v]);
                    while let Some(x) = queue.pop_front() {
                        if x == u {
                            break;
                        }
                        for y in self.targets(x) {
                            if inside.contains(&y) && y != v && !prev.contains_key(&y) {
                                prev.insert(y, x);
                                queue.push_back(y);
                            }
                        }
                    }
                    let mut cycle = vec![u];
                    let mut x = u;
                    while x != v {
                        x = prev[&x];
                        cycle.push(x);
                    }
                    cycle.reverse(); // v … u
                    let min = cycle
                        .iter()
                        .position(|x| x == cycle.iter().min().unwrap())
                        .unwrap();
                    cycle.rotate_left(min);
                    out.insert(cycle);
                }
            }
        }
        out.into_iter().collect()
    }

    /// Edges that close a circle: the target depends, directly or not, on the source.
    fn upward(&self) -> Vec<(usize, usize)> {
        let circles = self.circles();
        let comp_of = |v: usize| circles.iter().position(|c| c.contains(&v));
        self.edges
            .keys()
            .filter(|(a, b)| comp_of(*a).is_some() && comp_of(*a) == comp_of(*b))
            .copied()
            .collect()
    }

    fn show_cycle(&self, cycle: &[usize]) -> String {
        let mut names: Vec<String> = cycle.iter().map(|&k| self.name(k)).collect();
        names.push(self.name(cycle[0]));
        let mut s = names.join(" → ");
        for (k, &a) in cycle.iter().enumerate() {
            let b = cycle[(k + 1) % cycle.len()];
            let e = &self.edges[&(a, b)];
            write!(
                s,
                "\n    {} → {}  at {}:{}",
                self.name(a),
                self.name(b),
                e.file,
                e.line
            )
            .unwrap();
        }
        s
    }

    fn figures(&self) -> String {
        let lib = self
            .modules
            .iter()
            .filter(|m| m.krate == Crate::Lib)
            .count();
        let largest = self.modules.iter().max_by_key(|m| m.lines).unwrap();
        format!(
            "modules (files): {} ({lib} library, {} binary); import edges: {}; circles (strongly connected groups): {}; \
             cycles (shortest through each edge): {}; upward edges (on a cycle): {}; largest file: {} ({} lines)",
            self.modules.len(),
            self.modules.len() - lib,
            self.edges.len(),
            self.circles().len(),
            self.cycles().len(),
            self.upward().len(),
            largest.file,
            largest.lines,
        )
    }
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn sources() -> BTreeMap<String, String> {
    sources_under("src")
}

/// Every `.rs` file under `dir` (relative to the repository), path → text.
fn sources_under(dir: &str) -> BTreeMap<String, String> {
    fn walk(dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(repo())
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                out.insert(rel, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&repo().join(dir), &mut out);
    out
}

fn graph() -> &'static Graph {
    static G: OnceLock<Graph> = OnceLock::new();
    G.get_or_init(|| build_graph(&sources()))
}

/// The simulators' crate (`sim/src/main.rs`), as its own graph.
fn sim_graph() -> &'static Graph {
    static G: OnceLock<Graph> = OnceLock::new();
    G.get_or_init(|| build_graph(&sources_under("sim/src")))
}

/// The pass's other promises, held by the code's definitions: the publish
/// target is chosen in one function, no stage has a run twin and a dry-run
/// twin (`foo_stage`/`plan_foo`), and no two public types share the name
/// `Target` or `Outcome`. Declarations are matched on lines of code only
/// (comments skipped), so a test name or a doc sentence does not count.
#[test]
fn one_chooser_no_twins_and_names_that_say_which() {
    let mut choosers = Vec::new();
    let mut twins = Vec::new();
    let mut names: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let sources = sources();
    for (file, text) in &sources {
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            let at = format!("{file}:{}", i + 1);
            let Some(rest) = code.strip_prefix("pub ").or(Some(code)).and_then(|c| {
                c.strip_prefix("fn ")
                    .or_else(|| c.strip_prefix("async fn "))
            }) else {
                for kind in ["pub struct ", "pub enum ", "pub type "] {
                    if let Some(name) = code.strip_prefix(kind) {
                        let name = name
                            .split(|c: char| !c.is_alphanumeric() && c != '_')
                            .next();
                        if let Some(n @ ("Target" | "Outcome")) = name {
                            names.entry(n).or_default().push(at.clone());
                        }
                    }
                }
                continue;
            };
            let name = rest.split(['(', '<']).next().unwrap_or("");
            if name == "from_inventory" {
                choosers.push(at.clone());
            }
            if name.ends_with("_stage") || name.starts_with("plan_") {
                twins.push(at);
            }
        }
    }
    assert_eq!(choosers.len(), 1, "one target chooser, found: {choosers:?}");
    assert!(
        choosers[0].starts_with("src/publish/target.rs:"),
        "{choosers:?}"
    );
    assert!(twins.is_empty(), "run/dry-run twins: {twins:?}");
    for (name, at) in &names {
        assert!(
            at.len() <= 1,
            "{} public types named {name}: {at:?}",
            at.len()
        );
    }
}

// ---------------------------------------------------------------- the document

fn doc() -> String {
    std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md")
}

/// The table rows (cells, trimmed, headers included) of the `## {heading}` section.
fn section_rows(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let start = doc
        .find(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("docs/architecture.md has no `## {heading}` section"));
    let body = &doc[start + heading.len() + 5..];
    let body = &body[..body.find("\n## ").unwrap_or(body.len())];
    body.lines()
        .filter(|l| l.starts_with('|') && !l.starts_with("|--") && !l.starts_with("| --"))
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect()
}

/// `` `a`, `b::c` `` → {a, b::c}; `—` → {}.
fn names(cell: &str) -> BTreeSet<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

// ---------------------------------------------------------------- tests

#[test]
fn the_module_graph_has_no_cycle() {
    let g = graph();
    eprintln!("{}", g.figures());
    let cycles = g.cycles();
    let list: Vec<String> = cycles.iter().map(|c| g.show_cycle(c)).collect();
    for c in &list {
        eprintln!("cycle: {c}");
    }
    assert!(
        cycles.is_empty(),
        "{} import cycles ({} upward edges) — a module imports one that depends on it:\n{}\n\n{}",
        cycles.len(),
        g.upward().len(),
        list.join("\n"),
        g.figures()
    );
}

#[test]
fn the_library_never_reaches_the_binary_and_keeps_its_layers() {
    let g = graph();
    let mut problems = Vec::new();
    for m in &g.modules {
        let in_bin = m.file == "src/main.rs" || m.file.starts_with("src/cli/");
        if in_bin != (m.krate == Crate::Bin) {
            problems.push(format!(
                "{} ({:?}) is outside its crate's files",
                m.file, m.krate
            ));
        }
    }
    for ((a, b), e) in &g.edges {
        if g.modules[*a].krate == Crate::Lib && g.modules[*b].krate == Crate::Bin {
            problems.push(format!(
                "the library refers to the binary: {} → {} at {}:{}",
                g.name(*a),
                g.name(*b),
                e.file,
                e.line
            ));
        }
    }
    // Layers: each top-level library module in one layer; imports between
    // top-level modules stay in their layer or go down, never up.
    let mut layer: BTreeMap<String, usize> = BTreeMap::new();
    for row in section_rows(&doc(), "Layers") {
        let Ok(n) = row[0].parse::<usize>() else {
            continue;
        }; // the header
        for name in names(&row[1]) {
            if let Some(old) = layer.insert(name.clone(), n) {
                problems.push(format!("`{name}` is in layers {old} and {n}"));
            }
        }
    }
    let top: BTreeSet<String> = g
        .modules
        .iter()
        .filter(|m| m.krate == Crate::Lib && m.path.len() == 1)
        .map(|m| m.path[0].clone())
        .collect();
    let listed: BTreeSet<String> = layer.keys().cloned().collect();
    for name in top.difference(&listed) {
        problems.push(format!("`{name}` is in no layer of docs/architecture.md"));
    }
    for name in listed.difference(&top) {
        problems.push(format!(
            "layer module `{name}` is not a top-level module of src/lib.rs"
        ));
    }
    for ((a, b), e) in &g.edges {
        let (ma, mb) = (&g.modules[*a], &g.modules[*b]);
        if ma.krate != Crate::Lib
            || mb.krate != Crate::Lib
            || ma.path.is_empty()
            || mb.path.is_empty()
            || ma.path[0] == mb.path[0]
        {
            continue;
        }
        let (la, lb) = (layer.get(&ma.path[0]), layer.get(&mb.path[0]));
        if let (Some(la), Some(lb)) = (la, lb)
            && la < lb
        {
            problems.push(format!(
                "{} (layer {la}) → {} (layer {lb}) at {}:{}: an import up the layers",
                g.name(*a),
                g.name(*b),
                e.file,
                e.line
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_architecture_document_lists_every_module_and_its_imports() {
    table_matches(graph(), "Modules");
}

/// The `## {heading}` section's module table lists exactly `g`'s modules,
/// each with its file and its imports; a stale one fails with the rows to paste.
fn table_matches(g: &Graph, heading: &str) {
    // Module rows start with the `name`; headers do not.
    let rows: Vec<Vec<String>> = section_rows(&doc(), heading)
        .into_iter()
        .filter(|r| r[0].starts_with('`'))
        .collect();
    let mut documented: BTreeMap<String, (String, String, BTreeSet<String>)> = BTreeMap::new();
    for row in &rows {
        assert_eq!(
            row.len(),
            4,
            "a module row has 4 cells (module | file | holds | imports): {row:?}"
        );
        let name = names(&row[0])
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no `module` in {row:?}"));
        let file = names(&row[1]).into_iter().next().unwrap_or_default();
        documented.insert(name, (file, row[2].clone(), names(&row[3])));
    }
    let mut expected = String::new();
    let mut stale = Vec::new();
    for (k, m) in g.modules.iter().enumerate() {
        if k == 0 || g.modules[k - 1].krate != m.krate {
            writeln!(
                expected,
                "\n{}:",
                match m.krate {
                    Crate::Lib => "the library",
                    Crate::Bin => "the binary",
                    Crate::Sim => "the simulators",
                }
            )
            .unwrap();
        }
        let name = m.name();
        let imports: BTreeSet<String> = g.targets(k).into_iter().map(|t| g.name(t)).collect();
        let cell = if imports.is_empty() {
            "—".to_string()
        } else {
            imports
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let holds = documented
            .get(&name)
            .map_or("TODO: why this module exists".to_string(), |d| d.1.clone());
        writeln!(expected, "| `{name}` | `{}` | {holds} | {cell} |", m.file).unwrap();
        match documented.get(&name) {
            None => stale.push(format!("missing: `{name}`")),
            Some((file, _, _)) if *file != m.file => stale.push(format!(
                "`{name}` is in {}, the table says {file:?}",
                m.file
            )),
            Some((_, _, doc_imports)) if *doc_imports != imports => stale.push(format!(
                "`{name}` imports {:?}, the table says {:?}",
                imports, doc_imports
            )),
            _ => {}
        }
    }
    for name in documented.keys() {
        if g.find(name).is_none() {
            stale.push(format!("no such module: `{name}`"));
        }
    }
    assert!(
        stale.is_empty(),
        "docs/architecture.md's `## {heading}` table is stale:\n{}\n\nthe rows, from the code (paste each group under its table's header):\n{expected}",
        stale.join("\n")
    );
}

// ---------------------------------------------------------------- the simulators

/// The largest a file of `sim/src` may be: past it, split the file by concern.
const SIM_MAX_LINES: usize = 1_200;

/// `sim/` is held to the same rules as `src/`: its import graph at file
/// granularity (crate root `sim/src/main.rs`) has no cycle.
#[test]
fn the_simulators_module_graph_has_no_cycle() {
    let g = sim_graph();
    eprintln!("sim: {}", g.figures());
    let list: Vec<String> = g.cycles().iter().map(|c| g.show_cycle(c)).collect();
    assert!(
        list.is_empty(),
        "{} import cycles in sim/ — a module imports one that depends on it:\n{}\n\n{}",
        list.len(),
        list.join("\n"),
        g.figures()
    );
}

/// No file of `sim/src` is over [`SIM_MAX_LINES`], and no `#[path]`
/// attribute anywhere in `sim/` hides the real module tree.
#[test]
fn the_simulators_files_are_small_and_where_their_modules_say() {
    let mut problems = Vec::new();
    for (file, text) in sources_under("sim") {
        for (i, line) in text.lines().enumerate() {
            let code: String = line.chars().filter(|c| !c.is_whitespace()).collect();
            if code.starts_with("#[path") {
                problems.push(format!("{file}:{}: a #[path] attribute", i + 1));
            }
        }
        let lines = text.lines().count();
        if file.starts_with("sim/src/") && lines > SIM_MAX_LINES {
            problems.push(format!(
                "{file}: {lines} lines, over {SIM_MAX_LINES}: split it by concern"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_architecture_document_lists_every_simulator_module_and_its_imports() {
    table_matches(sim_graph(), "Simulator modules");
}

/// The checker itself, on small trees: it must fail for the right reasons.
mod checker {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> Graph {
        build_graph(
            &files
                .iter()
                .map(|(p, t)| (p.to_string(), t.to_string()))
                .collect(),
        )
    }

    fn edges(g: &Graph) -> Vec<String> {
        g.edges
            .iter()
            .map(|((a, b), e)| format!("{} → {} @{}", g.name(*a), g.name(*b), e.line))
            .collect()
    }

    #[test]
    fn use_trees_nested_groups_self_as_and_globs() {
        let g = tree(&[
            (
                "src/lib.rs",
                "pub mod a;\npub mod b;\npub mod c;\npub mod d;\npub mod e;",
            ),
            (
                "src/a.rs",
                "use crate::{\n    b::{self, X as Y},\n    c::{inner::{Z}},\n};\nuse crate::d::*;\nuse std::io;\n",
            ),
            ("src/b.rs", ""),
            ("src/c.rs", ""),
            ("src/d.rs", ""),
            ("src/e.rs", "pub use crate::a::Thing;"),
        ]);
        assert_eq!(edges(&g), ["a → b @2", "a → c @3", "a → d @5", "e → a @1"]);
    }

    #[test]
    fn super_super_self_child_paths_and_longest_prefix() {
        let g = tree(&[
            ("src/lib.rs", "pub mod x;\npub mod top;"),
            ("src/top.rs", "pub struct T;"),
            ("src/x/mod.rs", "mod y;\nfn f() { y::z::go(); }"),
            ("src/x/y/mod.rs", "pub mod z;"),
            (
                "src/x/y/z.rs",
                "fn g() -> super::super::top_level() {}\nfn h() { let _ = crate::top::T; self::nothing(); }",
            ),
        ]);
        // `super::super::top_level` names an item of `x`; `crate::top::T` lands in `top`.
        assert_eq!(
            edges(&g),
            ["x → x::y::z @2", "x::y::z → top @2", "x::y::z → x @1"]
        );
        assert_eq!(g.cycles().len(), 1);
        assert!(
            g.show_cycle(&g.cycles()[0])
                .starts_with("x → x::y::z → x\n"),
            "{}",
            g.show_cycle(&g.cycles()[0])
        );
    }

    #[test]
    fn comments_strings_raw_strings_and_chars_are_not_code() {
        let g = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;"),
            (
                "src/a.rs",
                concat!(
                    "// use crate::b;\n",
                    "/* crate::b::X /* nested */ crate::b::Y */\n",
                    "/// [`crate::b::Z`]\n",
                    "const S: &str = \"crate::b::W \\\" crate::b::V\";\n",
                    "const R: &str = r#\"crate::b::\"# ;\n",
                    "const B: &[u8] = br\"crate::b::\";\n",
                    "const C: char = '\"'; const D: char = '\\''; fn f<'a>(x: &'a str) {}\n",
                    "fn g() { let _ = b::real(); }\n",
                ),
            ),
            ("src/b.rs", "pub fn real() {}"),
        ]);
        // `b::real` is only a child path from lib; in `a` nothing names `b`.
        assert_eq!(edges(&g), Vec::<String>::new());
        let g = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;"),
            (
                "src/a.rs",
                "const S: &str = \"x\"; fn g() { crate::b::real(); } // crate::c",
            ),
            ("src/b.rs", ""),
        ]);
        assert_eq!(edges(&g), ["a → b @1"]);
    }

    #[test]
    fn test_code_is_not_counted_and_mod_declarations_are_not_edges() {
        let g = tree(&[
            ("src/lib.rs", "pub mod a;\npub mod b;"),
            (
                "src/a.rs",
                concat!(
                    "mod c;\n",
                    "#[cfg(test)]\nmod tests;\n",
                    "#[cfg(test)]\nmod inline { use crate::b; fn t() { super::c::x(); } }\n",
                    "#[cfg(all(test, unix))]\nfn helper() -> crate::b::B { todo!() }\n",
                    "#[cfg(test)]\nuse crate::b::B;\n",
                    "#[cfg(not(test))]\nuse crate::b::Real;\n",
                ),
            ),
            ("src/a/c.rs", ""),
            ("src/a/tests.rs", "use crate::b::*;"),
            ("src/b.rs", "#[cfg(test)]\nmod fuzz;\nmod only;\n"),
            ("src/b/fuzz.rs", "use crate::a::*;"),
            ("src/b/only.rs", "#![cfg(test)]\nuse crate::a::*;"),
        ]);
        assert_eq!(edges(&g), ["a → b @11"]);
        assert_eq!(g.modules.len(), 4, "lib, a, a::c, b");
    }

    #[test]
    fn inline_modules_the_binary_and_aliases() {
        let g = tree(&[
            ("src/lib.rs", "pub mod api;\npub mod disk;"),
            (
                "src/api.rs",
                "pub mod outer { pub mod inner { fn f() { super::super::local(); super::x(); } } }",
            ),
            ("src/disk/mod.rs", "pub mod sparse;\npub struct Magic;"),
            ("src/disk/sparse.rs", ""),
            ("src/main.rs", "mod cli;\nfn main() { cli::run(); }"),
            (
                "src/cli/mod.rs",
                "mod up;\nuse imgbuild::disk;\npub struct Output;\nfn run() { disk::sparse::copy(); up::go(); }",
            ),
            (
                "src/cli/up.rs",
                "use super::Output;\nuse imgbuild::api::outer::inner as deep;\nfn go() { deep::f(); }",
            ),
        ]);
        assert_eq!(
            edges(&g),
            [
                "main → cli @2",
                "cli → disk @2",
                "cli → disk::sparse @4",
                "cli → cli::up @4",
                "cli::up → api @2",
                "cli::up → cli @1"
            ]
        );
    }

    #[test]
    fn a_file_no_declaration_reaches_is_reported() {
        let result = std::panic::catch_unwind(|| {
            tree(&[
                ("src/lib.rs", "pub mod a;"),
                ("src/a.rs", ""),
                ("src/forgotten.rs", ""),
            ])
        });
        let message = *result.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("src/forgotten.rs"), "{message}");
    }
}

/// The repository root holds the project's entry points and folders, nothing
/// else: a background shell's stderr, pid or stdout file (issue 40 found
/// `e12`, `hpid12` and `o12` committed) or a scratch file fails here. Only
/// committed files count (`git ls-files`); a new top-level entry is added to
/// this list on purpose.
#[test]
fn the_repository_root_holds_no_stray_files() {
    const ROOT: &[&str] = &[
        ".cargo",
        ".ci",
        ".github",
        ".gitignore",
        "BENCHMARKS.md",
        "CHANGELOG.md",
        "Cargo.lock",
        "Cargo.toml",
        "Makefile",
        "README.md",
        "action.yml",
        "bench",
        "build.rs",
        "clippy.toml",
        "deny.toml",
        "docs",
        "examples",
        "fixtures",
        "proptest-regressions",
        "proto",
        "schemas",
        "sim",
        "src",
        "tests",
    ];
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(repo())
        .output()
        .expect("git runs");
    assert!(
        out.status.success(),
        "git ls-files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let top: BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(|p| p.split('/').next().unwrap_or(p).to_owned())
        .collect();
    let stray: Vec<&String> = top.iter().filter(|t| !ROOT.contains(&t.as_str())).collect();
    assert!(
        stray.is_empty(),
        "files at the repository root that belong elsewhere (or in this list): {stray:?}"
    );
}

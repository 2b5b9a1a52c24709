//! `--output markdown` (issue 38): `up`'s plan or run as a pull-request
//! comment. Read back with a CommonMark + GFM-tables parser
//! (pulldown-cmark): one table whose rows are the JSON document's `plan`
//! rows (step, action, node, from → to) in order; every string from
//! outside (here a node's version tag built to break Markdown) inside a
//! code span, escaped and bounded: no HTML, no link, no forged row or cell;
//! the plan file named with its sha256. Any other command refuses the
//! format (exit 2), naming the commands that take it.

use std::process::Output;

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

use crate::common;
use common::demo::DemoCluster;
use common::inventory::{Inventory, Node};
use common::run::Run;
use common::sims::{Nodes, Sim};
use common::{imgbuild, json, stdout_ok, text};

/// The loopback /24 of scenario `k` (tests/common/net.rs).
fn net(k: u8) -> String {
    common::net::scenario(module_path!(), k)
}

/// What a Markdown reader makes of a document.
#[derive(Debug, Default)]
struct Read {
    /// Each table's rows (the head first), each row's cells as rendered text.
    tables: Vec<Vec<Vec<String>>>,
    /// The text of every code span.
    code: Vec<String>,
    /// Raw HTML, links and images: markup that text from outside made.
    markup: Vec<String>,
    /// Emphasis and strong text, as rendered.
    emphasis: Vec<String>,
}

/// `md` through pulldown-cmark with GFM tables (as GitHub renders a comment).
fn read(md: &str) -> Read {
    let mut r = Read::default();
    let mut cell: Option<String> = None;
    let mut strong: Option<String> = None;
    for event in Parser::new_ext(md, Options::ENABLE_TABLES | Options::ENABLE_STRIKETHROUGH) {
        match event {
            Event::Start(Tag::Table(_)) => r.tables.push(Vec::new()),
            Event::Start(Tag::TableHead | Tag::TableRow) => {
                r.tables.last_mut().unwrap().push(Vec::new());
            }
            Event::Start(Tag::TableCell) => cell = Some(String::new()),
            Event::End(TagEnd::TableCell) => {
                let c = cell.take().unwrap();
                r.tables.last_mut().unwrap().last_mut().unwrap().push(c);
            }
            Event::Start(Tag::Emphasis | Tag::Strong | Tag::Strikethrough) => {
                strong = Some(String::new());
            }
            Event::End(TagEnd::Emphasis | TagEnd::Strong | TagEnd::Strikethrough) => {
                r.emphasis.push(strong.take().unwrap_or_default());
            }
            Event::Text(t) => {
                for s in [&mut cell, &mut strong].into_iter().flatten() {
                    s.push_str(&t);
                }
            }
            Event::Code(t) => {
                for s in [&mut cell, &mut strong].into_iter().flatten() {
                    s.push_str(&t);
                }
                r.code.push(t.into_string());
            }
            Event::Html(h) | Event::InlineHtml(h) => r.markup.push(format!("html {h}")),
            Event::Start(Tag::Link { dest_url, .. } | Tag::Image { dest_url, .. }) => {
                r.markup.push(format!("link {dest_url}"));
            }
            _ => {}
        }
    }
    r
}

/// The text imgbuild shows of a string from outside: one line (`\n`, `\r`,
/// `\t` and other controls escaped) and at most `n` characters, then `…`.
fn one_line(s: &str, n: usize) -> String {
    let mut out = String::new();
    for c in s.chars().take(n) {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    if s.chars().count() > n {
        out.push('…');
    }
    out
}

/// The row the JSON document's plan action `a` (at 1-based `i`) must read
/// as: `#`, step, action, node, from → to.
fn expected_row(i: usize, a: &serde_json::Value) -> Vec<String> {
    let s = |v: &serde_json::Value| v.as_str().map_or("-".to_owned(), |v| one_line(v, 120));
    let changes: Vec<String> = a["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| format!("{} {} → {}", s(&c["field"]), s(&c["from"]), s(&c["to"])))
        .collect();
    let mut action = s(&a["what"]);
    if a["destructive"] == true {
        action.push_str(" (with --allow-destroy)");
    }
    if let Some(d) = a["detail"].as_str() {
        action.push_str(&format!(" ({})", one_line(d, 200)));
    }
    vec![
        i.to_string(),
        s(&a["step"]),
        action,
        a["node"]
            .as_str()
            .map_or("(cluster)".to_owned(), |n| one_line(n, 64)),
        if changes.is_empty() {
            "-".to_owned()
        } else {
            changes.join("; ")
        },
    ]
}

/// The Markdown's one table is the JSON's plan, row for row, in order.
fn assert_table_is_the_json_plan(md: &Read, doc: &serde_json::Value) {
    assert_eq!(md.tables.len(), 1, "{md:?}");
    let table = &md.tables[0];
    assert_eq!(
        table[0],
        ["#", "step", "action", "node", "from → to"],
        "the head"
    );
    let plan = doc["plan"].as_array().unwrap();
    assert_eq!(table.len() - 1, plan.len(), "one row per action: {table:?}");
    for (i, (row, a)) in table[1..].iter().zip(plan).enumerate() {
        assert_eq!(*row, expected_row(i + 1, a), "row {}", i + 1);
    }
}

/// A create from nothing on the demo cluster: `up --dry-run --out plan.json
/// -o markdown` is the plan's summary, its table the JSON's plan rows, and
/// names the plan file with the sha256 of what it wrote; `up --plan
/// plan.json -o markdown` is its run, each action in order and done.
#[test]
fn a_dry_run_as_markdown_is_the_json_plan_as_a_table_and_names_the_plan_file() {
    let c = DemoCluster::start(net(1));
    let plan = c.dir.path().join("plan.json");
    let run = |args: &[&str]| -> Output { c.command(args).output() };
    let o = run(&["--output", "json", "up", "--dry-run"]);
    let doc = json(&o);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));

    let o = run(&[
        "-o",
        "markdown",
        "up",
        "--dry-run",
        "--out",
        plan.to_str().unwrap(),
    ]);
    let md = stdout_ok(&o);
    let r = read(&md);
    assert!(r.markup.is_empty(), "{:?}\n{md}", r.markup);
    assert!(
        md.starts_with("### imgbuild plan for cluster demo (proxmox)\n"),
        "{md}"
    );
    let actions = doc["plan"].as_array().unwrap();
    assert!(actions.len() >= 16, "a create plans every step: {doc}");
    assert_eq!(
        r.emphasis[0],
        format!("{} action(s) planned", actions.len()),
        "{md}"
    );
    assert_table_is_the_json_plan(&r, &doc);
    let o_sum = std::process::Command::new("sha256sum")
        .arg(&plan)
        .output()
        .unwrap();
    let sha = text(&o_sum.stdout).split(' ').next().unwrap().to_owned();
    assert_eq!(sha.len(), 64);
    assert!(
        r.code.contains(&plan.display().to_string()) && r.code.contains(&sha),
        "the plan file and its sha256: {md}"
    );
    // The same plan as text on stderr's side: the Markdown is stdout only.
    assert!(
        text(&o.stderr).contains("plan written to"),
        "{}",
        text(&o.stderr)
    );
    assert!(!md.contains(&c.pve.token), "no secret");

    // The run of that plan as Markdown: each action with its result, in
    // the plan's order (the node column is the dry run's).
    let o = run(&["-o", "markdown", "up", "--plan", plan.to_str().unwrap()]);
    let md = stdout_ok(&o);
    let r = read(&md);
    assert!(r.markup.is_empty(), "{:?}\n{md}", r.markup);
    assert!(
        md.starts_with("### imgbuild run on cluster demo (proxmox)\n"),
        "{md}"
    );
    assert_eq!(
        r.emphasis[0],
        format!("{} done, 0 failed, 0 left, 0 not reached", actions.len()),
        "{md}"
    );
    let table = &r.tables[0];
    assert_eq!(
        table[0],
        ["#", "step", "action", "node", "from → to", "result"]
    );
    let nodes: Vec<&str> = table[1..].iter().map(|row| row[3].as_str()).collect();
    let planned: Vec<String> = actions
        .iter()
        .map(|a| a["node"].as_str().unwrap_or("(cluster)").to_owned())
        .collect();
    assert_eq!(nodes, planned, "{md}");
    assert!(table[1..].iter().all(|row| row[5] == "done"), "{md}");
}

/// A version tag built to break Markdown out of its cell: pipes, backticks,
/// emphasis, an HTML tag, a link, a mention, and a newline that starts a
/// forged row. After a `-` (a pre-release suffix) the node still runs
/// v1.11.2, so the plan upgrades it from that tag.
const HOSTILE: &str = "v1.11.2-|x|`*a*`__b__<script>alert(1)</script>[x](https://evil.example)@org/team\n| 9 | forged | row | w | - |\r\n~~s~~ <!-- c --> &amp; ``` ";

#[test]
fn hostile_strings_stay_in_code_spans_and_forge_no_cell_or_row() {
    let net = net(2);
    let factory = Sim::start_with(&[], 0, &["--versions", "v1.11.2,v1.11.5"]);
    let _nodes = Nodes::start(&[
        "--talos-version",
        HOSTILE,
        "--node",
        &format!("cp-01={net}.11:controlplane"),
        "--node",
        &format!("worker-01={net}.21:worker"),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("cluster.yaml"),
        Inventory::new("hostile")
            .endpoint(&format!("{net}.11"))
            .no_nameservers()
            .factory(&factory.url)
            .node(Node::new("cp-01", "controlplane").address(&format!("{net}.11")))
            .node(Node::new("worker-01", "worker").address(&format!("{net}.21")))
            .text(),
    )
    .unwrap();
    let run = |args: &[&str]| -> Output {
        let mut run = Run::with_config(&d.join("cluster.yaml"), args);
        run.env_remove("TALOSCONFIG")
            .env_remove("IMGBUILD_STATE_DIR")
            .env_remove("IMGBUILD_FACTORY")
            .timeouts(&[]);
        if args.contains(&"up") {
            run.arg("--out-dir").arg(d.join("out"));
        }
        run.output()
    };
    let o = run(&["bootstrap", "--new-secrets"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    // The bump that makes the plan quote each node's tag as its `from`.
    let inv = std::fs::read_to_string(d.join("cluster.yaml")).unwrap();
    std::fs::write(
        d.join("cluster.yaml"),
        inv.replace("talosVersion: v1.11.2", "talosVersion: v1.11.5"),
    )
    .unwrap();

    let o = run(&["--output", "json", "up", "--dry-run"]);
    let doc = json(&o);
    let o = run(&["-o", "markdown", "up", "--dry-run"]);
    let md = text(&o.stdout);
    assert!(
        matches!(o.status.code(), Some(0 | 1)),
        "{}",
        text(&o.stderr)
    );
    let r = read(&md);
    assert!(
        r.markup.is_empty(),
        "markup from outside: {:?}\n{md}",
        r.markup
    );
    for e in &r.emphasis {
        assert!(
            e.ends_with(" action(s) planned") || e == "No changes." || e.starts_with("Stopped at "),
            "emphasis made from outside: {e:?}\n{md}"
        );
    }
    assert!(
        !md.lines().any(|l| l.starts_with("| 9 |")),
        "a forged row:\n{md}"
    );
    // Every row has the head's five cells, and the upgrades quote the tag
    // whole (escaped, within the bound) in one code span each.
    assert_table_is_the_json_plan(&r, &doc);
    let tag = one_line(HOSTILE, 120);
    let quoting = r.code.iter().filter(|c| **c == tag).count();
    let upgrades = doc["plan"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["step"] == "upgrade" && a["node"].is_string())
        .count();
    assert_eq!(upgrades, 2, "{doc}");
    assert_eq!(quoting, upgrades, "{:?}\n{md}", r.code);
    // Why the plan stopped, outside the table: the tag as it is there too.
    assert!(
        r.code
            .iter()
            .any(|c| c.starts_with("upgrade refused") && c.contains("v1.11.2-|x|`*a*`")),
        "{md}"
    );
    common::hostile::no_raw_control("markdown", &md);
}

#[test]
fn markdown_is_refused_by_every_other_command_naming_those_that_take_it() {
    for args in [
        &["-o", "markdown", "validate"][..],
        &["--output", "markdown", "plan"],
        &["--output=markdown", "status"],
        &["-o", "markdown", "upgrade", "--dry-run"],
    ] {
        let mut all = vec!["--config", "examples/atlas/cluster.yaml"];
        all.extend_from_slice(args);
        let o = imgbuild(&all);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o.stderr));
        assert!(o.stdout.is_empty(), "{args:?}: {}", text(&o.stdout));
        let err = text(&o.stderr);
        assert!(
            err.contains("--output markdown") && err.contains("`up`") && err.contains("`replace`"),
            "{args:?}: {err}"
        );
    }
}

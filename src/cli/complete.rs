//! Shell completion with the inventory's node names: clap's scripts for
//! bash, zsh and fish, each with a hook that asks `imgbuild __complete
//! nodes` (hidden) for the names after the commands that take nodes and
//! for `--node`. The hidden command reads the inventory quietly: nothing on
//! stderr, exit 0 whatever happens, a bounded read of the file.

use std::collections::BTreeSet;
use std::path::Path;

use clap::{ArgAction, Command};
use clap_complete::Shell;

/// The most of an inventory `__complete nodes` reads.
const INVENTORY_LIMIT: u64 = 4 << 20;
/// The most names it prints.
const NAMES_LIMIT: usize = 10_000;

/// `imgbuild __complete nodes`: the node names of the inventory at
/// `config`, one a line; nothing when it cannot be read or parsed (a
/// completion must not print errors into the user's command line). Only
/// names a shell word can hold as is: no quoting is ever needed.
pub fn node_names(config: &Path) -> Vec<String> {
    let Ok(text) = imgbuild::input::read_text(config, INVENTORY_LIMIT) else {
        return Vec::new();
    };
    let Ok(doc) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text) else {
        return Vec::new();
    };
    let Some(nodes) = doc.get("nodes").and_then(|n| n.as_sequence()) else {
        return Vec::new();
    };
    nodes
        .iter()
        .filter_map(|n| n.get("name")?.as_str())
        .filter(|n| {
            !n.is_empty()
                && !n.starts_with('-')
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        })
        .take(NAMES_LIMIT)
        .map(str::to_owned)
        .collect()
}

/// Where node names go: the command path (`apply`, `etcd snapshot`) and
/// whether it takes several.
struct NodeCommand {
    path: Vec<String>,
    several: bool,
}

/// The commands with a `node` or `nodes` positional, and the commands
/// with a `--node` option, from the command tree itself.
fn node_commands(cmd: &Command) -> (Vec<NodeCommand>, Vec<Vec<String>>) {
    fn walk(
        cmd: &Command,
        path: &mut Vec<String>,
        out: &mut Vec<NodeCommand>,
        opt: &mut Vec<Vec<String>>,
    ) {
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            path.push(sub.get_name().to_owned());
            for a in sub.get_arguments() {
                let id = a.get_id().as_str();
                if a.is_positional() && (id == "node" || id == "nodes") {
                    out.push(NodeCommand {
                        path: path.clone(),
                        several: matches!(a.get_action(), ArgAction::Append)
                            || a.get_num_args().is_some_and(|n| n.max_values() > 1),
                    });
                }
                if a.get_long() == Some("node") {
                    opt.push(path.clone());
                }
            }
            walk(sub, path, out, opt);
            path.pop();
        }
    }
    let (mut out, mut opt) = (Vec::new(), Vec::new());
    walk(cmd, &mut Vec::new(), &mut out, &mut opt);
    (out, opt)
}

/// Every option of the tree that takes a value (`--config`, `-o`, …), so
/// the hooks skip its value when they find the command path.
fn value_options(cmd: &Command) -> BTreeSet<String> {
    fn walk(cmd: &Command, out: &mut BTreeSet<String>) {
        for a in cmd.get_arguments() {
            if a.is_positional() || !a.get_action().takes_values() {
                continue;
            }
            if let Some(l) = a.get_long() {
                out.insert(format!("--{l}"));
            }
            if let Some(s) = a.get_short() {
                out.insert(format!("-{s}"));
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = BTreeSet::new();
    walk(cmd, &mut out);
    out
}

/// clap's script for `shell`, with the node-name hook.
pub fn script(shell: Shell, mut cmd: Command) -> Vec<u8> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "imgbuild", &mut script);
    let (commands, with_option) = node_commands(&cmd);
    let values = value_options(&cmd);
    let text = String::from_utf8_lossy(&script).into_owned();
    match shell {
        Shell::Bash => bash(text, &commands, &values).into_bytes(),
        Shell::Zsh => zsh(text).into_bytes(),
        Shell::Fish => fish(text, &commands, &with_option).into_bytes(),
        _ => script,
    }
}

fn bash(mut text: String, commands: &[NodeCommand], values: &BTreeSet<String>) -> String {
    let values = values.iter().cloned().collect::<Vec<_>>().join("|");
    let patterns = commands
        .iter()
        .map(|c| {
            let p = c.path.join(" ");
            if c.several {
                format!("\" {p} \"*")
            } else {
                format!("\" {p} \"")
            }
        })
        .collect::<Vec<_>>()
        .join("|");
    text.push_str(&format!(
        r#"
# Node names from the inventory (`imgbuild __complete nodes`, quiet):
# after the commands that take nodes, and for --node.
_imgbuild_node_names() {{
    local i cfg=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            --config) cfg=(--config "${{COMP_WORDS[i+1]}}") ;;
            --config=*) cfg=(--config "${{COMP_WORDS[i]#--config=}}") ;;
        esac
    done
    "${{COMP_WORDS[0]}}" "${{cfg[@]}}" __complete nodes 2>/dev/null
}}

_imgbuild_with_nodes() {{
    _imgbuild "$@"
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local i w path="" skip=0 keep=()
    # clap's placeholders ([NODES]..., <NODE>) are not words to type.
    for w in "${{COMPREPLY[@]}}"; do
        case "$w" in \[*|\<*) ;; *) keep+=("$w") ;; esac
    done
    COMPREPLY=("${{keep[@]}}")
    if [[ "$prev" == --node ]]; then
        COMPREPLY=($(compgen -W "$(_imgbuild_node_names)" -- "$cur"))
        return 0
    fi
    [[ "$cur" == -* ]] && return 0
    case "$prev" in {values}) return 0 ;; esac
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if ((skip)); then skip=0; continue; fi
        case "$w" in
            --*=*) ;;
            {values}) skip=1 ;;
            -*) ;;
            *) path="${{path:+$path }}$w" ;;
        esac
    done
    case " $path " in
        {patterns}) COMPREPLY+=($(compgen -W "$(_imgbuild_node_names)" -- "$cur")) ;;
    esac
    return 0
}}

if [[ "${{BASH_VERSINFO[0]}}" -eq 4 && "${{BASH_VERSINFO[1]}}" -ge 4 || "${{BASH_VERSINFO[0]}}" -gt 4 ]]; then
    complete -F _imgbuild_with_nodes -o nosort -o bashdefault -o default imgbuild
else
    complete -F _imgbuild_with_nodes -o bashdefault -o default imgbuild
fi
"#
    ));
    text
}

/// zsh: the node positionals' and `--node`'s action becomes
/// `_imgbuild_nodes`, defined before clap's function.
fn zsh(text: String) -> String {
    let mut out = String::with_capacity(text.len() + 1024);
    let mut lines = text.lines();
    if let Some(first) = lines.next() {
        out.push_str(first);
        out.push('\n');
    }
    out.push_str(
        r#"
# Node names from the inventory (`imgbuild __complete nodes`, quiet).
_imgbuild_nodes() {
    local -a all cfg names
    local i
    all=(${(z)BUFFER})
    for ((i = 2; i <= ${#all}; i++)); do
        case "${all[i]}" in
            --config) cfg=(--config "${(Q)all[i+1]}") ;;
            --config=*) cfg=(--config "${(Q)${all[i]#--config=}}") ;;
        esac
    done
    names=(${(f)"$(${(Q)all[1]} "${cfg[@]}" __complete nodes 2>/dev/null)"})
    _describe -t nodes 'node' names
}
"#,
    );
    for line in lines {
        let t = line.trim_start();
        let node_spec = t.starts_with("':node")
            || t.starts_with("'::node")
            || t.starts_with("'*::nodes")
            || t.starts_with("'--node=[");
        if node_spec && line.contains(":_default'") {
            out.push_str(&line.replace(":_default'", ":_imgbuild_nodes'"));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

fn fish(mut text: String, commands: &[NodeCommand], with_option: &[Vec<String>]) -> String {
    text.push_str(
        r#"
# Node names from the inventory (`imgbuild __complete nodes`, quiet).
function __imgbuild_nodes
    set -l tokens (commandline -opc)
    set -l cfg
    for i in (seq (count $tokens))
        switch $tokens[$i]
            case --config
                set -l next (math $i + 1)
                if test $next -le (count $tokens)
                    set cfg --config $tokens[$next]
                end
            case '--config=*'
                set cfg --config (string replace -- --config= '' $tokens[$i])
        end
    end
    $tokens[1] $cfg __complete nodes 2>/dev/null
end
"#,
    );
    let condition = |path: &[String]| {
        let mut c = format!("__fish_imgbuild_using_subcommand {}", path[0]);
        for p in &path[1..] {
            c.push_str(&format!("; and __fish_seen_subcommand_from {p}"));
        }
        c
    };
    for c in commands {
        text.push_str(&format!(
            "complete -c imgbuild -n \"{}; and not string match -q -- '-*' (commandline -ct)\" -f -a \"(__imgbuild_nodes)\"\n",
            condition(&c.path)
        ));
    }
    for path in with_option {
        text.push_str(&format!(
            "complete -c imgbuild -n \"{}\" -l node -r -f -a \"(__imgbuild_nodes)\"\n",
            condition(path)
        ));
    }
    text
}

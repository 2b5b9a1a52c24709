//! Line numbers for field paths (`nodes[2].address`), so that errors found
//! after deserialisation (duplicates, addresses outside the CIDR) can still
//! point at the line to fix. serde keeps no spans; a marked event parse does.

use std::collections::HashMap;
use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::Marker;

/// Maps `a.b[3].c` paths to the 1-based line where that key (or item) stands.
#[derive(Debug, Default, Clone)]
pub struct LineIndex {
    lines: HashMap<String, usize>,
}

impl LineIndex {
    /// Indexes `text`; an unparsable document yields an empty index (the
    /// deserialiser reports the syntax error with its own position).
    pub fn new(text: &str) -> Self {
        let mut walker = Walker::default();
        let _ = Parser::new_from_str(text).load(&mut walker, false);
        LineIndex {
            lines: walker.lines,
        }
    }

    /// The line of `path`, or of its nearest indexed ancestor.
    pub fn line(&self, path: &str) -> Option<usize> {
        let mut p = path;
        loop {
            if let Some(&line) = self.lines.get(p) {
                return Some(line);
            }
            p = &p[..p.rfind(['.', '['])?];
        }
    }
}

enum Frame {
    Map { path: String, key: Option<String> },
    Seq { path: String, next: usize },
}

#[derive(Default)]
struct Walker {
    stack: Vec<Frame>,
    lines: HashMap<String, usize>,
}

impl Walker {
    /// The path of the node that starts now, advancing the parent's position.
    /// `None` when the node is a mapping key.
    fn child_path(&mut self) -> Option<String> {
        match self.stack.last_mut() {
            None => Some(String::new()),
            Some(Frame::Seq { path, next }) => {
                *next += 1;
                Some(format!("{path}[{}]", *next - 1))
            }
            Some(Frame::Map { key: None, .. }) => None,
            Some(Frame::Map { path, key }) => {
                let k = key.take().unwrap_or_default();
                Some(if path.is_empty() {
                    k
                } else {
                    format!("{path}.{k}")
                })
            }
        }
    }
}

impl MarkedEventReceiver for Walker {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let line = mark.line();
        match ev {
            Event::Scalar(value, ..) => match self.child_path() {
                Some(path) => {
                    self.lines.entry(path).or_insert(line);
                }
                None => {
                    if let Some(Frame::Map { path, key }) = self.stack.last_mut() {
                        let full = if path.is_empty() {
                            value.clone()
                        } else {
                            format!("{path}.{value}")
                        };
                        self.lines.entry(full).or_insert(line);
                        *key = Some(value);
                    }
                }
            },
            Event::MappingStart(..) | Event::SequenceStart(..) => {
                let path = self.child_path().unwrap_or_default();
                self.lines.entry(path.clone()).or_insert(line);
                self.stack.push(if matches!(ev, Event::MappingStart(..)) {
                    Frame::Map { path, key: None }
                } else {
                    Frame::Seq { path, next: 0 }
                });
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
            }
            Event::Alias(..) => {
                self.child_path();
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LineIndex;

    #[test]
    fn keys_and_items_map_to_their_lines() {
        let idx = LineIndex::new("a: 1\nnodes:\n  - name: x\n    address: 1.2.3.4\n  - name: y\n");
        assert_eq!(idx.line("a"), Some(1));
        assert_eq!(idx.line("nodes"), Some(2));
        assert_eq!(idx.line("nodes[0]"), Some(3));
        assert_eq!(idx.line("nodes[0].address"), Some(4));
        assert_eq!(idx.line("nodes[1].name"), Some(5));
    }

    #[test]
    fn unknown_paths_fall_back_to_the_nearest_ancestor() {
        let idx = LineIndex::new("nodes:\n  - name: x\n");
        assert_eq!(idx.line("nodes[0].mac"), Some(2));
        assert_eq!(idx.line("other"), None);
    }

    #[test]
    fn flow_collections_are_indexed_too() {
        let idx = LineIndex::new("x: {a: [1, 2]}\ny:\n  - [3]\n");
        assert_eq!(idx.line("x.a[1]"), Some(1));
        assert_eq!(idx.line("y[0][0]"), Some(3));
    }
}

//! The layer order of the crate's top-level modules (docs/design.md#rust-layers), read from the
//! sources: every `crate::m…` path (also inside `use crate::{…}` groups and `$crate::` in macros),
//! every `super::…` chain that climbs to the crate root, and the root re-exports (`crate::Error` is
//! `error`) are an edge from the file's top-level module to `m`. Test modules count like any other
//! file. The test fails on any circle and on any edge that does not point down [`ORDER`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom to top: a module may use only modules listed before it.
const ORDER: &[&str] = &[
    "error",
    "threads",
    "cpu_features",
    "element",
    "fast_math",
    "container",
    "hadamard",
    "attention",
    "gdn",
    "sampling",
    "canonical",
    "formats",
    "repack",
    "kernels",
    "fuzzing",
];

/// Beside the codec stack: only the top (`fuzzing`) may use them; callers outside the crate connect
/// them to the codecs.
const BESIDE_THE_STACK: &[&str] = &["container", "hadamard", "attention", "gdn", "sampling"];
const TOP: &str = "fuzzing";

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Module path of a file below `src/` (`formats/stq1_0/tests.rs` → `[formats, stq1_0, tests]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn leading_ident(s: &str) -> &str {
    let s = s.trim_start();
    &s[..s.find(|c| !is_ident_char(c)).unwrap_or(s.len())]
}

/// The first segments of the paths that start at the crate root in `code` (comments stripped):
/// `crate::a::b` gives `a`, `crate::{a, b::c}` gives `a` and `b`, and a `super::` chain gives the
/// segment after it when the chain has at least `depth` links (a file's own depth; a `super` inside
/// an inline module climbs less, so such a chain is at worst read as reaching the root).
fn root_segments(code: &str, depth: usize) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| is_ident_char(c) && c != '$') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut nesting = 0usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => nesting += 1,
                    '}' if nesting == 0 => break,
                    '}' => nesting -= 1,
                    ',' if nesting == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        out.push(leading_ident(&group[i..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(leading_ident(rest).to_string());
        }
    }
    for (at, _) in code.match_indices("super::") {
        if code[..at].ends_with("super::") {
            continue; // counted from the chain's first link
        }
        let mut rest = &code[at..];
        let mut links = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            links += 1;
            rest = r;
        }
        if links >= depth {
            out.push(leading_ident(rest).to_string());
        }
    }
    out
}

fn strip_comments(source: &str) -> String {
    source
        .lines()
        .map(|line| match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Top-level modules declared in lib.rs, and the names lib.rs re-exports (`Error` → `error`).
fn crate_root() -> (BTreeSet<String>, BTreeMap<String, String>) {
    let lib = strip_comments(&std::fs::read_to_string(src_dir().join("lib.rs")).unwrap());
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for line in lib.lines().map(str::trim) {
        if let Some(m) = line.strip_prefix("pub mod ").or(line.strip_prefix("mod ")) {
            modules.insert(m.trim_end_matches(';').to_string());
        } else if let Some(u) = line.strip_prefix("pub use ") {
            let module = leading_ident(u).to_string();
            let names = u.split_once("::").map_or("", |x| x.1);
            for name in names
                .split(|c: char| !is_ident_char(c))
                .filter(|n| !n.is_empty())
            {
                reexports.insert(name.to_string(), module.clone());
            }
        }
    }
    (modules, reexports)
}

/// Edges `from → to` between top-level modules, each with one file that makes it.
fn module_graph() -> BTreeMap<(String, String), String> {
    let (modules, reexports) = crate_root();
    let mut files = Vec::new();
    rust_files(&src_dir(), &mut files);
    let mut edges = BTreeMap::new();
    for file in files {
        let rel = file.strip_prefix(src_dir()).unwrap().to_path_buf();
        let path = module_path(&rel);
        if path == ["lib"] {
            continue;
        }
        let from = path[0].clone();
        let code = strip_comments(&std::fs::read_to_string(&file).unwrap());
        for seg in root_segments(&code, path.len()) {
            let to = if modules.contains(&seg) {
                seg
            } else if let Some(m) = reexports.get(&seg) {
                m.clone()
            } else {
                continue;
            };
            if to != from {
                edges
                    .entry((from.clone(), to))
                    .or_insert_with(|| rel.display().to_string());
            }
        }
    }
    edges
}

#[test]
fn every_module_has_a_layer() {
    let (modules, _) = crate_root();
    let listed: BTreeSet<String> = ORDER.iter().map(|m| m.to_string()).collect();
    assert_eq!(modules, listed, "lib.rs modules vs ORDER");
}

#[test]
fn the_scan_sees_the_known_edges() {
    // Guards the scanner itself: a parser that finds nothing would pass the other tests.
    let edges = module_graph();
    for (from, to) in [
        ("formats", "canonical"),
        ("repack", "formats"),
        ("kernels", "canonical"),
        ("container", "error"),
    ] {
        assert!(
            edges.contains_key(&(from.to_string(), to.to_string())),
            "{from} -> {to} not found"
        );
    }
}

#[test]
fn edges_point_down_the_order() {
    let rank = |m: &str| ORDER.iter().position(|o| *o == m).unwrap();
    let mut bad = Vec::new();
    for ((from, to), file) in module_graph() {
        if rank(to.as_str()) >= rank(from.as_str()) {
            bad.push(format!("{from} -> {to} ({file}) goes up the order"));
        }
        if BESIDE_THE_STACK.contains(&to.as_str()) && from != TOP {
            bad.push(format!("{from} -> {to} ({file}): {to} is beside the stack"));
        }
    }
    assert!(bad.is_empty(), "layer violations:\n{}", bad.join("\n"));
}

#[test]
fn no_circles() {
    let edges = module_graph();
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from.as_str()).or_default().push(to.as_str());
    }
    // Depth-first search; a grey node met again closes a circle.
    fn visit<'a>(
        m: &'a str,
        next: &BTreeMap<&'a str, Vec<&'a str>>,
        stack: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(i) = stack.iter().position(|s| *s == m) {
            let mut circle = stack[i..].to_vec();
            circle.push(m);
            return Some(circle);
        }
        if !done.insert(m) {
            return None;
        }
        stack.push(m);
        for &to in next.get(m).into_iter().flatten() {
            if let Some(c) = visit(to, next, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    for &m in next.keys() {
        if let Some(circle) = visit(m, &next, &mut Vec::new(), &mut done) {
            panic!("module circle: {}", circle.join(" -> "));
        }
    }
}

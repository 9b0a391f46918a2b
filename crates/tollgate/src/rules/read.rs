//! Reading one rule file's bytes into YAML nodes with places: the checks made before
//! the YAML parser runs (a byte order mark dropped, control characters and nesting too
//! deep for the parser refused), the parse itself (duplicate keys refused, scalars kept
//! as text), the plain fields read alike everywhere (keys allowed, flags, numbers), and
//! every problem placed at its file, line and column. What the nodes may say is the
//! business of [`draft`](super::draft).

use std::collections::HashMap;

use marked_yaml::types::{MarkedMappingNode, MarkedScalarNode};
use marked_yaml::{LoaderOptions, Node, Span};

use super::error::ConfigError;

/// The deepest [`LoadOptions::max_depth`](super::LoadOptions::max_depth) may be: what
/// keeps the YAML reader, which recurses once per level, within a 2 MiB thread stack.
pub const MAX_MAX_DEPTH: usize = 100;

/// One file's YAML, and the errors found in it, each placed at its line and column.
pub(crate) struct Reader<'a> {
    file: &'a str,
    errors: Vec<ConfigError>,
    lines: Vec<String>,
    /// The characters of each line an error was placed on, made the first time one
    /// needs them: a flow-style file is one long line with many errors, and collecting
    /// it again for each would make the errors cost the square of the line.
    chars: HashMap<usize, Vec<char>>,
}

impl<'a> Reader<'a> {
    /// A reader of the file named `file` in messages, with no error yet.
    pub(crate) fn new(file: &'a str) -> Self {
        Self {
            file,
            errors: Vec::new(),
            lines: Vec::new(),
            chars: HashMap::new(),
        }
    }

    /// The file's name in messages.
    pub(crate) fn file(&self) -> &'a str {
        self.file
    }

    /// Every error found, in the order found.
    pub(crate) fn into_errors(self) -> Vec<ConfigError> {
        self.errors
    }

    /// Records an error found by another reader of the same nodes (the gateway's, of
    /// the `http` section), which carries its own place.
    #[cfg(feature = "tower")]
    pub(crate) fn push(&mut self, error: ConfigError) {
        self.errors.push(error);
    }

    /// An error at `span`'s line and column.
    pub(crate) fn error(&mut self, span: &Span, message: impl Into<String>) {
        let (line, column) = self.position(span);
        self.errors.push(ConfigError {
            file: self.file.to_string(),
            line,
            column,
            message: message.into(),
        });
    }

    /// 1-based (line, column) of a span. yaml-rust marks the first key of a block
    /// mapping at its `:`; such a marker is moved back to the start of the key.
    fn position(&mut self, span: &Span) -> (usize, usize) {
        let Some(m) = span.start() else { return (0, 0) };
        let (line, column) = (m.line(), m.column());
        let lines = &self.lines;
        let chars = self.chars.entry(line).or_insert_with(|| {
            lines
                .get(line.wrapping_sub(1))
                .map(|text| text.chars().collect())
                .unwrap_or_default()
        });
        if column >= 2 && chars.get(column - 1) == Some(&':') {
            let before = &chars[..column - 1];
            let key_len = before
                .iter()
                .rev()
                .take_while(|c| !c.is_whitespace() && !matches!(c, '{' | ',' | '-'))
                .count();
            return (line, column - key_len);
        }
        (line, column)
    }

    /// Where a mapping starts, for messages: its first key (yaml-rust puts a block
    /// mapping's own start marker at the first `:`).
    pub(crate) fn start(map: &MarkedMappingNode) -> Span {
        map.keys().next().map_or(*map.span(), |k| *k.span())
    }

    /// `file:line` of `span`: where a rule was given, for messages.
    pub(crate) fn origin(&self, span: &Span) -> String {
        format!("{}:{}", self.file, span.start().map_or(0, |m| m.line()))
    }

    /// Parses a whole file into its YAML nodes, after the checks that keep the parser
    /// from misreading or overflowing (`None` when it could not be read at all).
    pub(crate) fn read(&mut self, text: &str) -> Option<Node> {
        let text = without_bom(text);
        self.lines = text.lines().map(str::to_string).collect();
        let unreadable = forbidden_character(text).or_else(|| too_deep(text, MAX_YAML_DEPTH));
        if let Some((line, column, message)) = unreadable {
            self.errors.push(ConfigError {
                file: self.file.to_string(),
                line,
                column,
                message,
            });
            return None;
        }
        match parse(text) {
            Ok(root) => Some(root),
            Err(e) => {
                self.yaml_error(e);
                None
            }
        }
    }

    fn yaml_error(&mut self, e: marked_yaml::LoadError) {
        use marked_yaml::LoadError as E;
        let (marker, message) = match &e {
            E::TopLevelMustBeMapping(m) => (
                Some(*m),
                "a rule file must be a mapping with `domain` and `descriptors`".to_string(),
            ),
            E::UnexpectedAnchor(m) => (
                Some(*m),
                "YAML anchors and aliases are not supported in rule files".to_string(),
            ),
            E::MappingKeyMustBeScalar(m) => {
                (Some(*m), "a mapping key must be a plain string".to_string())
            }
            E::UnexpectedTag(m) => (
                Some(*m),
                "YAML tags are not supported in rule files".to_string(),
            ),
            E::ScanError(m, se) => (Some(*m), format!("not valid YAML: {}", se.info())),
            E::DuplicateKey(d) => (
                d.key.span().start().copied(),
                format!(
                    "duplicate key `{}` (first given on line {})",
                    d.key.as_str(),
                    d.prev_key.span().start().map_or(0, |m| m.line())
                ),
            ),
            other => (None, format!("not valid YAML: {other}")),
        };
        let span = marker.map_or_else(Span::new_blank, Span::new_start);
        self.error(&span, message);
    }

    /// Reports every key of `map` not in `allowed`.
    pub(crate) fn check_keys(&mut self, map: &MarkedMappingNode, allowed: &[&str], place: &str) {
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                self.error(
                    key.span(),
                    format!(
                        "unknown key `{}` in {place} (expected one of: {})",
                        key.as_str(),
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    /// A flag: `None` when absent or null (Envoy's service reads both as false).
    pub(crate) fn bool_field(&mut self, map: &MarkedMappingNode, name: &str) -> Option<bool> {
        let node = map.get_node(name)?;
        if node.as_scalar().is_some_and(is_null) {
            return None;
        }
        match node.as_scalar().map(|s| s.as_str().to_ascii_lowercase()) {
            Some(s) if s == "true" => Some(true),
            Some(s) if s == "false" => Some(false),
            _ => {
                self.error(node.span(), format!("`{name}` must be true or false"));
                None
            }
        }
    }

    /// A whole number from 0 to `max`: `None` when absent, or when it is not one
    /// (reported).
    pub(crate) fn number(&mut self, map: &MarkedMappingNode, name: &str, max: u64) -> Option<u64> {
        let node = map.get_node(name)?;
        let text = node.as_scalar().map(MarkedScalarNode::as_str);
        match text
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|&n| n <= max)
        {
            Some(n) => Some(n),
            None => {
                self.error(
                    node.span(),
                    format!(
                        "`{name}` must be a whole number from 0 to {max}, got `{}`",
                        text.unwrap_or("a non-scalar")
                    ),
                );
                None
            }
        }
    }
}

/// Parses a rule file's YAML: duplicate keys are errors, and scalars stay text (a
/// number or `true` is read by the field that expects it).
fn parse(text: &str) -> Result<Node, marked_yaml::LoadError> {
    let options = LoaderOptions::default()
        .error_on_duplicate_keys(true)
        .prevent_coercion(true);
    marked_yaml::parse_yaml_with_options(0, text, options)
}

/// `text` without the byte order mark an editor may have put first (not part of the
/// first key).
fn without_bom(text: &str) -> &str {
    text.strip_prefix('\u{feff}').unwrap_or(text)
}

/// The first character a rule file may not hold, as (line, column, message), both
/// 1-based: a control character other than tab, line feed and carriage return. A NUL
/// in particular ends the YAML reader's view of the file, which would load what came
/// before it and silently drop the rest.
fn forbidden_character(text: &str) -> Option<(usize, usize, String)> {
    let at = text.find(|c: char| c.is_control() && !matches!(c, '\t' | '\n' | '\r'))?;
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    let c = text[at..].chars().next().map_or(0, u32::from);
    Some((
        line,
        column,
        format!("a control character (U+{c:04X}) where text was expected: a rule file is text; remove it"),
    ))
}

/// How deep the YAML of a rule file may nest, whatever `--max-rule-depth` says (the
/// one reader of a file, its rules and its `http` section alike, holds it to this
/// bound before parsing): each descriptor level is two YAML levels (a list and a
/// mapping), [`MAX_MAX_DEPTH`] of them and room for the fields inside the deepest. The
/// YAML reader recurses once per level; this bound is what keeps it within a 2 MiB
/// stack, and the threads that read rule files are given twice that
/// ([`RELOAD_STACK_SIZE`](super::RELOAD_STACK_SIZE)).
pub(crate) const MAX_YAML_DEPTH: usize = 2 * MAX_MAX_DEPTH + 32;

/// Where the YAML of `text` first nests deeper than `limit` levels, as (line, column,
/// message), found without parsing: block levels from the indentation (and each `- `,
/// `? ` or `: ` that opens a collection inside a line: `- - x`, `? ? x`, `: - x`), flow levels from brackets outside quotes and
/// comments. An upper estimate for ordinary files (a block scalar's lines are skipped),
/// linear in the text.
fn too_deep(text: &str, limit: usize) -> Option<(usize, usize, String)> {
    let message =
        || format!("the YAML nests more than {limit} levels deep (the rule files' limit)");
    let mut indents: Vec<usize> = Vec::new();
    let mut flow = 0usize;
    // A quoted scalar that goes on past the end of its line: `'` or `"`.
    let mut quote: Option<char> = None;
    // The indentation a block scalar's lines (`|`, `>`) are deeper than.
    let mut block_scalar: Option<usize> = None;
    for (number, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let content = &line[indent..];
        if let Some(parent) = block_scalar {
            if content.is_empty() || indent > parent {
                continue;
            }
            block_scalar = None;
        }
        let mut chars = content.char_indices().peekable();
        if quote.is_none() && flow == 0 {
            if content.is_empty() || content.starts_with('#') {
                continue;
            }
            while indents.last().is_some_and(|&i| i >= indent) {
                indents.pop();
            }
            indents.push(indent);
            // `- - x`, `? ? x`, `: - x`: each indicator opens a collection inside
            // the line (a list, a mapping with a complex key, the value of one).
            while let Some(&(at, '-' | '?' | ':')) = chars.peek() {
                let next = content[at + 1..].chars().next();
                if !matches!(next, None | Some(' ' | '\t')) {
                    break;
                }
                chars.next();
                while chars.next_if(|&(_, c)| c == ' ' || c == '\t').is_some() {}
                indents.push(indent + at + 2);
            }
        }
        if indents.len() + flow > limit {
            return Some((number + 1, indent + 1, message()));
        }
        let mut previous = ' ';
        while let Some((at, c)) = chars.next() {
            match quote {
                Some('"') => match c {
                    '\\' => {
                        chars.next();
                    }
                    '"' => quote = None,
                    _ => {}
                },
                Some(_) => {
                    if c == '\'' && chars.next_if(|&(_, c)| c == '\'').is_none() {
                        quote = None;
                    }
                }
                None => match c {
                    '"' | '\'' if matches!(previous, ' ' | '\t' | '[' | '{' | ',' | ':') => {
                        quote = Some(c);
                    }
                    '#' if matches!(previous, ' ' | '\t') => break,
                    '[' | '{' => {
                        flow += 1;
                        if indents.len() + flow > limit {
                            let column = indent + content[..at].chars().count() + 1;
                            return Some((number + 1, column, message()));
                        }
                    }
                    ']' | '}' => flow = flow.saturating_sub(1),
                    '|' | '>' if flow == 0 && matches!(previous, ' ' | '\t' | ':') => {
                        // A block scalar header ends the line's structure (`key: |-`).
                        let rest = content[at + 1..].trim_end();
                        if rest.chars().all(|c| matches!(c, '-' | '+' | '0'..='9')) {
                            block_scalar = Some(indent);
                        }
                    }
                    _ => {}
                },
            }
            previous = c;
        }
    }
    None
}

/// YAML's null: a plain (unquoted) empty value, `~` or `null`.
pub(crate) fn is_null(scalar: &MarkedScalarNode) -> bool {
    scalar.may_coerce() && matches!(scalar.as_str(), "" | "~" | "null" | "Null" | "NULL")
}

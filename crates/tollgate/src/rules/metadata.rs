//! [`Metadata`]: a descriptor's `metadata`, as the rule file gives it, for the response's
//! dynamic metadata (Envoy's quota-aware routing reads which descriptors passed, with
//! their metadata).

use marked_yaml::Node;

/// A YAML value of a descriptor's `metadata`: what a `google.protobuf.Struct` can hold.
#[derive(Debug, Clone, PartialEq)]
pub enum Metadata {
    /// `null`, `~` or nothing.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// A number (as a double, as `google.protobuf.Value` holds it).
    Number(f64),
    /// Any other scalar.
    String(String),
    /// A sequence.
    List(Vec<Metadata>),
    /// A mapping, in the file's order.
    Map(Vec<(String, Metadata)>),
}

/// Numbers are finite (`nan` and `inf` read as strings), so equality is an equivalence.
impl Eq for Metadata {}

impl Metadata {
    /// The value of a YAML node. Plain scalars that read as a boolean, a number or null
    /// are those; every other scalar is a string.
    pub(crate) fn from_node(node: &Node) -> Self {
        match node {
            Node::Scalar(s) => {
                let text = s.as_str();
                match text {
                    "" | "~" | "null" | "Null" | "NULL" => Metadata::Null,
                    "true" | "True" | "TRUE" => Metadata::Bool(true),
                    "false" | "False" | "FALSE" => Metadata::Bool(false),
                    _ => match text.parse::<f64>() {
                        Ok(n) if n.is_finite() && looks_numeric(text) => Metadata::Number(n),
                        _ => Metadata::String(text.to_string()),
                    },
                }
            }
            Node::Sequence(seq) => Metadata::List(seq.iter().map(Self::from_node).collect()),
            Node::Mapping(map) => Metadata::Map(
                map.iter()
                    .map(|(k, v)| (k.as_str().to_string(), Self::from_node(v)))
                    .collect(),
            ),
        }
    }
}

/// Whether a scalar is written as a number (not `inf`, `nan` or `1_000`, which Rust's
/// parser or YAML might read otherwise).
fn looks_numeric(text: &str) -> bool {
    text.bytes()
        .all(|b| b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E'))
        && text.bytes().any(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_become_the_values_they_read_as() {
        let node = marked_yaml::parse_yaml(
            0,
            "a: 1\nb: 2.5\nc: true\nd: ~\ne: text\nf: [x, 3]\ng: {h: i}\nj: nan\n",
        )
        .unwrap();
        assert_eq!(
            Metadata::from_node(&node),
            Metadata::Map(vec![
                ("a".into(), Metadata::Number(1.0)),
                ("b".into(), Metadata::Number(2.5)),
                ("c".into(), Metadata::Bool(true)),
                ("d".into(), Metadata::Null),
                ("e".into(), Metadata::String("text".into())),
                (
                    "f".into(),
                    Metadata::List(vec![Metadata::String("x".into()), Metadata::Number(3.0)])
                ),
                (
                    "g".into(),
                    Metadata::Map(vec![("h".into(), Metadata::String("i".into()))])
                ),
                ("j".into(), Metadata::String("nan".into())),
            ])
        );
    }
}

//! Reading a JSON body one value at a time (serde's visitors over `serde_json`'s
//! streaming deserializer), so that a body costs what it keeps, not what it says: the
//! caps on descriptors and entries stop the parse where they are crossed (a body of
//! 100,000 descriptors is refused at the 65th, having built 64), a field nobody reads
//! is skipped ([`IgnoredAny`]) rather than built into a tree, and a key or value is
//! measured before it is copied.
//!
//! Errors keep the words a caller can act on: each value is read with a sentence
//! saying what it must be ([`Reader::expect`]), used when it is of the wrong type; a
//! value that is refused for what it holds says so itself ([`Reader::refuse`]); what
//! is not JSON at all is "the body is not valid JSON: …".

use std::cell::RefCell;
use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};
use serde_json::error::Category;

/// Makes a visitor its own seed, read with the deserializer's method `$how`:
/// `self_seed!(Entries<'_>, deserialize_any);`.
macro_rules! self_seed {
    ($t:ty, $how:ident) => {
        impl<'de> serde::de::DeserializeSeed<'de> for $t {
            type Value = <Self as serde::de::Visitor<'de>>::Value;

            fn deserialize<D: serde::de::Deserializer<'de>>(
                self,
                d: D,
            ) -> Result<Self::Value, D::Error> {
                d.$how(self)
            }
        }
    };
}
pub(crate) use self_seed;

/// The words of the error a body's reading ends with, kept beside `serde_json`'s own
/// (which would add a position to them).
#[derive(Debug, Default)]
pub(crate) struct Reader {
    /// What the value being read must be: the message when it is of the wrong type.
    expected: RefCell<String>,
    /// A refusal of a value for what it holds, which ends the reading.
    refused: RefCell<Option<String>>,
}

impl Reader {
    /// Says what the next value read must be ("`domain` must be a string"), written
    /// over the last such sentence (its buffer is kept: no allocation per value).
    pub(crate) fn expect(&self, what: fmt::Arguments<'_>) {
        let mut expected = self.expected.borrow_mut();
        expected.clear();
        let _ = fmt::Write::write_fmt(&mut *expected, what);
    }

    /// Ends the reading with `why`.
    pub(crate) fn refuse<E: de::Error>(&self, why: impl Into<String>) -> E {
        *self.refused.borrow_mut() = Some(why.into());
        E::custom("refused")
    }

    /// Reads the next value of `map`, which must be what `what` says.
    pub(crate) fn value<'de, T: de::Deserialize<'de>, A: MapAccess<'de>>(
        &self,
        map: &mut A,
        what: fmt::Arguments<'_>,
    ) -> Result<T, A::Error> {
        self.expect(what);
        map.next_value()
    }

    /// Reads `body` with `seed`, which must be an object (`top` says so in a caller's
    /// words), and nothing after it.
    pub(crate) fn read<'de, S: DeserializeSeed<'de>>(
        &self,
        body: &'de [u8],
        top: &str,
        seed: S,
    ) -> Result<S::Value, String> {
        self.expect(format_args!("{top}"));
        let mut de = serde_json::Deserializer::from_slice(body);
        let read = seed
            .deserialize(&mut de)
            .and_then(|value| de.end().map(|()| value));
        read.map_err(|e| {
            if let Some(why) = self.refused.borrow_mut().take() {
                return why;
            }
            match e.classify() {
                Category::Data => self.expected.borrow().clone(),
                _ => format!("the body is not valid JSON: {e}"),
            }
        })
    }
}

/// A key of an object whose known fields are `names`: the index of the name it is,
/// `None` for another. With `strict`, another name is refused instead
/// ("unknown field `x` (expected …)", listing `strict`).
pub(crate) struct Field<'r> {
    pub reader: &'r Reader,
    pub names: &'static [&'static str],
    pub strict: Option<&'static str>,
}

self_seed!(Field<'_>, deserialize_str);

impl<'de> Visitor<'de> for Field<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a field name")
    }

    fn visit_str<E: de::Error>(self, name: &str) -> Result<Self::Value, E> {
        match self.names.iter().position(|n| *n == name) {
            Some(i) => Ok(Some(i)),
            None => match self.strict {
                Some(expected) => Err(self
                    .reader
                    .refuse(format!("unknown field `{name}` (expected {expected})"))),
                None => Ok(None),
            },
        }
    }
}

/// Skips the value of a field nobody reads, without building it.
pub(crate) fn skip<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(|_| ())
}

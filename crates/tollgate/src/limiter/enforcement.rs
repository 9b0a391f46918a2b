//! [`Enforcement`]: the emergency switch. A domain switched to [`Mode::Shadow`] has every
//! request still decided, counted and reported, but answered OK, as if each of its rules
//! said `shadow_mode: true`. The switch lives beside the rules, not in them: a reload
//! keeps it, and it takes effect at the next decision, with no file edited.
//!
//! The state is a mode for every domain (`"*"`) and a mode per named domain, which wins
//! over it: switching `"*"` clears the per-domain modes (so `"*"` to `enforce` ends every
//! switch at once). A decision reads it with one atomic load while nothing is switched.
//!
//! ```
//! use tollgate::limiter::{Enforcement, Mode};
//! let switch = Enforcement::default();
//! assert!(!switch.is_shadow("api"));
//! switch.set("api", Mode::Shadow, "10.0.0.7:51234", 1_700_000_000)?;
//! assert!(switch.is_shadow("api"));
//! assert!(!switch.is_shadow("auth"));
//! switch.set("*", Mode::Shadow, "10.0.0.7:51234", 1_700_000_060)?;
//! assert!(switch.is_shadow("auth"));
//! switch.set("*", Mode::Enforce, "10.0.0.7:51234", 1_700_000_120)?;
//! assert!(!switch.is_shadow("api"));
//! # Ok::<(), String>(())
//! ```

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::RwLock;

/// What a domain's rules do with a request over a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// As the rules say (the default).
    #[default]
    Enforce,
    /// Decided, counted and reported, but answered OK.
    Shadow,
}

impl Mode {
    /// `"enforce"` or `"shadow"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Shadow => "shadow",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Mode::Enforce),
            "shadow" => Ok(Mode::Shadow),
            other => Err(format!(
                "unknown enforcement mode `{other}`: expected `enforce` or `shadow`"
            )),
        }
    }
}

/// The last change of the switch: what, by whom, when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The domain switched (`"*"`: every domain).
    pub domain: String,
    /// Its new mode.
    pub mode: Mode,
    /// Who asked (the caller's address, as the admin endpoint saw it).
    pub by: String,
    /// When (Unix seconds).
    pub at_unix: u64,
}

/// The whole switch, as shown (`GET /v1/enforcement`, `/rules`) and as shared between
/// instances (a Redis key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnforcementState {
    /// The mode of every domain that has none of its own.
    pub all: Mode,
    /// The domains with a mode of their own.
    pub domains: BTreeMap<String, Mode>,
    /// The last change, if any.
    pub last_change: Option<Change>,
}

impl EnforcementState {
    /// The mode of `domain`.
    pub fn mode_of(&self, domain: &str) -> Mode {
        self.domains.get(domain).copied().unwrap_or(self.all)
    }

    /// Whether some domain is in shadow.
    fn any_shadow(&self) -> bool {
        self.all == Mode::Shadow || self.domains.values().any(|m| *m == Mode::Shadow)
    }
}

/// The emergency switch, shared by a limiter and the admin endpoint that moves it. See
/// the module documentation.
#[derive(Debug, Default)]
pub struct Enforcement {
    /// Some domain is in shadow: decisions read the state only then.
    engaged: AtomicBool,
    state: RwLock<EnforcementState>,
    /// Bumped by every change made here ([`Enforcement::set`]): a copy read from
    /// elsewhere before a change here must not replace it.
    generation: AtomicU64,
}

/// The most domains the switch names one by one; past it, a switch of a further domain
/// is refused (switch `"*"` instead).
pub const MAX_SWITCHED_DOMAINS: usize = 256;

impl Enforcement {
    /// Whether requests of `domain` are answered OK whatever their limits say.
    pub fn is_shadow(&self, domain: &str) -> bool {
        self.engaged.load(Ordering::Acquire) && self.state.read().mode_of(domain) == Mode::Shadow
    }

    /// Switches `domain` (`"*"`: every domain, clearing the per-domain modes) to `mode`,
    /// as asked by `by` at `at_unix`. Returns the state after. Refused (with the state
    /// unchanged) when the switch already names [`MAX_SWITCHED_DOMAINS`] domains.
    pub fn set(
        &self,
        domain: &str,
        mode: Mode,
        by: &str,
        at_unix: u64,
    ) -> Result<EnforcementState, String> {
        let mut state = self.state.write();
        if domain == "*" {
            state.all = mode;
            state.domains.clear();
        } else {
            if !state.domains.contains_key(domain) && state.domains.len() >= MAX_SWITCHED_DOMAINS {
                return Err(format!(
                    "the switch already names {MAX_SWITCHED_DOMAINS} domains; switch \"*\" instead"
                ));
            }
            state.domains.insert(domain.to_string(), mode);
        }
        state.last_change = Some(Change {
            domain: domain.to_string(),
            mode,
            by: by.to_string(),
            at_unix,
        });
        self.engaged.store(state.any_shadow(), Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(state.clone())
    }

    /// How many changes were made here ([`Enforcement::set`]); see
    /// [`Enforcement::replace_if`].
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// [`replace`](Self::replace), unless a change was made here since `generation` was
    /// read (the copy `new`, read before it, would undo it). Returns whether it changed
    /// anything.
    pub fn replace_if(&self, generation: u64, new: EnforcementState) -> bool {
        let mut state = self.state.write();
        if self.generation.load(Ordering::Acquire) != generation || *state == new {
            return false;
        }
        *state = new;
        self.engaged.store(state.any_shadow(), Ordering::Release);
        true
    }

    /// Replaces the whole state (one shared by another instance). Returns whether it
    /// changed anything.
    pub fn replace(&self, new: EnforcementState) -> bool {
        let mut state = self.state.write();
        if *state == new {
            return false;
        }
        *state = new;
        self.engaged.store(state.any_shadow(), Ordering::Release);
        true
    }

    /// The state now.
    pub fn state(&self) -> EnforcementState {
        self.state.read().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_domains_own_mode_wins_over_every_domains() {
        let s = Enforcement::default();
        s.set("*", Mode::Shadow, "a", 1).unwrap();
        s.set("auth", Mode::Enforce, "a", 2).unwrap();
        assert!(s.is_shadow("api"));
        assert!(!s.is_shadow("auth"));
        // Switching every domain clears the per-domain modes.
        s.set("*", Mode::Enforce, "b", 3).unwrap();
        assert!(!s.is_shadow("api") && !s.is_shadow("auth"));
        assert!(s.state().domains.is_empty());
        assert_eq!(
            s.state().last_change,
            Some(Change {
                domain: "*".into(),
                mode: Mode::Enforce,
                by: "b".into(),
                at_unix: 3
            })
        );
    }

    #[test]
    fn a_shared_state_replaces_the_local_one() {
        let here = Enforcement::default();
        let there = Enforcement::default();
        let shared = there.set("api", Mode::Shadow, "x", 5).unwrap();
        assert!(here.replace(shared.clone()));
        assert!(here.is_shadow("api"));
        assert!(!here.replace(shared));
        assert!(here.replace(EnforcementState::default()));
        assert!(!here.is_shadow("api"));
    }

    #[test]
    fn modes_parse_and_print() {
        assert_eq!("shadow".parse::<Mode>(), Ok(Mode::Shadow));
        assert_eq!(Mode::Enforce.as_str(), "enforce");
        assert!("off".parse::<Mode>().unwrap_err().contains("`off`"));
    }
}

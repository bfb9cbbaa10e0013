//! Deliberate mutants and test hooks, in one place.
//!
//! A *mutant* is a deliberately broken variant of real code that a check must catch (a check
//! that cannot fail proves nothing). Every mutant of the library goes through this module: the
//! code it breaks holds a hook value from here (a field such as `hooks: ControlHooks<T, B>`) and
//! calls a named method of it at the one point where the mutant departs from the real code.
//! The hot code carries no `cfg` lines; they all live here.
//!
//! In normal builds (neither `cfg(test)` nor `--cfg prefill_loom`) `hooks/off.rs` is compiled:
//! every hook type is zero-sized (checked at compile time there) and every method is an
//! `#[inline(always)]` no-op or the real behaviour, so the request path compiles as if the hook
//! were not there. Under `cfg(test)` or `--cfg prefill_loom`, `hooks/armed.rs` provides the same
//! API plus the mutants' state; a test arms a mutant through that file's constructors (or
//! `Control::with_mutant`), and the default hook of every type is the correct behaviour.

#[cfg_attr(not(any(test, prefill_loom)), path = "hooks/off.rs")]
#[cfg_attr(any(test, prefill_loom), path = "hooks/armed.rs")]
mod imp;

pub(crate) use imp::*;
// Public (through `control::Mutant`) because the loom suite is an integration test.
#[cfg(any(test, prefill_loom))]
pub use imp::Mutant;

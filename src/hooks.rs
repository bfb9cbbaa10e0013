//! The switch that arms deliberate mutants, knowing none of them.
//!
//! A *mutant* is a deliberately broken variant of real code that a check must catch (a check
//! that cannot fail proves nothing). Each site declares its own mutants next to the code they
//! break (an enum such as `control::Mutant` or `push::DispatchMutant`, every one listed with
//! the check that catches it in docs/properties.md) and holds a [`Seam`] of that enum, asking
//! [`Seam::is`] at the one point where a mutant departs from the real code. A mutant with
//! state of its own (a lagging copy of the route, say) holds it in a `Seam` of a small
//! site-local type and reads it through [`Seam::armed`].
//!
//! In normal builds (neither `cfg(test)` nor `--cfg prefill_loom`) a `Seam` is zero-sized and
//! never armed: `is` is an `#[inline(always)]` `false` and `armed` a `None`, so the hot code
//! compiles as if the seam were not there and carries no `cfg` lines. Under `cfg(test)` or
//! `--cfg prefill_loom` it is an `Option` a test arms through the site's `with_mutant`.

/// Whether seams can be armed in this build (test and loom builds). Sites assert with it that
/// their seams add no byte to normal builds: `assert!(ARMABLE || size_of::<T>() == 0)`.
pub(crate) const ARMABLE: bool = cfg!(any(test, prefill_loom));

#[cfg(not(any(test, prefill_loom)))]
mod imp {
    /// Normal builds: never armed, zero-sized.
    pub(crate) struct Seam<M>(std::marker::PhantomData<fn() -> M>);

    impl<M> Clone for Seam<M> {
        #[inline(always)]
        fn clone(&self) -> Self {
            *self
        }
    }

    impl<M> Copy for Seam<M> {}

    /// Never armed, so every two seams are alike.
    impl<M> PartialEq for Seam<M> {
        #[inline(always)]
        fn eq(&self, _other: &Self) -> bool {
            true
        }
    }

    impl<M> Seam<M> {
        /// The seam with no mutant: the real code.
        #[inline(always)]
        pub(crate) const fn off() -> Self {
            Seam(std::marker::PhantomData)
        }

        /// Whether `mutant` is armed here: never.
        #[inline(always)]
        pub(crate) fn is(&self, _mutant: M) -> bool
        where
            M: PartialEq,
        {
            false
        }

        /// The armed mutant (or its state): none.
        #[inline(always)]
        pub(crate) const fn armed(&self) -> Option<&M> {
            None
        }
    }

    const _: () = assert!(std::mem::size_of::<Seam<[u64; 8]>>() == 0);
}

#[cfg(any(test, prefill_loom))]
mod imp {
    /// Test and loom builds: armed with at most one mutant (or its state).
    #[derive(Clone, Copy, PartialEq)]
    pub(crate) struct Seam<M>(Option<M>);

    impl<M> Seam<M> {
        /// The seam with no mutant: the real code.
        pub(crate) const fn off() -> Self {
            Seam(None)
        }

        /// The seam running `mutant`.
        pub(crate) const fn on(mutant: M) -> Self {
            Seam(Some(mutant))
        }

        /// Whether `mutant` is armed here.
        pub(crate) fn is(&self, mutant: M) -> bool
        where
            M: PartialEq,
        {
            self.0.as_ref() == Some(&mutant)
        }

        /// The armed mutant (or its state), if any.
        pub(crate) const fn armed(&self) -> Option<&M> {
            self.0.as_ref()
        }
    }
}

pub(crate) use imp::Seam;

impl<M> Default for Seam<M> {
    #[inline(always)]
    fn default() -> Self {
        Seam::off()
    }
}

impl<M: std::fmt::Debug> std::fmt::Debug for Seam<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Seam").field(&self.armed()).finish()
    }
}

//! The binding factory's deliberate mutants, and the seam where they break a build (see
//! `crate::hooks`).

use std::sync::Arc;

use crate::hooks::{Seam, ARMABLE};
use crate::push::AffinityTable;

/// A deliberate mutant of the factory's builds (see `DefaultBindingFactory::with_mutant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FactoryMutant {
    /// Views ignore the admission set (the admission check must catch it).
    IgnoreAdmission,
    /// Every binding the factory builds shares the first one's session-affinity table, so a
    /// rebuilt binding inherits the old entries (the affinity checks must catch it).
    #[cfg_attr(not(test), allow(dead_code))]
    InheritAffinity,
}

/// The first affinity table the factory made (the `InheritAffinity` mutant's state).
type FirstTable = Arc<parking_lot::Mutex<Option<Arc<AffinityTable>>>>;

/// The factory's seam: builds as they are unless a mutant is armed. Zero-sized in normal
/// builds.
#[derive(Clone, Default)]
pub(super) struct FactorySeam {
    mutant: Seam<FactoryMutant>,
    first_table: Seam<FirstTable>,
}

const _: () = assert!(ARMABLE || std::mem::size_of::<FactorySeam>() == 0);

impl FactorySeam {
    /// The seam running `mutant`.
    #[cfg(test)]
    pub(super) fn on(mutant: FactoryMutant) -> Self {
        FactorySeam {
            mutant: Seam::on(mutant),
            first_table: match mutant {
                FactoryMutant::InheritAffinity => Seam::on(FirstTable::default()),
                FactoryMutant::IgnoreAdmission => Seam::off(),
            },
        }
    }

    /// Whether views ignore the admission set: never (`IgnoreAdmission`: always).
    #[inline(always)]
    pub(super) fn ignores_admission(&self) -> bool {
        self.mutant.is(FactoryMutant::IgnoreAdmission)
    }

    /// The session-affinity table of a new binding's dispatcher: the fresh one it was given
    /// (`InheritAffinity`: the first table the factory ever made).
    #[inline(always)]
    pub(super) fn affinity_table(
        &self,
        fresh: Option<Arc<AffinityTable>>,
    ) -> Option<Arc<AffinityTable>> {
        let Some(first) = self.first_table.armed() else {
            return fresh;
        };
        let mut first = first.lock();
        if first.is_none() {
            *first = fresh;
        }
        first.clone()
    }
}

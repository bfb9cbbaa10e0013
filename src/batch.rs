//! The one inline output batch: what one input to the machine ([`lifecycle::Actions`]) or one
//! call to the control core ([`control::Effects`]) asks the caller to do, in order.
//!
//! A fixed-capacity inline array, because the hot path must not allocate. No input to the
//! machine yields more than three actions (a cancellation, a retirement and a start), and the
//! control core forwards a subset of them, so four slots leave one spare. Overflowing the
//! batch is a bug in the machine, not a runtime condition, hence the assert in `push`.
//!
//! [`lifecycle::Actions`]: crate::lifecycle::Actions
//! [`control::Effects`]: crate::control::Effects

/// Slots in a batch.
const CAPACITY: usize = 4;

/// Up to four orders, in the order the caller must carry them out. Inline, no allocation.
#[must_use = "the caller must carry out every order in the batch"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Batch<A> {
    /// Slots below `len` are filled, the others empty.
    items: [Option<A>; CAPACITY],
    len: usize,
}

impl<A> Default for Batch<A> {
    fn default() -> Self {
        Batch {
            items: [None, None, None, None],
            len: 0,
        }
    }
}

impl<A> Batch<A> {
    /// Appends one order.
    pub(crate) fn push(&mut self, order: A) {
        // Dropping an order would leave a build or a timer unmanaged: fail loudly instead.
        assert!(self.len < CAPACITY, "output batch overflow");
        self.items[self.len] = Some(order);
        self.len += 1;
    }

    /// Number of orders.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The orders, borrowed, in order.
    pub fn iter(&self) -> std::iter::Flatten<std::slice::Iter<'_, Option<A>>> {
        self.items[..self.len].iter().flatten()
    }

    /// The orders as a vector (allocates; convenient in tests and traces).
    pub fn to_vec(&self) -> Vec<A>
    where
        A: Clone,
    {
        self.iter().cloned().collect()
    }
}

/// Owning iterator over a [`Batch`].
#[derive(Debug)]
pub struct IntoIter<A> {
    items: [Option<A>; CAPACITY],
    next: usize,
    len: usize,
}

impl<A> Iterator for IntoIter<A> {
    type Item = A;

    fn next(&mut self) -> Option<A> {
        if self.next < self.len {
            self.next += 1;
            self.items[self.next - 1].take()
        } else {
            None
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.len - self.next;
        (left, Some(left))
    }
}

impl<A> ExactSizeIterator for IntoIter<A> {}

impl<A> IntoIterator for Batch<A> {
    type Item = A;
    type IntoIter = IntoIter<A>;

    fn into_iter(self) -> IntoIter<A> {
        IntoIter {
            items: self.items,
            next: 0,
            len: self.len,
        }
    }
}

impl<'a, A> IntoIterator for &'a Batch<A> {
    type Item = &'a A;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Option<A>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_of(n: u8) -> Batch<u8> {
        let mut batch = Batch::default();
        for i in 0..n {
            batch.push(i * 10);
        }
        batch
    }

    #[test]
    fn batch_reports_its_length_and_emptiness() {
        for n in 0..=4u8 {
            let batch = batch_of(n);
            assert_eq!(batch.len(), usize::from(n));
            assert_eq!(batch.is_empty(), n == 0, "n = {n}");
        }
    }

    #[test]
    fn batch_yields_every_order_in_push_order_every_way() {
        for n in 0..=4u8 {
            let expected: Vec<u8> = (0..n).map(|i| i * 10).collect();
            let batch = batch_of(n);
            assert_eq!(batch.iter().copied().collect::<Vec<_>>(), expected);
            assert_eq!((&batch).into_iter().copied().collect::<Vec<_>>(), expected);
            assert_eq!(batch.to_vec(), expected);
            let mut owned = batch.into_iter();
            assert_eq!(owned.len(), usize::from(n));
            assert_eq!(owned.by_ref().collect::<Vec<_>>(), expected);
            // Exhausted stays exhausted (a full batch must not read past its last slot).
            assert_eq!(owned.next(), None);
            assert_eq!(owned.next(), None);
        }
    }

    #[test]
    fn owned_iterator_reports_exactly_what_is_left() {
        // Drivers size their work from `len()` mid-iteration: it must count down to zero.
        for n in 0..=4u8 {
            let mut owned = batch_of(n).into_iter();
            for left in (0..usize::from(n)).rev() {
                assert!(owned.next().is_some());
                assert_eq!(owned.len(), left, "n = {n}");
                assert_eq!(owned.size_hint(), (left, Some(left)));
            }
            assert_eq!(owned.next(), None);
            assert_eq!(owned.len(), 0);
        }
    }

    #[test]
    #[should_panic(expected = "output batch overflow")]
    fn batch_refuses_a_fifth_order() {
        let mut batch = batch_of(4);
        batch.push(50);
    }
}

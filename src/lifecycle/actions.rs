//! The output batch of one [`Machine::handle`](super::Machine::handle) call.
//!
//! A fixed-capacity inline array: the machine is a plain value type and its hot path must not
//! allocate. No input yields more than three actions (a cancellation, a retirement and a start);
//! the capacity leaves one spare.

use super::Action;

const CAPACITY: usize = 4;

/// The actions produced by one input, in the order the driver must carry them out.
#[must_use = "the driver must carry out every action"]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Actions<T> {
    items: [Option<Action<T>>; CAPACITY],
    len: usize,
}

impl<T> Actions<T> {
    pub(super) fn new() -> Self {
        Actions {
            items: [None, None, None, None],
            len: 0,
        }
    }

    pub(super) fn push(&mut self, action: Action<T>) {
        // The machine's transitions bound the batch; overflowing it is a bug in the machine.
        assert!(self.len < CAPACITY, "action batch overflow");
        self.items[self.len] = Some(action);
        self.len += 1;
    }

    /// Number of actions.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the input produced no action.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The actions, borrowed, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Action<T>> {
        self.items[..self.len].iter().flatten()
    }

    /// The actions as a slice-backed vector (allocates; convenient in tests and traces).
    pub fn to_vec(&self) -> Vec<Action<T>>
    where
        T: Clone,
    {
        self.iter().cloned().collect()
    }
}

/// Owning iterator over an [`Actions`] batch.
#[derive(Debug)]
pub struct ActionsIntoIter<T> {
    items: [Option<Action<T>>; CAPACITY],
    next: usize,
    len: usize,
}

impl<T> Iterator for ActionsIntoIter<T> {
    type Item = Action<T>;

    fn next(&mut self) -> Option<Action<T>> {
        // Slots below `len` are always filled; the ones above are always empty.
        if self.next < self.len {
            self.next += 1;
            self.items[self.next - 1].take()
        } else {
            None
        }
    }
}

impl<T> IntoIterator for Actions<T> {
    type Item = Action<T>;
    type IntoIter = ActionsIntoIter<T>;

    fn into_iter(self) -> ActionsIntoIter<T> {
        ActionsIntoIter {
            items: self.items,
            next: 0,
            len: self.len,
        }
    }
}

impl<'a, T> IntoIterator for &'a Actions<T> {
    type Item = &'a Action<T>;
    type IntoIter = std::iter::Flatten<std::slice::Iter<'a, Option<Action<T>>>>;

    fn into_iter(self) -> Self::IntoIter {
        self.items[..self.len].iter().flatten()
    }
}

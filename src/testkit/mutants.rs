//! Deliberately broken code under test, which the fuzz checks must reject on the seed corpus:
//! that shows the checks (and the corpus) can fail.
//!
//! - [`Mutant`]: wraps the real [`Machine`] and corrupts what a driver observes in one way
//!   (judged by [`run_script`](super::machine_fuzz::run_script));
//! - [`CARD_MUTANTS`]: broken card resolvers (judged by
//!   [`check_cards_with`](super::card_fuzz::check_cards_with)).

use super::card_fuzz::Resolver;
use super::machine_fuzz::Stepper;
use super::reference::MachineView;
use crate::advert::{resolve, AdvertError, DecodeDefaults, ModelCard, PrefillConfig};
use crate::lifecycle::{Action, Input, Lifecycle, Machine, RetryPolicy};

/// The ways a mutant breaks the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Publishes a stale build instead of discarding it (breaks I4).
    PublishesStaleBuilds,
    /// Never retires a replaced binding (breaks I5; a leak in a real driver).
    ForgetsRetire,
    /// Never cancels the build in flight on a retarget (breaks I3).
    ForgetsCancel,
    /// Reports Active while a build is in flight (a reader would route on a withdrawn binding).
    ActiveWhileBuilding,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: [Mutation; 4] = [
        Mutation::PublishesStaleBuilds,
        Mutation::ForgetsRetire,
        Mutation::ForgetsCancel,
        Mutation::ActiveWhileBuilding,
    ];
}

/// The real machine, observed through a [`Mutation`].
#[derive(Clone, Debug)]
pub struct Mutant {
    machine: Machine<u8>,
    mutation: Mutation,
}

impl Mutant {
    /// A fresh mutant machine.
    pub fn new(mutation: Mutation, policy: RetryPolicy) -> Self {
        Mutant {
            machine: Machine::new(policy),
            mutation,
        }
    }
}

impl Stepper for Mutant {
    fn step(&mut self, input: Input<u8>) -> Vec<Action<u8>> {
        let target = self.machine.desired().copied().unwrap_or(0);
        let actions = self.machine.handle(input).into_iter();
        match self.mutation {
            Mutation::PublishesStaleBuilds => actions
                .map(|a| match a {
                    Action::Discard { build } => Action::Publish { build, target },
                    other => other,
                })
                .collect(),
            Mutation::ForgetsRetire => actions
                .filter(|a| !matches!(a, Action::Retire { .. }))
                .collect(),
            Mutation::ForgetsCancel => actions
                .filter(|a| !matches!(a, Action::CancelBuild { .. }))
                .collect(),
            Mutation::ActiveWhileBuilding => actions.collect(),
        }
    }

    fn view(&self) -> MachineView<u8> {
        let mut view = MachineView::of(&self.machine);
        if self.mutation == Mutation::ActiveWhileBuilding && view.in_flight.is_some() {
            view.lifecycle = Lifecycle::Active;
        }
        view
    }
}

/// Broken card resolvers, by name.
pub const CARD_MUTANTS: &[(&str, Resolver)] = &[
    ("last card wins", last_card_wins),
    ("keeps active-block tracking", keeps_active_block_tracking),
    ("identical cards disagree", identical_cards_disagree),
    ("no card resolves to defaults", no_card_resolves_to_defaults),
];

fn last_card_wins(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    let reversed: Vec<ModelCard> = cards.iter().rev().cloned().collect();
    resolve(&reversed, decode)
}

fn keeps_active_block_tracking(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    resolve(cards, decode).map(|mut cfg| {
        if let (true, Some(kv)) = (cfg.advertised, cfg.kv_router_config.as_mut()) {
            kv.router_track_active_blocks = true;
        }
        cfg
    })
}

fn identical_cards_disagree(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    resolve(cards, decode).map(|cfg| PrefillConfig {
        disagreeing_cards: cfg.total_cards - 1,
        ..cfg
    })
}

fn no_card_resolves_to_defaults(
    cards: &[ModelCard],
    decode: &DecodeDefaults,
) -> Result<PrefillConfig, AdvertError> {
    if cards.is_empty() {
        return resolve(&[ModelCard::default()], decode);
    }
    resolve(cards, decode)
}

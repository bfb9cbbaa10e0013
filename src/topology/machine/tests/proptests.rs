//! Random discovery event sequences through the machine and the checking [`World`]: every
//! batch is carried out in order and checked as it goes (the target held always admits
//! someone, grows flagged right, generations fresh and never named after retirement), and
//! between events (the target is the machine's, admits exactly the live instances carrying
//! its card, exists exactly when one prefill set admits someone and one decode set is live,
//! memory bounded).

use super::*;
use proptest::prelude::*;

const COMPONENTS: [&str; 5] = ["prefill", "prefill-green", "decode", "decode-b", "encoder"];

#[derive(Clone, Debug)]
enum Op {
    Up(usize, InstanceId, u32),
    Down(usize, InstanceId),
}

fn op() -> impl Strategy<Value = Op> {
    // Prefill-heavy: most of the rules are about prefill sets.
    let component =
        prop_oneof![4 => Just(0usize), 1 => Just(1), 2 => Just(2), 1 => Just(3), 1 => Just(4)];
    prop_oneof![
        3 => (component.clone(), 0..4u64, prop_oneof![Just(16u32), Just(32)])
            .prop_map(|(c, id, b)| Op::Up(c, id, b)),
        2 => (component, 0..4u64).prop_map(|(c, id)| Op::Down(c, id)),
    ]
}

fn event(op: &Op) -> NamespaceEvent {
    match *op {
        Op::Up(c, id, block) => NamespaceEvent::Upserted(inst(COMPONENTS[c], id), card(block)),
        Op::Down(c, id) => NamespaceEvent::Removed(ep(COMPONENTS[c]), id),
    }
}

fn run(m: Machine, ops: &[Op]) -> Result<(), String> {
    let mut w = World::new(m);
    for (n, op) in ops.iter().enumerate() {
        w.apply(event(op))
            .map_err(|e| format!("step {n} ({op:?}): {e}"))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_batch_keeps_the_topology_invariants(ops in prop::collection::vec(op(), 0..60)) {
        run(Machine::new(), &ops).map_err(TestCaseError::fail)?;
    }
}

/// The proptest's checks catch the ordering mutant on some sequence of the same strategy.
#[test]
fn the_proptest_catches_shrinks_before_the_target() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: 512,
        failure_persistence: None,
        ..Config::default()
    });
    let result = runner.run(&prop::collection::vec(op(), 0..60), |ops| {
        let m = Machine::new().with_mutant(TopologyMutant::ShrinksBeforeTarget);
        run(m, &ops).map_err(TestCaseError::fail)
    });
    let err = result
        .expect_err("the mutant passed the proptest")
        .to_string();
    assert!(err.contains("admits no instance"), "{err}");
}

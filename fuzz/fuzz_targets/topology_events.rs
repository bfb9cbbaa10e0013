//! A sequence of discovery events through the topology machine, each batch carried out in
//! order and checked as it goes (harness: `prefill_router_testkit::topology_fuzz`).
#![no_main]

use prefill_router_testkit::topology_fuzz::{check_topology_script, TopologyScript};

libfuzzer_sys::fuzz_target!(|script: TopologyScript| check_topology_script(&script));

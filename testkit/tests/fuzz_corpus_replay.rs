//! Replays every checked-in fuzz input, on stable and without a fuzzer, through the very harness
//! functions the cargo-fuzz targets call (`prefill_router_testkit::TARGETS`): the seed corpus in
//! `fuzz/corpus/<target>/` and the crashes kept as regressions in `fuzz/artifacts/<target>/`.
//! A crash artifact that still crashes fails this test.

use std::fs;
use std::panic;
use std::path::{Path, PathBuf};

use prefill_router::control::Control;
use prefill_router_testkit::alloc_probe::{peak_bytes, CountingAllocator};
use prefill_router_testkit::branches::{Branch, BranchSet};
use prefill_router_testkit::card_fuzz::{self, check_cards, check_cards_with, CardStats};
use prefill_router_testkit::control_fuzz::{self, run_control_script, ControlStats};
use prefill_router_testkit::frame_fuzz::{self, check_frame_script_with};
use prefill_router_testkit::machine_fuzz::{self, run_script, Checks};
use prefill_router_testkit::mutants::FRAME_MUTANTS;
use prefill_router_testkit::mutants::RECORD_MUTANTS;
use prefill_router_testkit::mutants::{
    ControlMutant, ControlMutation, Mutant, Mutation, CARD_MUTANTS,
};
use prefill_router_testkit::record_fuzz::{self, check_record_script};
use prefill_router_testkit::{target, TARGETS};

// frame_decode measures the decoder's peak allocation through this allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `dir` (none if it does not exist), sorted for a stable order.
fn inputs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
}

fn corpus(name: &str) -> Vec<(PathBuf, Vec<u8>)> {
    inputs(&fuzz_dir().join("corpus").join(name))
        .into_iter()
        .map(|p| {
            let bytes = fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

#[test]
fn every_corpus_and_artifact_file_passes_its_harness() {
    let mut failures = Vec::new();
    for t in TARGETS {
        for kind in ["corpus", "artifacts"] {
            for path in inputs(&fuzz_dir().join(kind).join(t.name)) {
                let bytes =
                    fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
                if panic::catch_unwind(|| (t.run)(&bytes)).is_err() {
                    failures.push(format!(
                        "{}: reproduce with `cargo fuzz run --sanitizer none {} {}`",
                        path.display(),
                        t.name,
                        path.display()
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "fuzz inputs fail:\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_fuzz_target_has_a_seed_corpus_and_a_binary() {
    let manifest = fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for t in TARGETS {
        let seeds = inputs(&fuzz_dir().join("corpus").join(t.name)).len();
        assert!(seeds >= 5, "{}: only {seeds} seed files", t.name);
        assert!(
            manifest.contains(&format!("name = \"{}\"", t.name)),
            "{} has no binary in fuzz/Cargo.toml",
            t.name
        );
        assert!(
            fuzz_dir()
                .join("fuzz_targets")
                .join(format!("{}.rs", t.name))
                .is_file(),
            "{} has no fuzz_targets file",
            t.name
        );
    }
    assert!(target("no_such_target").is_none());
}

#[test]
fn machine_corpus_hits_every_branch_of_handle() {
    let mut branches = BranchSet::default();
    for (path, bytes) in corpus("machine_inputs") {
        if let Some(script) = machine_fuzz::decode(&bytes) {
            run_script(
                &script,
                prefill_router::lifecycle::Machine::new,
                Checks::ALL,
                &mut branches,
            )
            .unwrap_or_else(|f| panic!("{}: {f}", path.display()));
        }
    }
    let missed = branches.missed();
    assert!(missed.is_empty(), "the seed corpus never takes {missed:?}");
    eprintln!("branch hits over the seed corpus:");
    for b in Branch::ALL {
        eprintln!("  {b:?}: {}", branches.hits(b));
    }
}

/// Each mutant must be rejected on the seed corpus by the reference comparison alone and by the
/// invariant ledger alone: both checks bite, independently.
#[test]
fn machine_checks_reject_every_mutant_on_the_seed_corpus() {
    let scripts: Vec<_> = corpus("machine_inputs")
        .into_iter()
        .filter_map(|(_, bytes)| machine_fuzz::decode(&bytes))
        .collect();
    let only_reference = Checks {
        reference: true,
        invariants: false,
    };
    let only_invariants = Checks {
        reference: false,
        invariants: true,
    };
    for mutation in Mutation::ALL {
        for checks in [only_reference, only_invariants] {
            let caught = scripts.iter().any(|s| {
                run_script(
                    s,
                    |p| Mutant::new(mutation, p),
                    checks,
                    &mut BranchSet::default(),
                )
                .is_err()
            });
            assert!(
                caught,
                "{mutation:?} passes the seed corpus with {checks:?}"
            );
        }
    }
}

#[test]
fn card_corpus_exercises_predicted_cards_respellings_and_identical_lists() {
    let mut stats = CardStats::default();
    for (path, bytes) in corpus("card_json") {
        if let Some(script) = card_fuzz::decode(&bytes) {
            stats.add(check_cards(&script).unwrap_or_else(|e| panic!("{}: {e}", path.display())));
        }
    }
    eprintln!("{stats:?}");
    assert!(stats.predicted_cards > 0, "{stats:?}");
    assert!(stats.predicted_rejections > 0, "{stats:?}");
    assert!(stats.unpredicted > 0, "{stats:?}");
    assert!(stats.respellings > 0, "{stats:?}");
    assert!(stats.identical_lists > 0, "{stats:?}");
    assert!(stats.multi_card_resolutions > 0, "{stats:?}");
    assert!(stats.empty_resolutions > 0, "{stats:?}");
}

#[test]
fn card_checks_reject_every_resolver_mutant_on_the_seed_corpus() {
    let scripts: Vec<_> = corpus("card_json")
        .into_iter()
        .filter_map(|(_, bytes)| card_fuzz::decode(&bytes))
        .collect();
    for (name, mutant) in CARD_MUTANTS {
        let caught = scripts
            .iter()
            .any(|s| check_cards_with(s, *mutant).is_err());
        assert!(caught, "resolver mutant '{name}' passes the seed corpus");
    }
}

#[test]
fn control_corpus_exercises_admission_retired_bindings_and_stale_builds() {
    let mut stats = ControlStats::default();
    for (path, bytes) in corpus("control_ops") {
        if let Some(script) = control_fuzz::decode(&bytes) {
            let run = run_control_script(&script, Control::new);
            stats.add(run.unwrap_or_else(|e| panic!("{}: {e}", path.display())));
        }
    }
    eprintln!("{stats:?}");
    assert!(stats.admitted > 0, "{stats:?}");
    assert!(stats.retired_still_alive > 0, "{stats:?}");
    assert!(stats.discarded > 0, "{stats:?}");
    assert!(stats.epochs > 0, "{stats:?}");
}

#[test]
fn control_checks_reject_every_control_mutant_on_the_seed_corpus() {
    let scripts: Vec<_> = corpus("control_ops")
        .into_iter()
        .filter_map(|(_, bytes)| control_fuzz::decode(&bytes))
        .collect();
    for mutation in ControlMutation::ALL {
        let caught = scripts
            .iter()
            .any(|s| run_control_script(s, |p| ControlMutant::new(mutation, p)).is_err());
        assert!(caught, "{mutation:?} passes the seed corpus");
    }
}

#[test]
fn alloc_probe_sees_the_peak_of_a_known_allocation() {
    let ((), peak) = peak_bytes(|| drop(std::hint::black_box(vec![0u8; 1 << 20])));
    let peak = peak.expect("the counting allocator is installed in this test binary");
    assert!((1 << 20..(1 << 20) + 4096).contains(&peak), "peak {peak}");
}

#[test]
fn frame_checks_reject_every_decoder_mutant_on_the_seed_corpus() {
    let scripts: Vec<_> = corpus("frame_decode")
        .into_iter()
        .filter_map(|(_, bytes)| frame_fuzz::decode(&bytes))
        .collect();
    for (name, mutant) in FRAME_MUTANTS {
        let caught = scripts
            .iter()
            .any(|s| check_frame_script_with(s, *mutant).is_err());
        assert!(caught, "decoder mutant '{name}' passes the seed corpus");
    }
}

/// The decoder's memory stays bounded on the corpus; prints the worst peak for
/// docs/performance.md (the harness itself fails any input above the frame limit).
#[test]
fn frame_decode_peak_allocation_stays_below_the_frame_limit_on_the_corpus() {
    let mut worst = (0usize, 0usize);
    for (path, bytes) in corpus("frame_decode") {
        let (_, raw) =
            frame_fuzz::check_payload(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        worst = worst.max((raw, bytes.len()));
        if let Some(script) = frame_fuzz::decode(&bytes) {
            let peak = frame_fuzz::check_frame_script(&script)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            worst = worst.max((peak, bytes.len()));
        }
    }
    eprintln!(
        "largest decode peak: {} bytes (input of {} bytes)",
        worst.0, worst.1
    );
    assert!(worst.0 > 0, "the probe saw the decoder allocate");
}

#[test]
fn record_checks_reject_every_reader_mutant_on_the_seed_corpus() {
    let scripts: Vec<_> = corpus("discovery_record")
        .into_iter()
        .filter_map(|(_, bytes)| record_fuzz::decode(&bytes))
        .collect();
    for (name, mutant) in RECORD_MUTANTS {
        let caught = scripts
            .iter()
            .any(|s| check_record_script(s, *mutant).is_err());
        assert!(
            caught,
            "record reader mutant '{name}' passes the seed corpus"
        );
    }
}

/// The `kv_events` harness bites: the seed corpus passes the real decoder, and the
/// structure-aware round trip of a batch with a parent catches the decoder mutant that drops
/// Stored parents (its own output re-encodes consistently, so only the round trip sees it).
#[test]
fn kv_events_checks_reject_the_parent_dropping_decoder_on_the_seed_corpus() {
    use prefill_router_testkit::kv_events_fuzz::{
        check_payload_with, decode_events_dropping_parents,
    };
    let seeds = corpus("kv_events");
    assert!(!seeds.is_empty());
    for (path, bytes) in &seeds {
        check_payload_with(bytes, prefill_router::kv_events::decode_events)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    // The mutant's output re-encodes without the parent, which decodes the same: the raw
    // checks pass, so the structure-aware round trip (batch with a parent) must catch it.
    let script = prefill_router_testkit::kv_events_fuzz::EventScript {
        epoch: 1,
        seq: 2,
        events: vec![prefill_router_testkit::kv_events_fuzz::EventSeed::Stored(
            Some(5),
            vec![1, 2],
        )],
        keep: None,
        flip: None,
        append: Vec::new(),
    };
    assert!(
        prefill_router_testkit::kv_events_fuzz::check_event_script_with(
            &script,
            prefill_router::kv_events::decode_events
        )
        .is_ok()
    );
    assert!(
        prefill_router_testkit::kv_events_fuzz::check_event_script_with(
            &script,
            decode_events_dropping_parents
        )
        .is_err()
    );
}

/// The `engine_batch` seeds are the five captured vLLM payloads: each decodes (within the
/// allocation bound) and its events survive both re-encodings.
#[test]
fn engine_batch_seed_corpus_is_real_payloads_that_decode_and_round_trip() {
    use prefill_router_testkit::engine_batch_fuzz::check_payload_with;
    let seeds = corpus("engine_batch");
    assert!(seeds.len() >= 5);
    for (path, bytes) in &seeds {
        let batch = check_payload_with(bytes, prefill_router::kv_events::decode_engine_batch)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let batch = batch.unwrap_or_else(|| panic!("{} does not decode", path.display()));
        assert!(!batch.events.is_empty(), "{}", path.display());
    }
}

#[test]
fn topology_corpus_exercises_every_action_and_the_shrinks_first_driver_fails_it() {
    use prefill_router::topology::{Action, Machine};
    use prefill_router_testkit::topology_fuzz::{
        self, event_of, run_topology_script, run_topology_script_with, ShrinksFirst,
    };
    let scripts: Vec<_> = corpus("topology_events")
        .into_iter()
        .filter_map(|(_, bytes)| topology_fuzz::decode(&bytes))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    for script in &scripts {
        run_topology_script(script).unwrap();
        let mut m = Machine::new();
        for step in &script.steps {
            for action in m.handle(event_of(*step)) {
                seen.insert(match action {
                    Action::Admission { grows: true, .. } => "grow",
                    Action::Admission { grows: false, .. } => "shrink",
                    Action::SetTarget(Some(_)) => "target",
                    Action::SetTarget(None) => "no target",
                    Action::Retire(_) => "retire",
                    Action::Forget(_) => "forget",
                });
            }
        }
    }
    assert_eq!(seen.len(), 6, "the seed corpus takes only {seen:?}");
    let caught = scripts
        .iter()
        .any(|s| run_topology_script_with(s, ShrinksFirst::default()).is_err());
    assert!(caught, "the shrinks-first driver passes the seed corpus");
}

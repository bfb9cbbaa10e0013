//! Picks a small seed corpus out of a large one a fuzzing run left behind.
//!
//! ```sh
//! cargo fuzz cmin --sanitizer none machine_inputs /tmp/big      # optional: drop redundant files
//! cargo run --release -p prefill-router-testkit --example fuzz_seed_select -- machine_inputs /tmp/big fuzz/corpus/machine_inputs 30
//! ```
//!
//! Files are first chosen greedily until every feature the big corpus reaches is covered (for
//! `machine_inputs`: every branch of `Machine::handle` and every mutant caught by each check
//! alone; for `card_json`: every kind of document and resolution, every resolver mutant caught;
//! for `control_ops`: admissions, retired bindings kept alive, stale builds, every mutant caught;
//! for `frame_decode` and `discovery_record`: every decoder or reader mutant caught),
//! which is what `tests/fuzz_corpus_replay.rs` demands of the seeds; the rest of the budget goes
//! to the largest inputs. Files are copied under a hash of their content.

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeSet;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::{env, fs, process};

use prefill_router::control::Control;
use prefill_router::lifecycle::Machine;
use prefill_router_testkit::alloc_probe::CountingAllocator;
use prefill_router_testkit::branches::{Branch, BranchSet};
use prefill_router_testkit::card_fuzz;
use prefill_router_testkit::control_fuzz;
use prefill_router_testkit::frame_fuzz;
use prefill_router_testkit::machine_fuzz::{self, run_script, Checks};
use prefill_router_testkit::mutants::{
    ControlMutant, ControlMutation, Mutant, Mutation, CARD_MUTANTS, FRAME_MUTANTS, RECORD_MUTANTS,
};
use prefill_router_testkit::record_fuzz;

// The frame_decode harness measures peak allocation through this allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn usage() -> ! {
    eprintln!("usage: fuzz_seed_select <target> <from-dir> <to-dir> <count>");
    process::exit(2)
}

/// The features a seed corpus must cover, as names: for `machine_inputs` the branches of
/// `Machine::handle` and the mutants (with each check alone) that an input catches; for
/// `card_json` the kinds of documents and resolutions exercised and the resolver mutants caught.
fn features(target: &str, bytes: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    match target {
        "machine_inputs" => {
            let Some(script) = machine_fuzz::decode(bytes) else {
                return out;
            };
            let mut set = BranchSet::default();
            // A failing script is for the fuzzer to report, not a seed.
            if run_script(&script, Machine::new, Checks::ALL, &mut set).is_err() {
                return out;
            }
            out.extend(
                Branch::ALL
                    .into_iter()
                    .filter(|b| set.hits(*b) > 0)
                    .map(|b| format!("{b:?}")),
            );
            for mutation in Mutation::ALL {
                for (reference, invariants) in [(true, false), (false, true)] {
                    let checks = Checks {
                        reference,
                        invariants,
                    };
                    let mutant = |p| Mutant::new(mutation, p);
                    if run_script(&script, mutant, checks, &mut BranchSet::default()).is_err() {
                        out.push(format!("{mutation:?} caught by {checks:?}"));
                    }
                }
            }
        }
        "card_json" => {
            let Some(script) = card_fuzz::decode(bytes) else {
                return out;
            };
            let Ok(s) = card_fuzz::check_cards(&script) else {
                return out;
            };
            let kinds = [
                ("predicted cards", s.predicted_cards),
                ("predicted rejections", s.predicted_rejections),
                ("unpredicted", s.unpredicted),
                ("respellings", s.respellings),
                ("identical lists", s.identical_lists),
                ("multi-card", s.multi_card_resolutions),
                ("empty", s.empty_resolutions),
            ];
            out.extend(
                kinds
                    .iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(k, _)| k.to_string()),
            );
            for (name, mutant) in CARD_MUTANTS {
                if card_fuzz::check_cards_with(&script, *mutant).is_err() {
                    out.push(format!("mutant {name} caught"));
                }
            }
        }
        "control_ops" => {
            let Some(script) = control_fuzz::decode(bytes) else {
                return out;
            };
            let Ok(s) = control_fuzz::run_control_script(&script, Control::new) else {
                return out;
            };
            let kinds = [
                ("admitted", s.admitted),
                ("retired still alive", s.retired_still_alive),
                ("discarded", s.discarded as usize),
                ("epochs", s.epochs as usize),
            ];
            out.extend(
                kinds
                    .iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(k, _)| k.to_string()),
            );
            for mutation in ControlMutation::ALL {
                let mutant = |p| ControlMutant::new(mutation, p);
                if control_fuzz::run_control_script(&script, mutant).is_err() {
                    out.push(format!("{mutation:?} caught"));
                }
            }
        }
        "frame_decode" => {
            if let Some(script) = frame_fuzz::decode(bytes) {
                for (name, mutant) in FRAME_MUTANTS {
                    if frame_fuzz::check_frame_script_with(&script, *mutant).is_err() {
                        out.push(format!("mutant {name} caught"));
                    }
                }
            }
        }
        "discovery_record" => {
            if let Some(script) = record_fuzz::decode(bytes) {
                for (name, mutant) in RECORD_MUTANTS {
                    if record_fuzz::check_record_script(&script, *mutant).is_err() {
                        out.push(format!("mutant {name} caught"));
                    }
                }
            }
        }
        _ => {}
    }
    out
}

/// Greedy cover of every feature the big corpus reaches, then the largest files.
fn pick(target: &str, files: &[(PathBuf, Vec<u8>)], count: usize) -> Vec<usize> {
    let sets: Vec<BTreeSet<String>> = files
        .iter()
        .map(|(_, b)| features(target, b).into_iter().collect())
        .collect();
    let reachable: BTreeSet<&String> = sets.iter().flatten().collect();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    let mut picked = Vec::new();
    while picked.len() < count {
        let gain = |i: usize| sets[i].difference(&covered).count();
        let best = (0..files.len())
            .filter(|i| !picked.contains(i))
            .max_by_key(|i| (gain(*i), std::cmp::Reverse(files[*i].1.len())));
        match best {
            Some(i) if gain(i) > 0 => {
                covered.extend(sets[i].iter().cloned());
                picked.push(i);
            }
            _ => break,
        }
    }
    eprintln!(
        "{} features covered by {} files: {:?}",
        reachable.len(),
        picked.len(),
        covered
    );
    let mut by_size: Vec<usize> = (0..files.len()).filter(|i| !picked.contains(i)).collect();
    by_size.sort_by_key(|i| std::cmp::Reverse(files[*i].1.len()));
    picked.extend(by_size.into_iter().take(count.saturating_sub(picked.len())));
    picked
}

fn main() {
    let args: Vec<String> = env::args().skip(1).collect();
    let [target, from, to, count] = args.as_slice() else {
        usage()
    };
    let count: usize = count.parse().unwrap_or_else(|_| usage());
    let mut files: Vec<(PathBuf, Vec<u8>)> = fs::read_dir(from)
        .unwrap_or_else(|e| panic!("read {from}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter_map(|p| fs::read(&p).ok().map(|b| (p, b)))
        .collect();
    files.sort();
    let picked = pick(target, &files, count);
    fs::create_dir_all(to).unwrap_or_else(|e| panic!("create {to}: {e}"));
    for i in &picked {
        let bytes = &files[*i].1;
        let mut h = DefaultHasher::new();
        bytes.hash(&mut h);
        let dest = Path::new(to).join(format!("seed-{:016x}", h.finish()));
        fs::write(&dest, bytes).unwrap_or_else(|e| panic!("write {}: {e}", dest.display()));
    }
    println!("{} of {} files copied to {to}", picked.len(), files.len());
}

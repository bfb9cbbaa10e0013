//! The `prefill-router-model` binary itself: help answers on stdout with exit 0, and an
//! Explorer address already in use is refused with one line instead of a panic.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs the binary with `args`, killing it if it has not exited within 30 s (a refusal that
/// regressed into serving must fail the test, not hang it).
fn run(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_prefill-router-model"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    // Drain both pipes on threads so a full pipe cannot stall the child.
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("stdout piped")));
    let stderr = drain(Box::new(child.stderr.take().expect("stderr piped")));
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("prefill-router-model {args:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_subcommand_answers_help_on_stdout_with_exit_zero() {
    for (args, usage) in [
        (
            &["explore", "--help"][..],
            "usage: prefill-router-model explore",
        ),
        (
            &["explore", "-h"][..],
            "usage: prefill-router-model explore",
        ),
        (
            &["check", "--help"][..],
            "usage: prefill-router-model check",
        ),
        (&["check", "-h"][..], "usage: prefill-router-model check"),
        (&["--help"][..], "prefill-router-model explore"),
        (&["help"][..], "prefill-router-model explore"),
    ] {
        let out = run(args);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(stdout.contains(usage), "{args:?}: {stdout}");
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
    }
}

#[test]
fn explore_on_a_port_in_use_says_so_in_one_line_without_panicking() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let addr = taken.local_addr().expect("its address").to_string();
    let out = run(&["explore", "--addr", &addr]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {addr}")),
        "{stderr}"
    );
    // Nothing claims to serve when nothing does.
    assert!(!stdout.contains("serving"), "{stdout}");
    drop(taken);
}

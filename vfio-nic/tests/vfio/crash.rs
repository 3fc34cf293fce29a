//! Crash recovery: a driver process killed with SIGKILL in the middle of a
//! TX run leaves the device to VFIO's release path; the next start resets
//! the NIC, programs fresh rings and sends. The host checks every frame of
//! the new run, and that no frame of the dead run follows the new run's
//! first frame in the capture (`pcap-crash-flows: KILLED FRESH`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};

use super::*;

const KILLED_FLOW: usize = 70;
const FRESH_FLOW: usize = 71;

/// The sender program: `PFRAG_SEND_BIN`, or cargo's build of the
/// `vfio_send` example next to this test binary.
pub(super) fn sender() -> PathBuf {
    if let Some(p) = std::env::var_os("PFRAG_SEND_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().join("../examples/vfio_send");
    assert!(
        p.exists(),
        "no sender: build it with `cargo build -p vfio-nic --example vfio_send` or set PFRAG_SEND_BIN"
    );
    p
}

/// Starts the sender with `args` (the NIC and device) on flow `flow`,
/// sending 64 KB packets until killed; once it runs, and 200 ms later
/// (descriptors posted, the device reading them), kills it with SIGKILL.
pub(super) fn kill_sender_mid_run(args: &[&str], flow: usize) -> ExitStatus {
    let mut child = Command::new(sender())
        .args(args)
        .args([
            "--flow",
            &flow.to_string(),
            "--len",
            "65160",
            "--packets",
            "0",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the sender");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(
        line.trim(),
        "vfio_send: running",
        "the sender did not start"
    );
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    let st = child.wait().unwrap();
    assert!(!st.success(), "the sender was killed: {st}");
    st
}

#[test]
#[ignore = "needs an 82576 bound to vfio-pci: vm/run.sh test"]
fn driver_killed_mid_tx_then_a_fresh_start_sends_clean() {
    let st = kill_sender_mid_run(&["--device", &bdf()], KILLED_FLOW);
    println!("crash: sender killed ({st})");
    println!("pcap-crash-flows: {KILLED_FLOW} {FRESH_FLOW}");

    // A fresh start: `open` resets the NIC, the queue programs new rings.
    let (domain, nic) = open();
    let mut q = persistent_queue(&domain, nic, 4);
    let mut g = traffic(FRESH_FLOW + 1);
    let sizes = [65_160usize, 300, 9_000, 60];
    let n = 16;
    for &len in sizes.iter().cycle().take(n) {
        send(&mut q, &mut g, FRESH_FLOW, len).unwrap();
    }
    q.kick().unwrap();
    q.wait(WAIT).unwrap();
    assert_eq!(q.stats().completed, n as u64);
    let frames: u64 = sizes.iter().cycle().take(n).map(|&l| segments(l)).sum();
    println!("crash: the fresh start sent {n} packets ({frames} frames)");
    expect_on_wire(frames);
}

//! Sends generated TCP traffic from a NIC bound to vfio-pci (an Intel
//! 82576, or with `--nic virtio` a virtio-net device): one flow, TSO for
//! payloads longer than the MSS, from a persistent pool.
//! With `--packets 0` it sends until it is killed, which is what the
//! crash-recovery test does to it mid-run.
//!
//! ```text
//! vfio_send --device 0000:00:02.0 --flow 3 --len 65160 --packets 1000
//! vfio_send --nic virtio --device 0000:00:03.0 --flow 3 --packets 1000
//! vfio_send --backend iommufd --device 0000:00:02.0 --flow 3 --packets 1000
//! ```
//!
//! It prints `vfio_send: running` once the first packets have completed,
//! and at the end (when `--packets` is not 0) how many it sent.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use pfrag::bounce::SlotSize;
use pfrag::dma::{DmaMapper, Domain};
use pfrag::pool::{self, Policy, Pool};
use pfrag::Order;
use vfio_nic::device::TxDevice;
use vfio_nic::gen::Traffic;
use vfio_nic::hw::igb::{Igb, IgbConfig};
use vfio_nic::hw::iommufd::IommufdMapper;
use vfio_nic::hw::vfio::{VfioMapper, VfioPci};
use vfio_nic::hw::virtio::{VirtioConfig, VirtioNetPci};
use vfio_nic::tx::{self, HeaderMode};

/// Completions the sender waits for before it reports that it runs.
const RUNNING_AFTER: u64 = 16;

/// The device behind the PCI address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Nic {
    /// An Intel 82576.
    Igb,
    /// A virtio-net device (modern PCI, `ACCESS_PLATFORM`).
    Virtio,
}

/// How the device is opened and its memory mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// A type1 container (`VFIO_IOMMU_MAP_DMA`).
    Type1,
    /// The device's VFIO cdev and an iommufd IOAS (`IOMMU_IOAS_MAP`).
    Iommufd,
}

#[derive(Parser, Debug)]
#[command(about = "Send one generated TCP flow from a NIC bound to vfio-pci")]
struct Args {
    /// PCI address of the NIC.
    #[arg(long, default_value = "0000:00:02.0")]
    device: String,
    /// The NIC.
    #[arg(long, value_enum, default_value = "igb")]
    nic: Nic,
    /// How its memory is mapped.
    #[arg(long, value_enum, default_value = "type1")]
    backend: Backend,
    /// Flow number (0..1024): its ports and payload pattern.
    #[arg(long, default_value_t = 0)]
    flow: usize,
    /// Payload bytes per packet (1..=65160).
    #[arg(long, default_value_t = 65_160, value_parser = clap::value_parser!(u32).range(1..=65_160))]
    len: u32,
    /// Packets to send; 0 sends until killed.
    #[arg(long, default_value_t = 0)]
    packets: u64,
    /// TCP maximum segment size.
    #[arg(long, default_value_t = 1448)]
    mss: u16,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vfio_send: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(a: &Args) -> Result<(), vfio_nic::Error> {
    match a.backend {
        Backend::Type1 => {
            let pci = VfioPci::open(&a.device)?;
            let mapper = VfioMapper::new(&pci)?;
            open_nic(a, pci, mapper)
        }
        Backend::Iommufd => {
            let pci = VfioPci::open_iommufd(&a.device)?;
            let mapper = IommufdMapper::new(&pci)?;
            open_nic(a, pci, mapper)
        }
    }
}

fn open_nic<M: DmaMapper>(a: &Args, pci: VfioPci, mapper: M) -> Result<(), vfio_nic::Error> {
    let domain = Arc::new(Domain::new(mapper));
    match a.nic {
        Nic::Igb => send_on(a, domain, Igb::new(pci, IgbConfig::default())?),
        Nic::Virtio => send_on(a, domain, VirtioNetPci::new(pci, VirtioConfig::default())?),
    }
}

fn send_on<M: DmaMapper, D: TxDevice>(
    a: &Args,
    domain: Arc<Domain<M>>,
    nic: D,
) -> Result<(), vfio_nic::Error> {
    let pool = Pool::new(
        domain.clone(),
        pool::Config::new(Order::new(4)?, Policy::Persistent),
    )?;
    let cfg = tx::Config {
        header: HeaderMode::Bounce(SlotSize::B128),
        // The emulated 82576 drops buffers that cross an IOMMU page.
        boundary: Some(4096),
        ..tx::Config::default()
    };
    // SAFETY: the NIC is the VFIO device in the container (or attached to
    // the IOAS) that `domain` maps into.
    let mut q = unsafe { tx::Queue::new(domain, pool, nic, cfg) }?;
    let mut g: Traffic<M> = Traffic::new(a.flow + 1, a.mss)?;
    let wait = Duration::from_secs(10);
    let mut sent = 0u64;
    let mut told = false;
    // Tokens of completed packets: this sender only needs their number.
    let mut done = Vec::new();
    while a.packets == 0 || sent < a.packets {
        g.send_waiting(&mut q, a.flow, a.len as usize, wait, &mut done)?;
        done.clear();
        sent += 1;
        if !told && q.stats().completed >= RUNNING_AFTER {
            println!("vfio_send: running");
            let _ = std::io::stdout().flush();
            told = true;
        }
    }
    q.kick()?;
    q.wait(wait)?;
    println!("vfio_send: {sent} packets sent on flow {}", a.flow);
    Ok(())
}

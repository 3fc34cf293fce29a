//! The crate's one error type.

/// Everything the NIC side can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pool, mapper or bounce ring said no.
    #[error(transparent)]
    Pool(#[from] pfrag::Error),
    /// Not enough free descriptors for the packet now: back off, reap
    /// completions and retry. (A packet the empty ring could not hold is
    /// [`Error::PacketTooLarge`] instead.)
    #[error("TX ring full: packet needs up to {needed} descriptors, {free} free")]
    RingFull {
        /// Descriptors the packet may need.
        needed: usize,
        /// Descriptors free now.
        free: usize,
    },
    /// A packet that needs more descriptors than the whole ring holds: it
    /// can never be posted on this queue, so unlike [`Error::RingFull`] a
    /// retry never succeeds. Send it in smaller packets, or use a larger
    /// ring or larger chunks (fewer buffers per packet).
    #[error("packet needs {needed} descriptors, the ring holds at most {capacity}")]
    PacketTooLarge {
        /// Descriptors the packet needs (at least, when counted before its
        /// frags exist: no data descriptor is assumed to carry more than a
        /// chunk, the format's largest buffer or the boundary, as
        /// [`Config::descs_at_least`](crate::tx::Config::descs_at_least)
        /// counts).
        needed: usize,
        /// Descriptors the ring holds when empty (one fewer than its size).
        capacity: usize,
    },
    /// A flow index past the configured flows.
    #[error("flow {flow} does not exist ({flows} flows)")]
    BadFlow {
        /// The flow asked for.
        flow: usize,
        /// Flows configured.
        flows: usize,
    },
    /// More buffers for one packet than the device takes.
    #[error("packet needs {needed} buffers, the device takes at most {max}")]
    TooManyBuffers {
        /// Buffers needed (at most, when counted before the packet's frags
        /// exist, as
        /// [`Config::bufs_at_most`](crate::tx::Config::bufs_at_most)
        /// counts).
        needed: usize,
        /// The device limit.
        max: usize,
    },
    /// A payload larger than one packet can carry: the 82576's PAYLEN field
    /// is 18 bits, a virtio-net packet at most 64 KiB, and the pool caps
    /// payloads too ([`tx::max_payload`](crate::tx::max_payload)).
    #[error("payload of {len} bytes exceeds the {max} bytes one packet can carry")]
    PayloadTooLarge {
        /// Bytes asked for.
        len: usize,
        /// The most this queue can carry in one packet.
        max: usize,
    },
    /// Headers the requested offload cannot use; nothing was posted.
    #[error("headers cannot carry {offload}: {why}")]
    BadHeaders {
        /// The offload asked for.
        offload: &'static str,
        /// What is wrong with the headers.
        why: HeaderFault,
    },
    /// A frame longer than the queue's MTU allows (without TSO, the whole
    /// frame; with it, each segment: headers + MSS); nothing was posted.
    #[error("a frame of {len} bytes is longer than the MTU allows ({max} bytes with the Ethernet header)")]
    FrameTooLong {
        /// Bytes of the frame (or of one TSO segment).
        len: usize,
        /// The most the MTU allows: MTU + 14.
        max: usize,
    },
    /// Memory mapped in another DMA domain than the queue's ring: its IOVAs
    /// would name other memory on the queue's device. Nothing was posted.
    #[error("{what} is mapped in another DMA domain than the queue's")]
    WrongDomain {
        /// What: the pool, or a frag.
        what: &'static str,
    },
    /// Memory the device may not read: mapped without
    /// [`Dir::TO_DEVICE`](pfrag::dma::Dir::TO_DEVICE) (device-write-only,
    /// as RX buffers are), so each read of it would fault at the device
    /// and its packet be lost. Nothing was posted.
    #[error("{what} is mapped with direction bits {dir:#x}, without TO_DEVICE: the device cannot read it")]
    Unreadable {
        /// What: the pool, the queue's frag cache, or a frag.
        what: &'static str,
        /// The bits of its mapping's direction ([`pfrag::dma::Dir`]).
        dir: u8,
    },
    /// The device's descriptor format cannot carry this offload; nothing
    /// was posted.
    #[error("the {format} descriptor format cannot carry {offload}")]
    UnsupportedOffload {
        /// The offload asked for.
        offload: &'static str,
        /// The format's name ([`Format::NAME`](crate::format::Format::NAME)).
        format: &'static str,
    },
    /// The PHY reported an error for an MDIC access (MDIC.E set).
    #[error("PHY access failed: MDIC = {mdic:#010x} has its error bit set")]
    Mdic {
        /// The MDIC register as read back.
        mdic: u32,
    },
    /// A setting outside the range the device or driver accepts.
    #[error("{what} = {value} is out of range ({min}..={max})")]
    OutOfRange {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The smallest value accepted.
        min: u64,
        /// The largest value accepted.
        max: u64,
    },
    /// An invalid setting.
    #[error("invalid configuration: {what} = {value}")]
    BadConfig {
        /// Which setting.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// A line rate that is not a finite number of Gbit/s above 0.
    #[error("line rate {gbit} Gbit/s is not a finite number above 0")]
    BadLineRate {
        /// The rate given.
        gbit: f64,
    },
    /// The device model's thread could not be started.
    #[error("starting the device thread: {0}")]
    DeviceThread(#[source] std::io::Error),
    /// The device was kicked before a ring was attached.
    #[error("no TX ring attached to the device")]
    NotAttached,
    /// Packets still in flight after waiting for their write-back.
    #[error("TX timeout: {pending} packets not completed after {waited_ms} ms (device head {head:?}, tail {tail})")]
    Timeout {
        /// Packets posted and not completed.
        pending: usize,
        /// How long the queue waited without progress.
        waited_ms: u64,
        /// The device's head pointer, if it reports one.
        head: Option<u16>,
        /// The queue's tail.
        tail: u16,
    },
    /// Packets still in flight when the queue was asked to give up its
    /// device ([`Queue::into_device`](crate::tx::Queue::into_device)): the
    /// queue is handed back with its device attached; wait for the packets
    /// ([`Queue::wait_tokens`](crate::tx::Queue::wait_tokens)) and try
    /// again.
    #[error("{in_flight} packets still in flight: wait for them before detaching the device")]
    Busy {
        /// Packets posted and not yet reaped.
        in_flight: usize,
    },
    /// A device address that is not a PCI address as sysfs names it:
    /// `DDDD:BB:DD.F` in lower-case hex (a domain of 4 to 8 digits, bus,
    /// device up to `1f`, function up to 7), as `lspci -D` prints it.
    #[error("{bdf:?} is not a PCI address such as 0000:00:02.0 (domain:bus:device.function in lower-case hex, as lspci -D prints it)")]
    BadBdf {
        /// The string given.
        bdf: String,
    },
    /// No PCI device at that address.
    #[error("no PCI device {bdf} (see lspci, or /sys/bus/pci/devices)")]
    DeviceMissing {
        /// The address asked for.
        bdf: String,
    },
    /// The device has no IOMMU group: the IOMMU is off.
    #[error("{bdf} has no IOMMU group: boot with intel_iommu=on (or amd_iommu=on)")]
    NoIommuGroup {
        /// The device.
        bdf: String,
    },
    /// A mapper asked for a device opened with another DMA backend (a type1
    /// mapper for a device opened through iommufd, or the other way).
    #[error(
        "a {want} mapper needs a device opened through {want}; this one was opened through {have}"
    )]
    WrongBackend {
        /// The backend the mapper needs.
        want: &'static str,
        /// The backend the device was opened with.
        have: &'static str,
    },
    /// The group's VFIO node does not exist: the device is not bound to vfio-pci.
    #[error("/dev/vfio/{group} is missing: {bdf} is bound to driver '{driver}', bind it to vfio-pci (echo <vendor> <device> > /sys/bus/pci/drivers/vfio-pci/new_id)")]
    GroupMissing {
        /// The device.
        bdf: String,
        /// Its IOMMU group.
        group: u32,
        /// The driver it is bound to now.
        driver: String,
    },
    /// Some device of the group is bound to a host driver.
    #[error("IOMMU group {group} is not viable: bind every device of /sys/kernel/iommu_groups/{group}/devices to vfio-pci or unbind it")]
    GroupNotViable {
        /// The group.
        group: u32,
    },
    /// Opening the VFIO container, group or device failed.
    #[error("VFIO open of {what} failed (errno {errno:?}): {detail}")]
    VfioOpen {
        /// What was being opened.
        what: String,
        /// The errno, when the OS gave one.
        errno: Option<i32>,
        /// The VFIO layer's message.
        detail: String,
    },
    /// `VFIO_IOMMU_GET_INFO` failed.
    #[error("VFIO_IOMMU_GET_INFO failed (errno {errno:?})")]
    IommuInfo {
        /// The errno.
        errno: Option<i32>,
    },
    /// `VFIO_IOMMU_GET_INFO` asked for a buffer larger than the driver
    /// gives it, or kept asking for a larger one.
    #[error("VFIO_IOMMU_GET_INFO asked for {need} bytes (at most {max} are given, in at most {tries} calls)")]
    IommuInfoSize {
        /// Bytes the kernel last asked for.
        need: usize,
        /// The most the driver gives.
        max: usize,
        /// Calls made.
        tries: u32,
    },
    /// The kernel reported usable IOVA ranges that are not non-empty,
    /// ascending and disjoint: range `index` (end exclusive) ends at or
    /// before its start, or starts before the range ahead of it ends.
    #[error("the kernel's usable IOVA range {index}, {start:#x}..{end:#x}, is empty, reversed, or not after the range before it (ending at {prev_end:#x})")]
    OddIovaRanges {
        /// Which range, counted from 0 in the kernel's order.
        index: usize,
        /// Its start.
        start: u64,
        /// Its end, exclusive.
        end: u64,
        /// The end of the range before it (0 for the first).
        prev_end: u64,
    },
    /// A read or write of PCI configuration space through VFIO failed.
    #[error("PCI config space {op} of {len} bytes at {offset:#x} failed (errno {errno:?}): {source}", errno = .source.raw_os_error())]
    ConfigSpace {
        /// `"read"` or `"write"`.
        op: &'static str,
        /// Offset in config space.
        offset: u64,
        /// Bytes.
        len: usize,
        /// The OS error (`UnexpectedEof` for a short read).
        #[source]
        source: std::io::Error,
    },
    /// A BAR that VFIO does not allow to mmap.
    #[error("BAR region {index} cannot be mmapped (region flags {flags:#x})")]
    BarNotMappable {
        /// Region index.
        index: u32,
        /// Its VFIO region flags.
        flags: u32,
    },
    /// mmap of a BAR failed.
    #[error("mmap of BAR ({len:#x} bytes at offset {offset:#x}) failed (errno {errno:?})", errno = .source.raw_os_error())]
    BarMap {
        /// Region offset in the device file.
        offset: u64,
        /// Length.
        len: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A register access outside the BAR or not 4-byte aligned.
    #[error("register offset {offset:#x} is outside the {bar_len:#x}-byte BAR or unaligned")]
    BadRegister {
        /// The offset.
        offset: u32,
        /// BAR length.
        bar_len: usize,
    },
    /// The virtqueue refused a setting or an access (the virtio-net
    /// model's `virtio-queue`).
    #[error("virtqueue: {0}")]
    Virtqueue(#[source] virtio_queue::Error),
    /// The virtio-net model found entries in the available ring that it
    /// could not read.
    #[error("virtqueue: the available ring cannot be read at entry {next_avail}")]
    AvailUnreadable {
        /// The device's next available entry.
        next_avail: u16,
    },
    /// A part of the virtqueue the device cannot reach as it must, through
    /// its IOMMU: the available ring not readable, or the used ring not
    /// writable. Checked before a doorbell takes any chain: it took none.
    #[error("virtqueue: the {part} ({len} bytes at IOVA {iova:#x}) is not {access} by the device")]
    RingUnreachable {
        /// The part (`"available ring"`, `"used ring"`).
        part: &'static str,
        /// The access it lacks (`"readable"`, `"writable"`).
        access: &'static str,
        /// Where the part starts.
        iova: u64,
        /// Its bytes.
        len: u64,
    },
    /// An available index further ahead of the device than the ring has
    /// entries: a driver never offers an entry twice. Checked before a
    /// doorbell takes any chain: it took none.
    #[error("virtqueue: the available index {avail} is more than {size} entries past the device's next entry {next_avail}")]
    AvailIndex {
        /// The available ring's index.
        avail: u16,
        /// The device's next available entry.
        next_avail: u16,
        /// Entries in the ring.
        size: u16,
    },
    /// A used index further ahead of the driver than the packets the
    /// device holds (made available, not yet used): the entries past them
    /// would be stale ones. Nothing is taken from the used ring; every
    /// reap says so until the device is reset.
    #[error("virtqueue: the used index {idx} is more than {in_flight} entries (the packets the device holds) past the driver's {used}")]
    UsedIndex {
        /// The used ring's index.
        idx: u16,
        /// The driver's next used entry.
        used: u16,
        /// Packets made available and not yet used.
        in_flight: u16,
    },
    /// A used entry whose id is not the head of a packet the device
    /// holds: out of the ring, never made available, or used already.
    /// Nothing is freed for it, nor taken from it on: every reap that
    /// reads it says so until the device is reset.
    #[error("virtqueue: used entry {entry} names descriptor {id}, not the head of a packet the device holds (ring of {size})")]
    UsedId {
        /// The used ring's entry (a free-running index).
        entry: u16,
        /// The id it holds.
        id: u32,
        /// Entries in the ring.
        size: u16,
    },
    /// The virtio device stopped and needs a reset (virtio 1.x, 2.1.2: it
    /// set `NEEDS_RESET` in `device_status`; a driver sets `FAILED`). It
    /// takes no doorbell, and returns no more used entries, until it is
    /// reset ([`TxDevice::detach`](crate::device::TxDevice::detach), which a
    /// [`tx::Queue`](crate::tx::Queue) calls when it is dropped): packets in
    /// flight stay so, since the device may have read them.
    #[error("the device stopped and needs a reset (device status {status:#04x}){}", stop_cause(.cause))]
    DeviceStopped {
        /// Its `device_status` (`NEEDS_RESET` 0x40, `FAILED` 0x80).
        status: u8,
        /// What stopped it, where the stop is seen (a device model's
        /// doorbell); `None` for a stop reported later, or read from the
        /// device.
        #[source]
        cause: Option<Box<Error>>,
    },
    /// A line rate for a model that serves a doorbell in one go.
    #[error("this device model serves whole doorbells (a virtio-net available ring) and cannot be paced to a line rate")]
    Unpaceable,
    /// A device lacks a feature the driver cannot do without.
    #[error("the device does not offer {feature} ({features:#x} offered): {why}")]
    MissingFeature {
        /// The feature.
        feature: &'static str,
        /// The feature bits the device offered.
        features: u64,
        /// Why it is needed.
        why: &'static str,
    },
    /// A virtio PCI device lacks a structure the driver needs, or names
    /// one that lies outside its BAR.
    #[error("virtio device: no usable {what}")]
    VirtioCap {
        /// What is missing.
        what: &'static str,
    },
    /// A virtqueue size the device cannot take: not a power of two, or
    /// above the device's `queue_size` (0: the device has no such queue).
    #[error("virtqueue of {len} entries: the device takes a power of two up to {max}")]
    VirtqueueSize {
        /// Entries asked for.
        len: u16,
        /// The device's maximum.
        max: u16,
    },
    /// A virtio device refused a step of its bring-up (one that stops
    /// later is [`Error::DeviceStopped`]).
    #[error("virtio device refused {what}: device status {status:#04x}")]
    DeviceRefused {
        /// The step.
        what: &'static str,
        /// Its `device_status` as read back (`FAILED` 0x80, `NEEDS_RESET`
        /// 0x40).
        status: u8,
    },
    /// A device register did not take the value written: it reads back
    /// another.
    #[error("device register {what}: wrote {wrote:#x}, read back {read:#x}")]
    NotTaken {
        /// The register.
        what: &'static str,
        /// The value written.
        wrote: u32,
        /// The value read back.
        read: u32,
    },
    /// The 82576 still had bus-master (DMA) requests pending when it was
    /// to be reset: STATUS.GIO_MASTER_ENABLE did not clear after
    /// CTRL.GIO_MASTER_DISABLE was set. The device was not reset and is
    /// left as it was (mastering enabled again, its queues running).
    #[error("device still has bus-master requests pending after {waited_ms} ms of master disable (STATUS = {status:#010x}): not reset")]
    MasterRequestsPending {
        /// The STATUS register as last read.
        status: u32,
        /// How long it was waited for.
        waited_ms: u64,
    },
    /// The device did not finish a step in time.
    #[error("device {what} did not complete in {waited_ms} ms")]
    DeviceTimeout {
        /// The step (reset, link up, queue enable).
        what: &'static str,
        /// How long it was waited for.
        waited_ms: u64,
    },
    /// A step failed, and stopping the device after it failed too: the
    /// device may still hold what the step handed it.
    #[error("{error}; then stopping the device failed too: {stop}")]
    StopFailed {
        /// The step's failure.
        #[source]
        error: Box<Error>,
        /// The stop's.
        stop: Box<Error>,
    },
    /// A step failed, and putting back the registers it had changed
    /// failed too: the device is not as it was (an 82576 whose reset
    /// failed before CTRL.RST may be left with bus mastering disabled,
    /// its interrupts masked, its receiver or transmitter off).
    #[error("{error}; then putting the device back failed too: {undo}")]
    UndoFailed {
        /// The step's failure.
        #[source]
        error: Box<Error>,
        /// The first write putting the device back that failed.
        undo: Box<Error>,
    },
}

impl Error {
    /// Whether the failure is transient backpressure (ring full, memory
    /// limit): reap completions and retry.
    pub fn is_backoff(&self) -> bool {
        matches!(
            self,
            Error::RingFull { .. }
                | Error::Pool(pfrag::Error::MemoryLimit { .. })
                | Error::Pool(pfrag::Error::LimitReached { .. })
        )
    }

    /// The errno behind the failure, where the OS gave one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Pool(e) => e.errno(),
            Error::VfioOpen { errno, .. } | Error::IommuInfo { errno } => *errno,
            Error::BarMap { source, .. } | Error::ConfigSpace { source, .. } => {
                source.raw_os_error()
            }
            Error::StopFailed { error, stop } => error.errno().or_else(|| stop.errno()),
            Error::UndoFailed { error, undo } => error.errno().or_else(|| undo.errno()),
            _ => None,
        }
    }
}

/// [`Error::DeviceStopped`]'s cause, as its message ends.
fn stop_cause(cause: &Option<Box<Error>>) -> String {
    cause.as_ref().map(|c| format!(": {c}")).unwrap_or_default()
}

/// Shorthand for this crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a packet's headers cannot carry the offload asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderFault {
    /// The headers do not parse (what etherparse said).
    Parse(String),
    /// Neither IPv4 nor IPv6 (the ether type found).
    NotIp(u16),
    /// Not TCP or UDP (the IP protocol number found).
    NotTcpOrUdp(u8),
    /// TSO of something other than TCP.
    TsoNeedsTcp,
    /// The headers are longer or shorter than the layers they hold.
    Length {
        /// Bytes given.
        given: usize,
        /// Bytes the parsed headers take.
        parsed: usize,
    },
    /// The length the IP header states (IPv4's total length, IPv6's 40 +
    /// payload length) does not match the packet (checksum offload of an
    /// unsegmented packet).
    IpLength {
        /// What the header says.
        header: usize,
        /// What the packet is.
        packet: usize,
    },
    /// More header bytes than the queue places in one buffer (headers are
    /// never split): the format's largest buffer, or one page (a header
    /// that fits no bounce slot goes in a frag of its own, of at most a
    /// page), less the format's prefix.
    TooLong {
        /// Header bytes given.
        len: usize,
        /// The most header bytes the queue places.
        max: usize,
    },
    /// More header bytes than the engine copies to fill in what the
    /// device does not (the IPv4 header checksum, the pseudo-header sum)
    /// for a format that needs it.
    TooLongToPatch {
        /// Header bytes given.
        len: usize,
        /// The most the engine patches.
        max: usize,
    },
    /// The length a UDP header states is not the datagram's (its header
    /// and the payload; checksum offload): the receiver would read
    /// another datagram than the one the device summed.
    UdpLength {
        /// What the header says.
        header: usize,
        /// What the datagram is.
        packet: usize,
    },
    /// An IPv4 fragment: its L4 checksum covers the whole datagram, and
    /// past the first fragment the bytes after its IP header are payload,
    /// not an L4 header, so no offload can use it.
    IpFragment {
        /// More fragments follow (the MF flag).
        more: bool,
        /// Where the fragment starts in the datagram, in 8-byte units.
        offset: u16,
    },
    /// An MSS of 0.
    ZeroMss,
    /// No header bytes: every packet starts with at least its Ethernet
    /// header, in a descriptor of its own.
    Empty,
}

impl std::fmt::Display for HeaderFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderFault::Parse(s) => write!(f, "headers do not parse: {s}"),
            HeaderFault::NotIp(t) => write!(f, "ether type {t:#06x} is neither IPv4 nor IPv6"),
            HeaderFault::NotTcpOrUdp(p) => write!(f, "IP protocol {p} is not TCP or UDP"),
            HeaderFault::TsoNeedsTcp => write!(f, "TSO needs TCP"),
            HeaderFault::Length { given, parsed } => write!(
                f,
                "{given} header bytes given, the Ethernet, IP and L4 headers take {parsed}"
            ),
            HeaderFault::IpLength { header, packet } => write!(
                f,
                "the IP header's length {header} does not match the packet's {packet} bytes"
            ),
            HeaderFault::TooLong { len, max } => write!(
                f,
                "{len} header bytes, more than one header buffer holds ({max})"
            ),
            HeaderFault::TooLongToPatch { len, max } => write!(
                f,
                "{len} header bytes, more than the engine completes in a copy ({max})"
            ),
            HeaderFault::UdpLength { header, packet } => write!(
                f,
                "the UDP header's length {header} does not match the datagram's {packet} bytes"
            ),
            HeaderFault::IpFragment { more, offset } => write!(
                f,
                "an IPv4 fragment (offset {offset} x 8 bytes, more fragments: {more})"
            ),
            HeaderFault::ZeroMss => write!(f, "MSS 0"),
            HeaderFault::Empty => write!(f, "no header bytes given"),
        }
    }
}

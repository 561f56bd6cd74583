//! What travels from a sender to a receiver by the caller's own means (a pickle, a pipe, a
//! queue): where to ask, the token that takes the offer, and where the block lies on which
//! pages. It grants the memory to whoever presents it first: send it only to the intended
//! receiver.

use super::frame::{Token, MAX_PAGES, TOKEN};
use crate::alloc::{BlockShare, DevicePtr};
use crate::error::{Error, Result};

const MAGIC: [u8; 4] = *b"CVHT";
const VERSION: u16 = 1;
const FIXED: usize = 4 + 2 + 2 + 4 + TOKEN + 16 + 8 * 4 + 4 + 2 + 2;
/// The longest address a sender listens at (an abstract Unix socket name).
pub(crate) const MAX_ADDRESS: usize = 107;

/// One offer, as the receiver needs it: see [`Sender::offer`](super::Sender::offer).
#[derive(Clone, PartialEq, Eq)]
pub struct Ticket {
    pub(crate) address: Vec<u8>,
    pub(crate) pid: u32,
    pub(crate) token: Token,
    pub(crate) device: [u8; 16],
    /// Where the block lies in the sender, on which of its pages.
    pub(crate) share: BlockShare,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("pid", &self.pid)
            .field("block", &format_args!("{:#x}", self.share.block))
            .field("len", &self.share.len)
            .field("page", &self.share.page)
            .field("pages", &self.share.pages.len())
            .finish()
    }
}

impl Ticket {
    /// The sending process's pid (in its own PID namespace).
    pub fn sender_pid(&self) -> u32 {
        self.pid
    }

    /// The UUID of the device the memory lives on.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device
    }

    /// The block's size in bytes.
    pub fn len(&self) -> u64 {
        self.share.len
    }

    /// Whether the block is empty (never: no empty block is offered).
    pub fn is_empty(&self) -> bool {
        self.share.len == 0
    }

    /// Where the block starts past the first page under it: the receiver's mapping of the pages
    /// holds the block this far into it.
    pub fn offset(&self) -> u64 {
        self.share.block.get() - self.share.first_page
    }

    /// The block's address in the sender (the storage's address there, for a caller that names
    /// a place inside the block by its address).
    pub fn block(&self) -> u64 {
        self.share.block.get()
    }

    /// Bytes per page under the block.
    pub fn page(&self) -> u64 {
        self.share.page as u64
    }

    /// The sender's serials of the pages under the block, in address order.
    pub fn serials(&self) -> &[u64] {
        &self.share.pages
    }

    /// Bytes of a ticket of `pages` pages from a sender listening at an address of `address`
    /// bytes.
    pub(crate) fn len_for(pages: usize, address: usize) -> usize {
        FIXED + 8 * pages + address
    }

    /// The ticket as bytes (`docs/WIRE.md`, "The ticket").
    pub fn to_bytes(&self) -> Vec<u8> {
        let BlockShare { block, len, first_page, page, pages: ref serials } = self.share;
        let mut b = Vec::with_capacity(FIXED + 8 * serials.len() + self.address.len());
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&self.token.0);
        b.extend_from_slice(&self.device);
        for v in [block.get(), len, first_page, page as u64] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(serials.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.address.len() as u16).to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        for s in serials {
            b.extend_from_slice(&s.to_le_bytes());
        }
        b.extend_from_slice(&self.address);
        b
    }

    /// A ticket from bytes, every field checked: the pages must cover the block exactly as a
    /// sender lays it out, so that nothing a peer sends maps less than the block or reads past it.
    pub fn from_bytes(b: &[u8]) -> Result<Ticket> {
        let bad = |why: &str| Error::Protocol(format!("not a hand-off ticket: {why}"));
        if b.len() < FIXED || b[..4] != MAGIC {
            return Err(bad("too short or wrong magic"));
        }
        let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4"));
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8"));
        if u16_at(4) != VERSION || u16_at(6) != 0 || u16_at(FIXED - 2) != 0 {
            return Err(bad("another version, or reserved fields set"));
        }
        let pid = u32_at(8);
        let token = Token(b[12..12 + TOKEN].try_into().expect("16"));
        let device: [u8; 16] = b[28..44].try_into().expect("16");
        let (block, len, first_page, page) = (u64_at(44), u64_at(52), u64_at(60), u64_at(68));
        let count = u32_at(76);
        let alen = usize::from(u16_at(80));
        if count == 0 || count > MAX_PAGES || alen == 0 || alen > MAX_ADDRESS {
            return Err(bad("no pages, too many, or a bad address length"));
        }
        if b.len() != FIXED + 8 * count as usize + alen {
            return Err(bad("its length does not match its counts"));
        }
        if pid == 0 || pid > i32::MAX as u32 {
            return Err(bad("no sender pid"));
        }
        // Pages are at least the driver's smallest granularity, and a power of two or a multiple
        // of 2 MiB; the block lies within them from the first, and reaches the last.
        let covered = page.checked_mul(u64::from(count));
        let ok = page >= 2 << 20
            && page % (2 << 20) == 0
            && len > 0
            && block >= first_page
            && covered.is_some_and(|c| {
                let off = block - first_page;
                off < page && off.checked_add(len).is_some_and(|end| end <= c && end > c - page)
            });
        if !ok {
            return Err(bad("the block does not lie on its pages"));
        }
        let page = usize::try_from(page).map_err(|_| bad("pages larger than this process maps"))?;
        let mut serials = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            serials.push(u64_at(FIXED + 8 * i));
        }
        let address = b[FIXED + 8 * count as usize..].to_vec();
        let share = BlockShare { block: DevicePtr::new(block), len, first_page, page, pages: serials };
        Ok(Ticket { address, pid, token, device, share })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn ticket() -> Ticket {
        Ticket {
            address: b"\0cuvmm-handoff-7-abc".to_vec(),
            pid: 7,
            token: Token([9; 16]),
            device: [3; 16],
            share: BlockShare {
                block: DevicePtr::new((128 << 20) + 4096),
                len: 200 << 20,
                first_page: 128 << 20,
                page: 128 << 20,
                pages: vec![11, 12],
            },
        }
    }

    #[test]
    fn a_ticket_comes_back_as_it_went() {
        let t = ticket();
        assert_eq!(Ticket::from_bytes(&t.to_bytes()).unwrap(), t);
        assert_eq!(t.offset(), 4096);
    }

    #[test]
    fn a_block_off_its_pages_is_refused() {
        for change in [
            |t: &mut Ticket| t.share.len = 300 << 20, // past the last page
            |t: &mut Ticket| t.share.len = 100 << 20, // the last page unused
            |t: &mut Ticket| t.share.first_page = t.share.block.get() + 1, // starts before its first page
            |t: &mut Ticket| t.share.page = 3 << 20 | 1, // no page size
            |t: &mut Ticket| t.share.pages.clear(),
            |t: &mut Ticket| t.pid = 0,
            |t: &mut Ticket| t.address.clear(),
            // The block's end past 2^64, wrapping back onto its one page.
            |t: &mut Ticket| (t.share.pages, t.share.len) = (vec![11], u64::MAX - 1),
        ] {
            let mut t = ticket();
            change(&mut t);
            assert!(Ticket::from_bytes(&t.to_bytes()).is_err(), "{t:?}");
        }
    }

    proptest! {
        #[test]
        fn any_bytes_are_a_ticket_or_refused(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(t) = Ticket::from_bytes(&b) {
                prop_assert_eq!(t.to_bytes(), b);
            }
        }

        #[test]
        fn a_cut_or_lengthened_ticket_is_refused(cut in 1usize..40, extra in 1usize..9) {
            let b = ticket().to_bytes();
            prop_assert!(Ticket::from_bytes(&b[..b.len() - cut]).is_err());
            let mut longer = b.clone();
            longer.extend(std::iter::repeat(0).take(extra));
            // A longer one reads as a longer address only if its length field says so: it does not.
            prop_assert!(Ticket::from_bytes(&longer).is_err());
        }
    }
}

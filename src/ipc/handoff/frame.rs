//! The hand-off's messages as bytes: one message per `SOCK_SEQPACKET` record, a 16-byte head and
//! a body of fixed-size entries. `docs/WIRE.md` ("The hand-off") is the specification; this is
//! its one encoder and decoder, and everything a peer sends goes through [`Frame::decode`].

use crate::error::{Error, Result};

/// The first four bytes of every message.
pub const MAGIC: [u8; 4] = *b"CVHO";
/// The version this code speaks and accepts.
pub const VERSION: u16 = 1;
/// Bytes before the body.
pub const HEAD: usize = 16;
/// Bytes of a token.
pub const TOKEN: usize = 16;
/// The most descriptors one message carries (Linux passes at most 253).
pub const FDS_PER_MESSAGE: usize = 250;
/// The most tokens in one release.
pub const RELEASES_PER_MESSAGE: usize = 256;
/// The most offers one answer hands over (the one asked for and those of its group).
pub const OFFERS_PER_ANSWER: usize = 256;
/// The most serials in one revocation.
pub const SERIALS_PER_MESSAGE: usize = 512;
/// The most pages under one offer: 2 TiB of the smallest (2 MiB) pages.
pub const MAX_PAGES: u32 = 1 << 20;
/// The largest message: a placement of as many pages as one message carries descriptors (6,000
/// bytes of entries; a release, a revocation or an unplacement at most 4,096, an answer 6,144).
pub const MAX_MESSAGE: usize = HEAD
    + max(
        max(OFFERS_PER_ANSWER * 24, RELEASES_PER_MESSAGE * TOKEN),
        max(SERIALS_PER_MESSAGE * 8, FDS_PER_MESSAGE * PLACE),
    );
/// Bytes of a placement's entry.
pub const PLACE: usize = 24;

const fn max(a: usize, b: usize) -> usize {
    if a > b {
        a
    } else {
        b
    }
}

/// What identifies one offer: 16 random bytes that only the sender and whoever it gave them know.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token(pub [u8; TOKEN]);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A token grants its memory: never printed whole.
        write!(f, "Token({:02x}{:02x}..)", self.0[0], self.0[1])
    }
}

/// Why a sender did not hand an offer over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No offer has this token: never made, taken already, or let go.
    Unknown = 1,
    /// The offer's page descriptors could not be made (the sender's error log says why); the
    /// offer is let go.
    Failed = 2,
    /// The sender let the offer go before anyone took it: withdrawn (`Sender::withdraw`),
    /// declined by a receiver, or past its time to live.
    Withdrawn = 3,
}

impl Refusal {
    fn from_code(c: u32) -> Option<Refusal> {
        Some(match c {
            1 => Refusal::Unknown,
            2 => Refusal::Failed,
            3 => Refusal::Withdrawn,
            _ => return None,
        })
    }
}

/// One message of the hand-off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Receiver to sender: give me this offer and its pages' descriptors. Answered by
    /// [`Offered`](Frame::Offered) (then [`Pages`](Frame::Pages)) or [`Refused`](Frame::Refused).
    Fetch(Token),
    /// Receiver to sender: I take this offer and map its pages already. Answered by
    /// [`Held`](Frame::Held) or [`Refused`](Frame::Refused).
    Hold(Token),
    /// Receiver to sender: I let go of these offers (taken or not). Not answered.
    Release(Vec<Token>),
    /// Sender to receiver: the offers handed over, each with its page count: the one fetched
    /// first, then those of its group. Their descriptors follow in `Pages` messages, in order.
    Offered(Vec<(Token, u32)>),
    /// Sender to receiver: this many of the descriptors an answer announced (they come with it).
    Pages(usize),
    /// Sender to receiver: the fetch is not answered with memory.
    Refused(Refusal),
    /// Sender to receiver: these pages (by the sender's serials) are going back to the device:
    /// unmap them once no lease uses them.
    Revoke(Vec<u64>),
    /// Sender to receiver: the hold is granted; the offer is this connection's until released,
    /// and so are the offers listed, the rest of its group, taken along without descriptors.
    Held(Vec<Token>),
    /// Receiver to sender: place your pages on the device with this UUID in my mirror of your
    /// address space, from now on (those mapped now, and each one as it is mapped). Not answered.
    Mirror([u8; 16]),
    /// Sender to receiver: these pages are mapped at these addresses here; a descriptor of each
    /// comes with the message, in order. The receiver may map each at the same place in its
    /// mirror; it may also close the descriptor and map nothing.
    Placed(Vec<Placement>),
    /// Sender to receiver: the pages placed at these addresses are mapped there no more (the
    /// memory under a block offered stays where it is until released).
    Unplaced(Vec<u64>),
}

/// A page mapped in the sender: its serial, where it lies there, its size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The page's serial (what a ticket's pages and a revocation name).
    pub serial: u64,
    /// Its address in the sending process.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
}

const FETCH: u16 = 1;
const HOLD: u16 = 2;
const RELEASE: u16 = 3;
const OFFERED: u16 = 16;
const PAGES: u16 = 17;
const REFUSED: u16 = 18;
const REVOKE: u16 = 19;
const HELD: u16 = 20;
const MIRROR: u16 = 5;
const PLACED: u16 = 21;
const UNPLACED: u16 = 22;

impl Frame {
    /// The descriptors that travel with this message.
    pub fn fd_count(&self) -> usize {
        match self {
            Frame::Pages(n) => *n,
            Frame::Placed(ps) => ps.len(),
            _ => 0,
        }
    }

    /// The message's bytes. Refuses what no receiver would accept (an empty or oversized list).
    pub fn encode(&self) -> Result<Vec<u8>> {
        let (kind, count, body): (u16, usize, Vec<u8>) = match self {
            Frame::Fetch(t) => (FETCH, 1, t.0.to_vec()),
            Frame::Hold(t) => (HOLD, 1, t.0.to_vec()),
            Frame::Release(ts) => {
                bounded("release", ts.len(), RELEASES_PER_MESSAGE)?;
                (RELEASE, ts.len(), ts.iter().flat_map(|t| t.0).collect())
            }
            Frame::Offered(os) => {
                bounded("answer", os.len(), OFFERS_PER_ANSWER)?;
                let mut b = Vec::with_capacity(os.len() * 24);
                for (t, pages) in os {
                    if *pages == 0 || *pages > MAX_PAGES {
                        return Err(Error::invalid(format!("an offer of {pages} pages")));
                    }
                    b.extend_from_slice(&t.0);
                    b.extend_from_slice(&pages.to_le_bytes());
                    b.extend_from_slice(&0u32.to_le_bytes());
                }
                (OFFERED, os.len(), b)
            }
            Frame::Pages(n) => {
                bounded("pages message", *n, FDS_PER_MESSAGE)?;
                (PAGES, 0, Vec::new())
            }
            Frame::Refused(r) => (REFUSED, 1, [(*r as u32).to_le_bytes(), [0; 4]].concat()),
            Frame::Revoke(ss) => {
                bounded("revocation", ss.len(), SERIALS_PER_MESSAGE)?;
                (REVOKE, ss.len(), ss.iter().flat_map(|s| s.to_le_bytes()).collect())
            }
            Frame::Held(ts) => {
                if ts.len() >= OFFERS_PER_ANSWER {
                    return Err(Error::invalid(format!("a grant of {} offers along", ts.len())));
                }
                (HELD, ts.len(), ts.iter().flat_map(|t| t.0).collect())
            }
            Frame::Mirror(uuid) => (MIRROR, 1, uuid.to_vec()),
            Frame::Placed(ps) => {
                bounded("placement", ps.len(), FDS_PER_MESSAGE)?;
                let mut b = Vec::with_capacity(ps.len() * PLACE);
                for p in ps {
                    if !p.valid() {
                        return Err(Error::invalid(format!("a placement of {p:?}")));
                    }
                    for v in [p.serial, p.addr, p.size] {
                        b.extend_from_slice(&v.to_le_bytes());
                    }
                }
                (PLACED, ps.len(), b)
            }
            Frame::Unplaced(addrs) => {
                bounded("unplacement", addrs.len(), SERIALS_PER_MESSAGE)?;
                (UNPLACED, addrs.len(), addrs.iter().flat_map(|a| a.to_le_bytes()).collect())
            }
        };
        let mut out = Vec::with_capacity(HEAD + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(&(count as u32).to_le_bytes());
        out.extend_from_slice(&(self.fd_count() as u32).to_le_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Decodes one message that arrived with `fds` descriptors, checking every field: a message
    /// that is not exactly what this version sends is refused ([`Error::Protocol`]).
    pub fn decode(b: &[u8], fds: usize) -> Result<Frame> {
        if b.len() < HEAD {
            return Err(refused(format!("{} bytes, fewer than a head", b.len())));
        }
        if b[..4] != MAGIC {
            return Err(refused("not a hand-off message (magic)"));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(refused(format!("version {version}, where this end speaks {VERSION}")));
        }
        let kind = u16::from_le_bytes([b[6], b[7]]);
        let count = u32_at(b, 8) as usize;
        let announced = u32_at(b, 12) as usize;
        let body = &b[HEAD..];
        let entry = match kind {
            FETCH | HOLD | RELEASE | HELD | MIRROR => TOKEN,
            OFFERED => 24,
            PLACED => PLACE,
            PAGES => 0,
            REFUSED | REVOKE | UNPLACED => 8,
            k => return Err(refused(format!("unknown kind {k}"))),
        };
        let (lo, hi) = match kind {
            FETCH | HOLD | REFUSED | MIRROR => (1, 1),
            RELEASE => (1, RELEASES_PER_MESSAGE),
            OFFERED => (1, OFFERS_PER_ANSWER),
            PLACED => (1, FDS_PER_MESSAGE),
            PAGES => (0, 0),
            HELD => (0, OFFERS_PER_ANSWER - 1),
            _ => (1, SERIALS_PER_MESSAGE),
        };
        if count < lo || count > hi {
            return Err(refused(format!("kind {kind} with {count} entries (allowed {lo} to {hi})")));
        }
        if body.len() != count * entry {
            return Err(refused(format!("kind {kind}: {} body bytes for {count} entries", body.len())));
        }
        let want_fds = match kind {
            PAGES => announced,
            PLACED => count,
            _ => 0,
        };
        if announced != want_fds
            || fds != want_fds
            || (kind == PAGES && !(1..=FDS_PER_MESSAGE).contains(&fds))
        {
            return Err(refused(format!("kind {kind} announces {announced} descriptors, {fds} came")));
        }
        let token = |i: usize| Token(body[i * TOKEN..(i + 1) * TOKEN].try_into().expect("16 bytes"));
        Ok(match kind {
            FETCH => Frame::Fetch(token(0)),
            HOLD => Frame::Hold(token(0)),
            RELEASE => Frame::Release((0..count).map(token).collect()),
            OFFERED => {
                let mut os = Vec::with_capacity(count);
                for e in body.chunks_exact(24) {
                    let pages = u32_at(e, 16);
                    if pages == 0 || pages > MAX_PAGES || u32_at(e, 20) != 0 {
                        return Err(refused(format!("an offer of {pages} pages (or a reserved field set)")));
                    }
                    os.push((Token(e[..TOKEN].try_into().expect("16 bytes")), pages));
                }
                Frame::Offered(os)
            }
            PAGES => Frame::Pages(fds),
            HELD => Frame::Held((0..count).map(token).collect()),
            MIRROR => Frame::Mirror(token(0).0),
            PLACED => {
                let mut ps = Vec::with_capacity(count);
                for e in body.chunks_exact(PLACE) {
                    let v = |i: usize| u64::from_le_bytes(e[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                    let p = Placement { serial: v(0), addr: v(1), size: v(2) };
                    if !p.valid() {
                        return Err(refused(format!("a placement of {p:?}")));
                    }
                    ps.push(p);
                }
                Frame::Placed(ps)
            }
            UNPLACED => Frame::Unplaced(
                body.chunks_exact(8).map(|e| u64::from_le_bytes(e.try_into().expect("8"))).collect(),
            ),
            REFUSED => {
                let r = Refusal::from_code(u32_at(body, 0))
                    .filter(|_| u32_at(body, 4) == 0)
                    .ok_or_else(|| refused("an unknown refusal"))?;
                Frame::Refused(r)
            }
            _ => Frame::Revoke(
                body.chunks_exact(8).map(|e| u64::from_le_bytes(e.try_into().expect("8"))).collect(),
            ),
        })
    }
}

impl Placement {
    /// A page somewhere: a size, an address, and no end past the address space.
    fn valid(&self) -> bool {
        self.size > 0 && self.addr > 0 && self.addr.checked_add(self.size).is_some()
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn bounded(what: &str, n: usize, most: usize) -> Result<()> {
    if n == 0 || n > most {
        return Err(Error::invalid(format!("a {what} of {n} entries (1 to {most})")));
    }
    Ok(())
}

fn refused(why: impl Into<String>) -> Error {
    Error::Protocol(format!("hand-off message refused: {}", why.into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(b: u8) -> Token {
        Token([b; TOKEN])
    }

    fn all() -> Vec<Frame> {
        vec![
            Frame::Fetch(t(1)),
            Frame::Hold(t(2)),
            Frame::Release(vec![t(3), t(4)]),
            Frame::Offered(vec![(t(5), 128), (t(6), 1)]),
            Frame::Pages(250),
            Frame::Refused(Refusal::Unknown),
            Frame::Refused(Refusal::Failed),
            Frame::Refused(Refusal::Withdrawn),
            Frame::Revoke(vec![7, 8, 9]),
            Frame::Held(vec![]),
            Frame::Held(vec![t(8), t(9)]),
            Frame::Mirror([7; 16]),
            Frame::Placed(vec![Placement { serial: 3, addr: 1 << 40, size: 128 << 20 }]),
            Frame::Placed(vec![Placement { serial: 4, addr: 2 << 21, size: 2 << 20 }; 2]),
            Frame::Unplaced(vec![1 << 40, 3 << 40]),
        ]
    }

    #[test]
    fn every_kind_comes_back_as_it_went() {
        for f in all() {
            let b = f.encode().unwrap();
            assert!(b.len() <= MAX_MESSAGE);
            assert_eq!(Frame::decode(&b, f.fd_count()).unwrap(), f);
        }
    }

    #[test]
    fn the_longest_list_of_every_kind_fits_the_receive_buffer() {
        for f in [
            Frame::Release(vec![t(3); RELEASES_PER_MESSAGE]),
            Frame::Offered(vec![(t(5), MAX_PAGES); OFFERS_PER_ANSWER]),
            Frame::Revoke(vec![7; SERIALS_PER_MESSAGE]),
            Frame::Placed(vec![Placement { serial: 1, addr: 1, size: 1 }; FDS_PER_MESSAGE]),
            Frame::Unplaced(vec![7; SERIALS_PER_MESSAGE]),
        ] {
            assert!(f.encode().unwrap().len() <= MAX_MESSAGE, "{f:?}");
        }
    }

    #[test]
    fn descriptors_other_than_announced_are_refused() {
        for f in all() {
            let b = f.encode().unwrap();
            let n = f.fd_count();
            assert!(Frame::decode(&b, n + 1).is_err(), "{f:?}");
            if n > 0 {
                assert!(Frame::decode(&b, n - 1).is_err(), "{f:?}");
            }
        }
    }

    #[test]
    fn lists_past_their_bounds_are_not_encoded() {
        assert!(Frame::Release(vec![]).encode().is_err());
        assert!(Frame::Release(vec![t(0); RELEASES_PER_MESSAGE + 1]).encode().is_err());
        assert!(Frame::Offered(vec![(t(0), 0)]).encode().is_err());
        assert!(Frame::Offered(vec![(t(0), MAX_PAGES + 1)]).encode().is_err());
        assert!(Frame::Pages(0).encode().is_err());
        assert!(Frame::Pages(FDS_PER_MESSAGE + 1).encode().is_err());
        assert!(Frame::Revoke(vec![0; SERIALS_PER_MESSAGE + 1]).encode().is_err());
        assert!(Frame::Placed(vec![]).encode().is_err());
        assert!(Frame::Placed(vec![Placement { serial: 1, addr: 1, size: 1 }; FDS_PER_MESSAGE + 1])
            .encode()
            .is_err());
        assert!(Frame::Unplaced(vec![]).encode().is_err());
    }

    #[test]
    fn a_placement_of_nothing_or_past_the_address_space_is_refused() {
        for p in [
            Placement { serial: 1, addr: 1 << 30, size: 0 },
            Placement { serial: 1, addr: 0, size: 1 << 21 },
            Placement { serial: 1, addr: u64::MAX - 4, size: 1 << 21 },
        ] {
            assert!(Frame::Placed(vec![p]).encode().is_err(), "{p:?}");
            let mut b =
                Frame::Placed(vec![Placement { serial: 1, addr: 1 << 30, size: 1 << 21 }]).encode().unwrap();
            b[HEAD + 8..HEAD + 16].copy_from_slice(&p.addr.to_le_bytes());
            b[HEAD + 16..HEAD + 24].copy_from_slice(&p.size.to_le_bytes());
            assert!(Frame::decode(&b, 1).is_err(), "{p:?}");
        }
    }

    #[test]
    fn a_changed_head_is_refused() {
        let b = Frame::Fetch(t(1)).encode().unwrap();
        for (at, v) in [(0, b'X'), (4, 2), (6, 99), (8, 2), (12, 1)] {
            let mut c = b.clone();
            c[at] = v;
            assert!(Frame::decode(&c, 0).is_err(), "byte {at} = {v}");
        }
        assert!(Frame::decode(&b[..b.len() - 1], 0).is_err());
        assert!(Frame::decode(&[b, vec![0]].concat(), 0).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused_and_what_decodes_encodes_the_same(
            b in proptest::collection::vec(any::<u8>(), 0..200), fds in 0usize..4,
        ) {
            if let Ok(f) = Frame::decode(&b, fds) {
                prop_assert_eq!(f.encode().unwrap(), b);
            }
        }
    }
}

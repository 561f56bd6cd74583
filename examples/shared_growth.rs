//! A vector that grows in one process while another follows it. The exporter appends a pattern in
//! five steps, telling the importer after each how many elements are written, then shrinks; the
//! importer maps each new chunk at the exporter's offset in the one range it reserved, checks the
//! pattern with a kernel, and prints what it mapped and where.
//!
//! `cargo run --release --example shared_growth` runs both (it starts itself as the importer);
//! `shared_growth export PATH` and `shared_growth import PATH` run one side each.

mod common;

use cuvmm::ipc::{GrowableImport, PeerPolicy, Update};
use cuvmm::kernels::{pattern_value, Kernels};
use cuvmm::vmm::HandleTypes;
use cuvmm::{Context, Stream, VmmVec};
use std::os::unix::net::{UnixListener, UnixStream};

type R = common::Side;

const SEED: u32 = 4321;

fn export(path: &str, spawn_importer: bool) -> R {
    let ctx = Context::for_ordinal(0)?;
    // 1 GiB of address space: the importer reserves as much, once, and the vector never moves.
    let mut v = VmmVec::<u32>::builder(&ctx)
        .handle_types(HandleTypes::POSIX_FD)
        .reserve_address_space(1 << 30)
        .build()?;
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    let child = if spawn_importer {
        Some(std::process::Command::new(std::env::current_exe()?).args(["import", path]).spawn()?)
    } else {
        None
    };
    let (s, _) = listener.accept()?;
    let _ = std::fs::remove_file(path);
    v.share_growth(s, 0)?;
    for step in 0..5 {
        let n = 1 << (18 + 2 * step); // 1, 4, 16, 64 and 256 MiB of u32s: 341 MiB in all
        let start = v.len();
        let block: Vec<u32> = (start..start + n).map(|i| pattern_value(i as u64, SEED)).collect();
        v.extend_from_slice(&block)?;
        v.notify_importers(v.len() as u64)?;
        println!(
            "exporter: {} elements, {} MiB in {} chunks",
            v.len(),
            v.mapped_bytes() >> 20,
            v.raw().chunk_count()
        );
    }
    v.truncate(1 << 18);
    v.shrink_to_fit()?;
    v.notify_importers(v.len() as u64)?;
    println!("exporter: shrunk to {} MiB", v.mapped_bytes() >> 20);
    drop(v); // the importer sees the connection close, and keeps what it maps
    if let Some(mut c) = child {
        if !c.wait()?.success() {
            return Err("the importer failed".into());
        }
    }
    Ok(())
}

fn import(path: &str) -> R {
    let ctx = Context::for_ordinal(0)?;
    let k = Kernels::load(&ctx)?;
    let st = Stream::new(&ctx)?;
    let s = UnixStream::connect(path)?;
    let mut imp = GrowableImport::accept(&ctx, s, PeerPolicy::SameUid, 4 << 30, &[])?;
    println!("importer: reserved {} MiB at {:#x}", imp.capacity() >> 20, imp.ptr());
    loop {
        match imp.next_update()? {
            Update::Grew { offset, size, .. } => {
                println!("importer: mapped {} MiB at offset {} MiB", size >> 20, offset >> 20)
            }
            Update::Shrank { length, .. } => {
                println!("importer: unmapped everything past {} MiB", length >> 20)
            }
            Update::Note { tag } => {
                let written = imp.as_slice::<u32>().slice(0..tag as usize)?;
                let bad = k.count_pattern_mismatches(&st, &written, 0, SEED)?;
                println!("importer: {tag} elements written, {bad} wrong, still at {:#x}", imp.ptr());
                if bad != 0 {
                    return Err("the pattern is wrong".into());
                }
            }
            Update::Closed => break,
        }
    }
    println!("importer: the exporter is gone; {} MiB stay mapped here", imp.mapped() >> 20);
    Ok(())
}

fn main() -> std::process::ExitCode {
    common::report("shared_growth", common::two_sides("cuvmm-shared-growth.sock", export, import))
}

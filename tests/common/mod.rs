//! Helpers shared by the integration tests.
#![allow(dead_code)]

#[path = "fake.rs"]
mod fake;
#[allow(unused_imports)]
pub use fake::{fake_driver, scratch};

/// The first two GPUs, or `None` on a machine with one (where `CUVMM_REQUIRE_GPUS` set makes
/// that a failure: the two-GPU machine must not skip the checks).
pub fn two_gpus() -> Option<(cuvmm::Device, cuvmm::Device)> {
    let devices = cuvmm::Device::all().unwrap();
    if devices.len() < 2 {
        assert!(
            std::env::var_os("CUVMM_REQUIRE_GPUS").is_none(),
            "this machine was expected to have two GPUs"
        );
        eprintln!("one GPU: the two-GPU checks run on the two-GPU machine (CUVMM_REQUIRE_GPUS=2)");
        return None;
    }
    Some((devices[0], devices[1]))
}

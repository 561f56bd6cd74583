//! The driver loader's failure paths, on the CPU, against missing files and a fake libcuda.

mod common;

use cuvmm::driver::sys::CUresult;
use cuvmm::driver::Driver;
use cuvmm::Error;

#[test]
fn a_missing_library_is_driver_not_found_with_the_path_and_message() {
    // SAFETY: no such file: nothing is opened, so nothing of it runs.
    let err = unsafe { Driver::load_from("/nonexistent/libcuda.so.1") }.err().expect("must fail");
    match &err {
        Error::DriverNotFound { tried } => {
            assert_eq!(tried.len(), 1);
            assert_eq!(tried[0].path, "/nonexistent/libcuda.so.1");
            assert!(tried[0].message.contains("No such file"), "{}", tried[0].message);
        }
        other => panic!("wrong error: {other:?}"),
    }
    let text = err.to_string();
    assert!(text.starts_with("no CUDA driver found: tried /nonexistent/libcuda.so.1"), "{text}");
    assert!(
        text.ends_with("; install the NVIDIA driver, or set CUVMM_LIBCUDA to the path of its libcuda.so.1"),
        "the fix is named: {text}"
    );
    assert_eq!(cuvmm::driver::LIBRARY_ENV, "CUVMM_LIBCUDA", "the variable the fix names");
}

#[test]
fn an_empty_library_variable_counts_as_unset() {
    // The only test of this binary that reads the environment.
    std::env::set_var(cuvmm::driver::LIBRARY_ENV, "");
    match Driver::load_default() {
        // A machine with a driver opens the default one.
        Ok(d) => assert!(cuvmm::driver::DEFAULT_LIBRARIES.contains(&d.library()), "{}", d.library()),
        Err(Error::DriverNotFound { tried }) => {
            let paths: Vec<&str> = tried.iter().map(|a| a.path.as_str()).collect();
            assert_eq!(paths, cuvmm::driver::DEFAULT_LIBRARIES);
        }
        // Before the fix: `dlopen("")` opened the test program, which lacks cuGetProcAddress.
        Err(other) => panic!("an empty CUVMM_LIBCUDA was taken as a path: {other}"),
    }
    std::env::remove_var(cuvmm::driver::LIBRARY_ENV);
}

#[test]
fn a_file_that_is_not_a_library_is_driver_not_found() {
    let path = std::env::temp_dir().join(format!("cuvmm-not-a-lib-{}", std::process::id()));
    std::fs::write(&path, b"this is not an ELF file").unwrap();
    // SAFETY: not an ELF file: dlopen refuses it before running anything.
    let err = unsafe { Driver::load_from(&path) }.err().expect("must fail");
    let _ = std::fs::remove_file(&path);
    match err {
        Error::DriverNotFound { tried } => assert!(
            tried[0].message.contains("ELF") || tried[0].message.contains("too short"),
            "{}",
            tried[0].message
        ),
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn a_library_without_cu_get_proc_address_is_a_missing_entry_point() {
    // SAFETY: the C library's libm: its initialisers are sound, and it exports no CUDA name, so
    // nothing of it is called.
    match unsafe { Driver::load_from("libm.so.6") }.err().expect("must fail") {
        Error::MissingEntryPoint { name, library, .. } => {
            assert_eq!(name, "cuGetProcAddress");
            assert_eq!(library, "libm.so.6");
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn a_driver_lacking_a_required_entry_point_names_it_and_its_version() {
    let lib = common::fake_driver("FAKE_MISSING_REQUIRED");
    // SAFETY: the fake driver implements each entry point it exports with cuda.h's signature.
    match unsafe { Driver::load_from(&lib) }.err().expect("must fail") {
        Error::MissingEntryPoint { name, version, reason, .. } => {
            assert_eq!(name, "cuMemCreate");
            assert_eq!(version, 10020);
            assert_eq!(reason, "the driver does not export it");
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn a_failing_cu_init_carries_the_drivers_name_and_text() {
    let lib = common::fake_driver("FAKE_NO_DEVICE");
    // SAFETY: the fake driver implements each entry point it exports with cuda.h's signature.
    let err = unsafe { Driver::load_from(&lib) }.err().expect("must fail");
    match &err {
        Error::Driver { call, code, .. } => {
            assert_eq!(*call, "cuInit");
            assert_eq!(*code, CUresult::ERROR_NO_DEVICE);
            assert_eq!(err.driver_name().as_deref(), Some("CUDA_ERROR_NO_DEVICE"));
            assert_eq!(err.driver_description().as_deref(), Some("no CUDA-capable device is detected"));
        }
        other => panic!("wrong error: {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"
    );
    assert_eq!(err.code(), Some(CUresult::ERROR_NO_DEVICE));
}

#[test]
fn the_cuda_11_resolver_is_used_when_v2_is_absent() {
    let lib = common::fake_driver("FAKE_V1_ONLY");
    // SAFETY: the fake driver implements each entry point it exports with cuda.h's signature.
    let d = unsafe { Driver::load_from(&lib) }.expect("loads through cuGetProcAddress");
    assert_eq!(d.version(), 12040);
    assert_eq!(cuvmm::driver::result::device::get_count(d.api()).unwrap(), 0);
}

#[test]
fn a_missing_optional_entry_point_fails_only_when_called() {
    let lib = common::fake_driver("FAKE_OLD_OPTIONAL");
    // SAFETY: the fake driver implements each entry point it exports with cuda.h's signature.
    let d = unsafe { Driver::load_from(&lib) }.expect("optional entry points may be missing");
    // SAFETY: the entry point is absent, so nothing reaches the driver.
    let err = unsafe { d.api().cuMemAllocAsync(std::ptr::null_mut(), 0, std::ptr::null_mut()) }.unwrap_err();
    match err {
        Error::Unsupported { what, why } => {
            assert_eq!(what, "cuMemAllocAsync");
            assert!(why.contains("unsupported by this driver"), "{why}");
        }
        other => panic!("wrong error: {other:?}"),
    }
}

#[test]
fn driver_errors_with_unknown_codes_keep_the_number() {
    let lib = common::fake_driver("FAKE_OK");
    // SAFETY: the fake driver implements each entry point it exports with cuda.h's signature.
    let d = unsafe { Driver::load_from(&lib) }.unwrap();
    let err = d.api().check("cuSomething", CUresult(123_456)).unwrap_err();
    assert_eq!(err.code(), Some(CUresult(123_456)));
    assert_eq!(
        err.to_string(),
        "cuSomething failed: CUresult 123456 (123456): no description from the driver"
    );
    // A code the crate knows but the fake's cuGetErrorName does not falls back to cuda.h's name.
    let err = d.api().check("cuMemMap", CUresult::ERROR_ALREADY_MAPPED).unwrap_err();
    assert!(err.to_string().starts_with("cuMemMap failed: CUDA_ERROR_ALREADY_MAPPED (208)"), "{err}");
    // And a stubbed entry point's error comes back through the driver's own text.
    let err = cuvmm::driver::result::ctx::synchronize(d.api()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cuCtxSynchronize failed: CUDA_ERROR_NOT_SUPPORTED (801): operation not supported"
    );
}

//! The ABI types' sizes and field offsets, as cuda.h (CUDA 13.0) has them: read on the GPU machine
//! with tools/abi_probe.c.

use cuvmm::driver::sys::*;
use std::mem::{offset_of, size_of};

#[test]
fn mem_location_matches_cuda_h() {
    assert_eq!(size_of::<CUmemLocation>(), 8);
    assert_eq!(offset_of!(CUmemLocation, type_), 0);
    assert_eq!(offset_of!(CUmemLocation, id), 4);
}

#[test]
fn allocation_prop_matches_cuda_h() {
    assert_eq!(size_of::<CUmemAllocationProp>(), 32);
    assert_eq!(offset_of!(CUmemAllocationProp, type_), 0);
    assert_eq!(offset_of!(CUmemAllocationProp, requestedHandleTypes), 4);
    assert_eq!(offset_of!(CUmemAllocationProp, location), 8);
    assert_eq!(offset_of!(CUmemAllocationProp, win32HandleMetaData), 16);
    assert_eq!(offset_of!(CUmemAllocationProp, allocFlags), 24);
    assert_eq!(size_of::<CUmemAllocFlags>(), 8);
    assert_eq!(offset_of!(CUmemAllocFlags, compressionType), 0);
    assert_eq!(offset_of!(CUmemAllocFlags, gpuDirectRDMACapable), 1);
    assert_eq!(offset_of!(CUmemAllocFlags, usage), 2);
    assert_eq!(offset_of!(CUmemAllocFlags, reserved), 4);
}

#[test]
fn access_desc_and_handles_match_cuda_h() {
    assert_eq!(size_of::<CUmemAccessDesc>(), 12);
    assert_eq!(offset_of!(CUmemAccessDesc, location), 0);
    assert_eq!(offset_of!(CUmemAccessDesc, flags), 8);
    assert_eq!(size_of::<CUmemFabricHandle>(), 64);
    assert_eq!(size_of::<CUipcMemHandle>(), 64);
    assert_eq!(size_of::<CUuuid>(), 16);
    assert_eq!(size_of::<CUmemGenericAllocationHandle>(), 8);
    assert_eq!(size_of::<CUdeviceptr>(), 8);
    assert_eq!(size_of::<CUresult>(), 4);
}

#[test]
fn enum_values_match_cuda_h() {
    assert_eq!(CUmemAllocationType::PINNED.0, 1);
    assert_eq!(CUmemLocationType::DEVICE.0, 1);
    assert_eq!(CUmemLocationType::HOST.0, 2);
    assert_eq!(CUmemLocationType::HOST_NUMA.0, 3);
    assert_eq!(CUmemAllocationHandleType::POSIX_FILE_DESCRIPTOR.0, 1);
    assert_eq!(CUmemAllocationHandleType::FABRIC.0, 8);
    assert_eq!(CUmemAccess_flags::PROT_READ.0, 1);
    assert_eq!(CUmemAccess_flags::PROT_READWRITE.0, 3);
    assert_eq!(CUmemAllocationGranularity_flags::RECOMMENDED.0, 1);
    assert_eq!(CU_MEM_ALLOCATION_COMP_GENERIC, 1);
    assert_eq!(CUdevice_attribute::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.0, 102);
    assert_eq!(CUdevice_attribute::HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED.0, 103);
    assert_eq!(CUdevice_attribute::GENERIC_COMPRESSION_SUPPORTED.0, 107);
    assert_eq!(CUdevice_attribute::GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED.0, 110);
    assert_eq!(CUdevice_attribute::HANDLE_TYPE_FABRIC_SUPPORTED.0, 128);
    assert_eq!(CUdevice_attribute::MULTICAST_SUPPORTED.0, 132);
    assert_eq!(CUdevice_attribute::HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.0, 141);
    assert_eq!(CUdevice_attribute::HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.0, 145);
    assert_eq!(CUresult::ERROR_NOT_PERMITTED.0, 800);
    assert_eq!(CUresult::ERROR_ALREADY_MAPPED.0, 208);
}

#[test]
fn result_codes_print_their_names() {
    assert_eq!(format!("{:?}", CUresult::ERROR_OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY(2)");
    assert_eq!(format!("{:?}", CUresult(4242)), "CUresult(4242)");
    assert_eq!(CUresult::ERROR_NOT_PERMITTED.known_name(), Some("CUDA_ERROR_NOT_PERMITTED"));
}

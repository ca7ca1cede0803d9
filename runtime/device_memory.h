// The device memory of a GPU library's step: one allocation per block of
// host memory the executor owns (the activation arena, the parameters, the
// gradients, the token slots), and every buffer of the step an alias into
// it at the offset the plan gave it (its host memory's offset in the host
// block, but for offloaded values, whose host copies live elsewhere).
//
// So the static plan holds on the device as it does on the host: buffers
// whose lifetimes do not overlap share their bytes, the device holds what
// the plan predicts (no allocation per buffer), and the addresses never
// change from step to step. A tile of the sequence (a View) is an alias of
// its buffer's rows too, instead of a copy.
//
// Aliases are Halide device crops (halide_device_crop): pointer arithmetic
// on CUDA, a cl_mem and an offset on OpenCL (Halide makes the sub-buffer at
// each launch, whose origin the device may require aligned:
// CL_DEVICE_MEM_BASE_ADDR_ALIGN, 128 bytes on PoCL, which the plan's
// offsets are multiples of).
#pragma once

#include <HalideRuntime.h>

#include <cstdint>
#include <string_view>

namespace halyard::runtime {

// The device interface of the GPU API a Halide target string names, from
// the Halide runtime linked into this program (CUDA or OpenCL); nullptr for
// CPU targets, other APIs, or a program without that runtime (then the
// step keeps Halide's own allocation per buffer).
const halide_device_interface_t* device_interface_of(std::string_view target);

class DeviceBlock {
 public:
  // Allocates `bytes` on the device.
  DeviceBlock(const halide_device_interface_t* device, int64_t bytes);
  ~DeviceBlock();
  DeviceBlock(const DeviceBlock&) = delete;
  DeviceBlock& operator=(const DeviceBlock&) = delete;

  int64_t bytes() const { return bytes_; }
  // Gives `buf` (which has no device memory) the block's device memory from
  // byte `offset` on, and whether it could: false when the offset is not a
  // multiple of `align` on an API whose aliases need it (OpenCL).
  bool alias(halide_buffer_t& buf, int64_t offset, int64_t align) const;
  // The block's device handle: on CUDA its address (a CUdeviceptr).
  uint64_t handle() const { return buf_.device; }
  // Waits for everything queued on the block's device so far (every
  // kernel and copy of the process's stream or queue); Halide's error code.
  int sync() const;
  // Copies bytes [offset, offset + bytes) of the block to `host` (which
  // holds that many) or from it, after what is queued before, and waits for
  // the copy. Throws Error naming `what` when Halide fails.
  void copy_to_host(uint8_t* host, int64_t offset, int64_t bytes, const char* what) const;
  void copy_from_host(const uint8_t* host, int64_t offset, int64_t bytes, const char* what) const;
  void fill_zero(const char* what) const;  // every byte

 private:
  void copy(uint8_t* host, int64_t offset, int64_t bytes, bool to_host, const char* what) const;

  int64_t bytes_;
  bool aligned_aliases_;  // OpenCL: a sub-buffer's origin must be aligned
  halide_dimension_t dims_[2];
  halide_buffer_t buf_{};  // the whole block, which the aliases crop
};

// Frees an alias (halide_device_release_crop), not its block.
void release_alias(halide_buffer_t& buf);

}  // namespace halyard::runtime

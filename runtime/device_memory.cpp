#include "runtime/device_memory.h"

#include <HalideRuntimeCuda.h>
#include <HalideRuntimeOpenCL.h>

#include <string>

#include "runtime/error.h"

// Present only where a GPU-target library brought that API's Halide runtime
// in: weak, so that programs without it link.
#pragma weak halide_cuda_device_interface
#pragma weak halide_opencl_device_interface

namespace halyard::runtime {
namespace {

// A block is a 2-D byte buffer of rows of kRow bytes: a halide_dimension_t's
// extent is 32-bit, and a long context's arena passes 2^31 bytes.
constexpr int32_t kRow = 4096;

}  // namespace

const halide_device_interface_t* device_interface_of(std::string_view target) {
  if (target.find("cuda") != std::string_view::npos && halide_cuda_device_interface) return halide_cuda_device_interface();
  if (target.find("opencl") != std::string_view::npos && halide_opencl_device_interface)
    return halide_opencl_device_interface();
  return nullptr;
}

DeviceBlock::DeviceBlock(const halide_device_interface_t* device, int64_t bytes)
    : bytes_(bytes),
      aligned_aliases_(halide_opencl_device_interface && device == halide_opencl_device_interface()),
      dims_{halide_dimension_t(0, kRow, 1), halide_dimension_t(0, static_cast<int32_t>((bytes + kRow - 1) / kRow), kRow)} {
  buf_.type = halide_type_t(halide_type_uint, 8);
  buf_.dimensions = 2;
  buf_.dim = dims_;
  // No host pointer: nothing copies the block itself, only its aliases.
  if (int err = halide_device_malloc(nullptr, &buf_, device))
    throw Error("error: cannot allocate " + std::to_string(bytes) + " bytes on the device (Halide error " +
                std::to_string(err) + "; Halide printed the reason above).\nfix: a schedule that needs less memory "
                "per rank (halyard-plan prints each rank's peak), or more ranks.");
}

DeviceBlock::~DeviceBlock() { halide_device_free(nullptr, &buf_); }

int DeviceBlock::sync() const { return halide_device_sync(nullptr, const_cast<halide_buffer_t*>(&buf_)); }

bool DeviceBlock::alias(halide_buffer_t& buf, int64_t offset, int64_t align) const {
  if (aligned_aliases_ && offset % align != 0) return false;
  // A crop of the block whose first byte is `offset` (Halide computes a
  // crop's offset from the mins), handed to `buf`: an alias of device
  // memory needs no particular shape.
  halide_dimension_t dims[2] = {halide_dimension_t(static_cast<int32_t>(offset % kRow), 1, 1),
                                halide_dimension_t(static_cast<int32_t>(offset / kRow), 1, kRow)};
  halide_buffer_t crop{};
  crop.type = buf_.type;
  crop.dimensions = 2;
  crop.dim = dims;
  if (int err = halide_device_crop(nullptr, &buf_, &crop))
    throw Error("error: cannot alias device memory at offset " + std::to_string(offset) + " of a block of " +
                std::to_string(bytes_) + " bytes (Halide error " + std::to_string(err) +
                "; Halide printed the reason above).");
  buf.device = crop.device;
  buf.device_interface = crop.device_interface;
  buf.flags &= ~static_cast<uint64_t>(halide_buffer_flag_device_dirty);
  return true;
}

void release_alias(halide_buffer_t& buf) { halide_device_release_crop(nullptr, &buf); }

}  // namespace halyard::runtime

#include "runtime/device_memory.h"

#include <HalideRuntimeCuda.h>
#include <HalideRuntimeOpenCL.h>

#include <algorithm>
#include <string>
#include <vector>

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

// In pieces that are crops of the block: the part of a row up to its end,
// or whole rows (at most 2^16 of them, so that extents stay 32-bit).
void DeviceBlock::copy(uint8_t* host, int64_t offset, int64_t bytes, bool to_host, const char* what) const {
  if (offset < 0 || bytes < 0 || offset + bytes > bytes_)
    throw Error(std::string("error: copying bytes [") + std::to_string(offset) + ", " + std::to_string(offset + bytes) +
                ") of a device block of " + std::to_string(bytes_) + " bytes (" + what + "): out of range.");
  while (bytes > 0) {
    const int64_t x = offset % kRow, y = offset / kRow;
    const bool part_row = x != 0 || bytes < kRow;
    const int64_t rows = part_row ? 1 : std::min<int64_t>(bytes / kRow, 1 << 16);
    const int64_t n = part_row ? std::min(bytes, kRow - x) : rows * kRow;
    halide_dimension_t dims[2] = {halide_dimension_t(static_cast<int32_t>(x), static_cast<int32_t>(part_row ? n : kRow), 1),
                                  halide_dimension_t(static_cast<int32_t>(y), static_cast<int32_t>(rows), kRow)};
    halide_buffer_t crop{};
    crop.type = buf_.type;
    crop.dimensions = 2;
    crop.dim = dims;
    int err = halide_device_crop(nullptr, &buf_, &crop);
    if (!err) {
      crop.host = host;  // the crop's first byte, at its mins
      crop.flags = to_host ? halide_buffer_flag_device_dirty : halide_buffer_flag_host_dirty;
      err = to_host ? halide_copy_to_host(nullptr, &crop) : halide_copy_to_device(nullptr, &crop, buf_.device_interface);
      if (!err) err = halide_device_sync(nullptr, &crop);
      halide_device_release_crop(nullptr, &crop);
    }
    if (err)
      throw Error(std::string("error: copying ") + std::to_string(n) + " bytes " + (to_host ? "from" : "to") +
                  " the device (" + what + ") failed with Halide error " + std::to_string(err) +
                  "; Halide printed the reason above.");
    host += n;
    offset += n;
    bytes -= n;
  }
}

void DeviceBlock::copy_to_host(uint8_t* host, int64_t offset, int64_t bytes, const char* what) const {
  copy(host, offset, bytes, true, what);
}

void DeviceBlock::copy_from_host(const uint8_t* host, int64_t offset, int64_t bytes, const char* what) const {
  copy(const_cast<uint8_t*>(host), offset, bytes, false, what);  // (only read)
}

void DeviceBlock::fill_zero(const char* what) const {
  const std::vector<uint8_t> zeros(static_cast<size_t>(std::min<int64_t>(bytes_, 64 << 20)), 0);
  for (int64_t at = 0; at < bytes_; at += static_cast<int64_t>(zeros.size()))
    copy_from_host(zeros.data(), at, std::min<int64_t>(bytes_ - at, static_cast<int64_t>(zeros.size())), what);
}

void release_alias(halide_buffer_t& buf) { halide_device_release_crop(nullptr, &buf); }

}  // namespace halyard::runtime

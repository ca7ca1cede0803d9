// A main() for fuzz targets built without libFuzzer (gcc): replays inputs
// through the target's LLVMFuzzerTestOneInput once each, so that the corpus
// under tests/fuzz/corpus/ is a regression test in every build.
//
//   fuzz_safetensors tests/fuzz/corpus/safetensors [more files or directories]
//
// Each argument is a file (one input) or a directory (each regular file in it,
// in name order, is one input). An input that crashes, trips a check or throws
// anything but the project's own errors ends the program the way libFuzzer
// would: the exception escapes and std::terminate aborts, after this program
// names the input on stderr. No inputs at all is an error too (exit 2): an
// empty or misnamed corpus must not pass as "replayed clean".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg = argv[i];
    if (fs::is_directory(arg)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(arg))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      inputs.insert(inputs.end(), files.begin(), files.end());
    } else if (fs::is_regular_file(arg)) {
      inputs.push_back(arg);
    } else {
      std::fprintf(stderr, "error: %s is neither a file nor a directory of inputs.\n", argv[i]);
      return 2;
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "error: no inputs to replay.\nusage: %s <input file or corpus directory>...\n", argv[0]);
    return 2;
  }
  for (const fs::path& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::fprintf(stderr, "replaying %s (%zu bytes)\n", p.c_str(), bytes.size());
    // A copy in its own allocation, as libFuzzer passes it: a read past the end
    // is then past a heap block, where ASan (if on) sees it.
    std::vector<uint8_t> data(bytes.begin(), bytes.end());
    LLVMFuzzerTestOneInput(data.data(), data.size());
  }
  std::fprintf(stderr, "replayed %zu inputs clean\n", inputs.size());
  return 0;
}

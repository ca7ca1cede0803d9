// Collectives carry their mesh axis: a step's all-reduce over "sp" sums over
// the ranks of one sequence only, over "dp,sp" over every rank of the mesh.
// A hand-written program (no generator) on a 2 x 2 mesh of in-process ranks:
// a kernel writes the rank's first token id into a scalar, an all-reduce
// over the call's axis sums it, and that sum is the step's "loss".
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <HalideRuntime.h>

#include <string>
#include <thread>

#include "runtime/error.h"
#include "runtime/model.h"

namespace halyard::runtime {
namespace {

// out[] = float(ids[0, 0])
int first_id(void** args) {
  const auto* ids = static_cast<halide_buffer_t*>(args[0]);
  auto* out = static_cast<halide_buffer_t*>(args[1]);
  *reinterpret_cast<float*>(out->host) = static_cast<float>(reinterpret_cast<const int32_t*>(ids->host)[0]);
  return 0;
}

struct AxisProgram {
  BufferSpec buffers[3] = {
      {"input_ids", ElemType::I32, 2, {1, 2}, Storage::Input, 0, 0, 0},
      {"first_id", ElemType::F32, 0, {}, Storage::Arena, 0, 0, 0},
      {"sum", ElemType::F32, 0, {}, Storage::Arena, 0, 128, 0},
  };
  int args[4] = {0, 1, 1, 2};
  CallSpec calls[2];
  ModelSpec spec{};

  explicit AxisProgram(const char* axis) {
    calls[0] = {&first_id, "first_id", "first_id", 2, args, CallKind::Kernel, nullptr, 0};
    calls[1] = {nullptr, "all_reduce", "sum over one axis", 2, args + 2, CallKind::AllReduce, axis, 0};
    spec.name = "mesh_axes";
    spec.batch = 1, spec.seq = 4, spec.vocab = 100, spec.sp = 2, spec.local_seq = 2, spec.ignore_index = -100;
    spec.train = spec.forward = ProgramSpec{buffers, 3, calls, 2, 256, 2};
    spec.sequence_layout = "contiguous";
  }
};

// World rank w of a dp 2 x sp 2 mesh (sequence groups {0, 1} and {2, 3})
// feeds token w + 1; returns each rank's sum.
std::vector<double> run_mesh(const char* axis) {
  AxisProgram prog(axis);
  auto mesh = make_in_process_group(4, 30);
  std::vector<std::vector<std::unique_ptr<Communicator>>> sp;
  for (int g = 0; g < 2; ++g) sp.push_back(make_in_process_group(2, 30));
  std::vector<double> out(4, -1);
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      try {
        Model m(prog.spec, sp[static_cast<size_t>(w / 2)][static_cast<size_t>(w % 2)].get(),
                mesh[static_cast<size_t>(w)].get());
        const int32_t ids[2] = {w + 1, 0}, labels[2] = {-100, -100}, positions[2] = {2 * (w % 2), 2 * (w % 2) + 1};
        out[static_cast<size_t>(w)] = m.forward_loss(ids, labels, positions);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(w)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int w = 0; w < 4; ++w) EXPECT_EQ(errors[static_cast<size_t>(w)], "") << "rank " << w;
  return out;
}

TEST(MeshAxes, AllReduceOverSpSumsOneSequenceGroup) {
  EXPECT_EQ(run_mesh("sp"), (std::vector<double>{3, 3, 7, 7}));
}

TEST(MeshAxes, AllReduceOverTheWholeMeshSumsEveryRank) {
  EXPECT_EQ(run_mesh("dp,sp"), (std::vector<double>{10, 10, 10, 10}));
}

TEST(MeshAxes, AnAxisTheRuntimeDoesNotKnowIsAnError) {
  AxisProgram prog("tp");
  auto group = make_in_process_group(2, 30);
  std::string error;
  std::thread t([&] {
    try {
      Model m(prog.spec, group[0].get());
      const int32_t ids[2] = {1, 0}, labels[2] = {-100, -100}, positions[2] = {0, 1};
      m.forward_loss(ids, labels, positions);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  t.join();
  EXPECT_THAT(error, ::testing::HasSubstr("over mesh axis \"tp\""));
  EXPECT_THAT(error, ::testing::HasSubstr("\"sp\" and \"dp,sp\""));
}

}  // namespace
}  // namespace halyard::runtime

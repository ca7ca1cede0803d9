// The generator program (see aot.h): plan, lower, compile, emit.
#include "generators/aot.h"

#include <Halide.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <spawn.h>
#include <unistd.h>
#include <sys/wait.h>

#include "dsl/autodiff.h"
#include "schedules/sharding.h"
#include "schedules/tiling.h"
#include "dsl/error.h"
#include "generators/lowering.h"
#include "generators/optimizer.h"
#include "schedules/program.h"
#include "schedules/autosp.h"

namespace halyard {
namespace {

struct Options {
  std::string name, config, schedule = "default", target = "host", out, cluster = "local-cpu", plan_json, schedule_out;
  int64_t batch = 1, seq = 0, sp = 0;  // sp 0: as the schedule's mesh says
  int64_t ranks = 0, memory_per_rank = 0;  // for --schedule autosp (0: the cluster's)
  std::vector<std::string> bf16;            // for --schedule autosp: what it may hold or compute in bf16
  std::vector<std::string> strategies;      // for --schedule autosp: the head redistributions it considers (empty: all)
  bool runtime_only = false;
  bool plan_only = false;
  std::string plugin_dir;
};

// SCHEDULE autosp: the search chooses the schedule (schedules/autosp.h).
// `why` receives what a user needs to trust the choice, for the plan JSON:
// the budget, the runners-up, the rejections and what one rank would need.
Schedule choose(const Options& o, const ModelBuilder& build, const Cluster& cluster, nlohmann::ordered_json& why) {
  SearchOptions so;
  so.ranks = o.ranks > 0 ? o.ranks : o.sp > 0 ? o.sp : cluster.ranks;
  so.memory_per_rank = o.memory_per_rank;
  so.zero = {1};  // what llama_train runs (ZeRO-3 is planned only)
  so.bf16 = o.bf16;
  so.strategies = o.strategies;
  if (o.sp > 0) so.sp = {o.sp};
  const SearchResult r = autosp(build, {o.config, o.batch, o.seq}, cluster, so);
  const int64_t budget = so.memory_per_rank > 0 ? so.memory_per_rank : cluster.memory_per_rank_bytes;
  if (!r.feasible)
    throw UserError("error: SCHEDULE autosp: no plan of " + o.config + " at seq " + std::to_string(o.seq) + " fits " +
                    std::to_string(budget >> 20) + " MiB per rank on " + std::to_string(so.ranks) + " ranks of " +
                    cluster.name + ": " + r.infeasible +
                    ".\nfix: raise MEMORY_PER_RANK, use more RANKS, or a shorter SEQ (halyard-plan --seq max says "
                    "the longest that fits).");
  std::printf("autosp for %s: %s\n  predicted peak %.1f MiB of %.1f MiB per rank, step %.4f s; %d plans scored in %.1f s\n",
              o.name.c_str(), r.best().schedule.str().c_str(), static_cast<double>(r.best().peak_bytes) / 1048576,
              static_cast<double>(budget) / 1048576, r.best().step_s, r.plans, r.seconds);
  for (size_t i = 1; i < r.ranked.size(); ++i)
    std::printf("  runner-up: mesh dp=%lld x sp=%lld, tiles %lld/%lld: %.1f MiB, %.4f s\n",
                static_cast<long long>(r.ranked[i].schedule.mesh.dp), static_cast<long long>(r.ranked[i].schedule.mesh.sp),
                static_cast<long long>(r.ranked[i].schedule.seq_tile), static_cast<long long>(r.ranked[i].schedule.loss_tile()),
                static_cast<double>(r.ranked[i].peak_bytes) / 1048576, r.ranked[i].step_s);
  for (const Rejection& x : r.rejected) std::printf("  rejected: %s: %s\n", x.what.c_str(), x.reason.c_str());
  why = {{"ranks", so.ranks}, {"memory_per_rank_bytes", budget}, {"plans_scored", r.plans}, {"seconds", r.seconds}};
  why["runners_up"] = nlohmann::ordered_json::array();
  for (size_t i = 1; i < r.ranked.size(); ++i)
    why["runners_up"].push_back({{"schedule", r.ranked[i].schedule.str()},
                                 {"peak_bytes", r.ranked[i].peak_bytes},
                                 {"step_s", r.ranked[i].step_s}});
  why["rejected"] = nlohmann::ordered_json::array();
  for (const Rejection& x : r.rejected) why["rejected"].push_back({{"what", x.what}, {"reason", x.reason}});
  // One rank, no split: what it would need saving everything, and with every
  // layer checkpointed (the least a plain single-device run gets).
  for (const char* preset : {"default", "checkpoint"}) {
    Schedule one = Schedule::named(preset);
    one.mesh.dp = one.mesh.sp = 1;
    why["one_rank_peak_bytes"][preset] = plan(build, {o.config, o.batch, o.seq}, one, cluster).memory.total();
  }
  return r.best().schedule;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw UserError("error: " + k + " needs a value.");
      return argv[++i];
    };
    if (k == "--name") o.name = next();
    else if (k == "--config") o.config = next();
    else if (k == "--schedule") o.schedule = next();
    else if (k == "--target") o.target = next();
    else if (k == "--out") o.out = next();
    else if (k == "--batch") o.batch = parse_count(k, next());
    else if (k == "--seq") o.seq = parse_count(k, next());
    else if (k == "--sp") o.sp = parse_count(k, next());
    else if (k == "--plugin-dir") o.plugin_dir = next();
    else if (k == "--cluster") o.cluster = next();
    else if (k == "--plan-json") o.plan_json = next();
    else if (k == "--schedule-out") o.schedule_out = next();
    else if (k == "--ranks") o.ranks = parse_count(k, next());
    else if (k == "--memory-per-rank") o.memory_per_rank = parse_count(k, next());  // bytes
    else if (k == "--bf16") o.bf16 = parse_bf16_choices(next());
    else if (k == "--strategies") o.strategies = parse_strategies(next());
    else if (k == "--runtime-only") o.runtime_only = true;
    else if (k == "--plan-only") o.plan_only = true;
    else throw UserError("error: unknown option \"" + k + "\".\nlegal: --name --config --schedule --batch --seq --sp --target --out --plugin-dir --cluster --plan-json --schedule-out --ranks --memory-per-rank --bf16 --strategies --runtime-only --plan-only");
  }
  if (o.out.empty() && !o.plan_only) throw UserError("error: --out is required.");
  if (!o.runtime_only && (o.name.empty() || o.config.empty() || o.seq <= 0 || o.batch <= 0))
    throw UserError("error: --name, --config, a positive --seq and --batch are required.");
  if (o.sp < 0) throw UserError("error: --sp " + std::to_string(o.sp) + "\nlegal: the number of ranks the sequence is split over, >= 1.");
  if (o.schedule != "autosp" && (o.ranks > 0 || o.memory_per_rank > 0 || !o.bf16.empty() || !o.strategies.empty()))
    throw UserError("error: --ranks, --memory-per-rank, --bf16 and --strategies are what --schedule autosp searches "
                    "with, and the schedule is \"" + o.schedule + "\".\nfix: --schedule autosp, or drop them (a "
                    "schedule file states its own mesh and precision).");
  return o;
}

Halide::Target parse_target(const std::string& s) {
  if (!Halide::Target::validate_target_string(s))
    throw UserError("error: \"" + s + "\" is not a Halide target.\nlegal: e.g. host, x86-64-linux-avx2, "
                    "host-cuda-cuda_capability_80 (always spell the CUDA capability).");
  if (s.find("cuda") != std::string::npos && s.find("cuda_capability") == std::string::npos)
    throw UserError("error: target \"" + s + "\" names cuda without a capability; on a machine without a GPU "
                    "Halide would silently emit sm_20 code.\nlegal: add one, e.g. -cuda_capability_80 (runs on Hopper through PTX JIT).");
  return Halide::Target(s);
}

std::string cpp_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') { out += "\\n"; continue; }
    out += c;
  }
  return out + "\"";
}

std::string label(const Graph& g, int node, const std::vector<int>& also = {}) {
  const Node& n = g.node(node);
  std::string s = std::string(op_name(n.op)) + " %" + std::to_string(node);
  for (int x : also) s += " + " + std::string(op_name(g.node(x).op)) + " %" + std::to_string(x);
  if (!n.name.empty()) s += " " + n.name;
  return s + (n.backward ? " (backward)" : "");
}

const char* call_kind(Op op) {
  switch (op) {
    case Op::SeqToHeads: return "CallKind::SeqToHeads";
    case Op::HeadsToSeq: return "CallKind::HeadsToSeq";
    case Op::GatherSeq: return "CallKind::GatherSeq";
    case Op::AllReduce: return "CallKind::AllReduce";
    case Op::ConcatSeq: return "CallKind::ConcatSeq";
    case Op::RingShift: return "CallKind::RingShift";
    default: return "CallKind::Kernel";
  }
}

const char* elem(DType t) {
  switch (t) {
    case DType::f64: return "ElemType::F64";
    case DType::i32: return "ElemType::I32";
    case DType::bf16: return "ElemType::BF16";
    default: return "ElemType::F32";
  }
}

void emit_program(std::ostream& os, const Graph& g, const Partition& p, const Program& prog,
                  const std::string& name, const std::string& tag) {
  os << "const BufferSpec " << tag << "_buffers[] = {\n";
  for (const PlannedBuffer& b : prog.buffers) {
    const Node& n = g.node(b.node);
    os << "  {" << cpp_string(n.name.empty() ? std::string(op_name(n.op)) + " %" + std::to_string(b.node) : n.name)
       << ", " << elem(n.type.dtype) << ", " << n.type.rank() << ", {";
    for (int d = 0; d < n.type.rank(); ++d) os << (d ? ", " : "") << n.type.axes[static_cast<size_t>(d)].size;
    const char* kind = b.kind == BufferKind::Input ? "Input" : b.kind == BufferKind::Param ? "Param"
                       : b.kind == BufferKind::Grad ? "Grad" : b.kind == BufferKind::View ? "View" : "Arena";
    os << "}, Storage::" << kind << ", " << b.index << ", " << b.offset << ", " << b.dim;
    if (b.host_offset >= 0) os << ", " << b.host_offset;
    os << "},\n";
  }
  os << "};\nconst int " << tag << "_args[] = {";
  for (const PlannedCall& c : prog.calls)
    for (int a : c.args) os << a << ", ";
  os << "};\nconst CallSpec " << tag << "_calls[] = {\n";
  size_t off = 0;
  for (const PlannedCall& c : prog.calls) {
    if (c.move != PlannedCall::Move::None) {
      const bool out = c.move == PlannedCall::Move::Evict;
      const int node = prog.buffers[static_cast<size_t>(c.args[0])].node;
      const Node& n = g.node(node);
      os << "  {nullptr, " << (out ? "\"offload\", " : "\"reload\", ")
         << cpp_string(n.name.empty() ? std::string(op_name(n.op)) + " %" + std::to_string(node) : n.name) << ", 1, "
         << tag << "_args + " << off << ", " << (out ? "CallKind::Offload" : "CallKind::Reload") << ", nullptr, 0},\n";
      off += c.args.size();
      continue;
    }
    const Stage& st = p.stages[static_cast<size_t>(c.stage)];
    const Op op = g.node(st.root).op;
    if (is_runtime_op(op)) {
      os << "  {nullptr, " << cpp_string(op_name(op)) << ", ";
    } else {
      std::string fn = name + "_k" + std::to_string(st.kernel);
      os << "  {&" << fn << "_argv, " << cpp_string(fn) << ", ";
    }
    const Node& root = g.node(st.root);
    os << cpp_string(label(g, st.root, st.extra_outputs)) << ", " << c.args.size() << ", " << tag << "_args + " << off << ", "
       << (c.wait ? "CallKind::Wait" : call_kind(op)) << ", " << (is_collective(op) ? cpp_string(root.attrs.mesh_axis) : std::string("nullptr")) << ", "
       << (op == Op::RingShift ? root.attrs.offset : 0) << "},\n";
    off += c.args.size();
  }
  if (prog.reduce_grads)
    os << "  {nullptr, \"all_reduce_grads\", \"every parameter gradient, summed over the mesh\", 0, " << tag
       << "_args, CallKind::AllReduceGrads, " << cpp_string(kWholeMesh) << ", 0},\n";
  os << "};\n";
}

// A Halide buffer steps each dimension by a 32-bit stride (halide_dimension_t),
// whatever the target: an axis of more than one element whose stride does
// not fit is refused before anything is compiled. (An axis of one element is
// never stepped; the runtime gives it any stride.)
void check_strides(const Node& n) {
  int64_t stride = 1;
  for (auto it = n.type.axes.rbegin(); it != n.type.axes.rend(); ++it) {
    if (it->size > 1 && (stride > kMax32Bit || it->size > kMax32Bit))
      throw UserError("error: tensor \"" + n.name + "\" " + n.type.str() + ": its \"" + it->name + "\" axis (" +
                      std::to_string(it->size) + ") is stepped " + std::to_string(stride) +
                      " elements at a time; a Halide buffer's strides and extents hold at most " +
                      std::to_string(kMax32Bit) +
                      ".\nfix: train one row per rank (batch 1), or split the sequence over more ranks (SP), so "
                      "that each rank's rows hold fewer elements.");
    stride *= it->size;
  }
}

// `ld -r`: the objects as one relocatable object, each keeping its local
// symbols; the parts are removed once linked.
void link_relocatable(const std::vector<std::string>& parts, const std::string& out) {
  std::vector<std::string> args = {"ld", "-r", "-o", out};
  args.insert(args.end(), parts.begin(), parts.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int status = 0;
  if (posix_spawnp(&pid, "ld", nullptr, nullptr, argv.data(), environ) != 0 || waitpid(pid, &status, 0) != pid ||
      !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw UserError("error: linking the GPU kernels into \"" + out + "\" with `ld -r` failed" +
                    (pid ? "" : " (no ld on PATH)") + ".\nfix: install binutils (Debian: apt-get install binutils).");
  for (const std::string& p : parts) std::remove(p.c_str());
}

int run(const Options& o, const ModelBuilder& build) {
  Halide::Target target = parse_target(o.target).with_feature(Halide::Target::NoRuntime);
  if (o.runtime_only) {
    Halide::compile_standalone_runtime(o.out, target.without_feature(Halide::Target::NoRuntime));
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const Cluster cluster = Cluster::named(o.cluster);
  nlohmann::ordered_json why;  // SCHEDULE autosp's reasons, kept in the plan JSON
  Schedule sched = o.schedule == "autosp" ? choose(o, build, cluster, why) : Schedule::named(o.schedule);
  // The mesh is the schedule's; --sp (halyard_add_model's SP) may set it.
  if (o.sp > 0 && sched.mesh.sp > 1 && o.sp != sched.mesh.sp)
    throw UserError("error: --sp " + std::to_string(o.sp) + " but schedule \"" + sched.name + "\" says mesh sp=" +
                    std::to_string(sched.mesh.sp) + ".\nfix: drop SP from halyard_add_model, or make them agree.");
  if (o.sp > 0) sched.mesh.sp = o.sp;
  const bool gpu = parse_target(o.target).has_gpu_feature(), cuda = parse_target(o.target).has_feature(Halide::Target::CUDA);
  if (!gpu && cluster.gpu())
    throw UserError("error: target \"" + o.target + "\" is a CPU, but cluster \"" + cluster.name +
                    "\" is one of GPUs (device \"" + cluster.device + "\"): the plan would count GPU kernels and GPU memory that "
                    "this library does not have.\nfix: build for a GPU target (host-cuda-cuda_capability_80, "
                    "host-opencl), or plan on CPU ranks (local-cpu, or a profile written by halyard-calibrate).");
  if (!cuda && sched.contract_kernel == "cublas")
    throw UserError("error: schedule \"" + sched.name + "\" says contract_kernel \"cublas\", but target \"" + o.target +
                    "\" has no CUDA.\nlegal: \"auto\" or \"halide\" here (\"cublas\" needs a CUDA target).");
  if (gpu) sched = sched.on_gpu(cuda);
  if (!gpu && sched.offloads())
    throw UserError("error: schedule \"" + sched.name + "\" offloads values to host memory (keep \"offload\"), but target \"" +
                    o.target + "\" is a CPU: its memory is host memory already.\nfix: keep \"save\" or \"recompute\" "
                    "for CPU targets; offloading needs a GPU target (host-cuda, host-opencl).");
  Plan p = plan(build, {o.config, o.batch, o.seq}, sched, cluster);
  if (!o.schedule_out.empty()) {  // the schedule built, as a file a user can pin and edit
    std::ofstream out(o.schedule_out);
    out << sched.to_json() << "\n";
    if (!out) throw UserError("error: cannot write the schedule to \"" + o.schedule_out + "\".");
  }
  for (const Value& v : p.model.params)
    if (v.type().dtype != DType::f32)
      throw UserError("error: parameter \"" + v.node().name + "\" " + v.type().str() +
                      "\ngenerated libraries train f32 parameters.\nlegal: build the model in f32.");
  const int64_t sp = sched.mesh.sp, local = p.local_seq;
  BuiltModel& m = p.model;
  Graph& g = *m.graph;
  Partition& train = p.train;
  Partition& fwd = p.forward;
  const Program& train_prog = p.train_program;
  const Program& fwd_prog = p.forward_program;
  if (!o.plan_json.empty()) {
    std::ofstream pj(o.plan_json);
    auto plan_json = nlohmann::ordered_json::parse(p.to_json());
    if (!why.is_null()) plan_json["autosp"] = why;
    pj << plan_json.dump() << "\n";
    if (!pj) throw UserError("error: cannot write the plan to \"" + o.plan_json + "\".");
  }

  // One kernel per distinct stage signature over both programs.
  std::map<std::string, int> kernel_of;
  std::vector<const Stage*> kernels;
  for (Partition* part : {&train, &fwd})
    for (Stage& st : part->stages) {
      if (is_runtime_op(g.node(st.root).op)) continue;
      auto [it, fresh] = kernel_of.emplace(st.signature, static_cast<int>(kernels.size()));
      if (fresh) kernels.push_back(&st);
      st.kernel = it->second;
    }
  if (gpu)
    for (const Stage* st : kernels)
      if (const int big = gpu_index_overflow(g, *st); big >= 0)
        throw UserError("error: kernel " + label(g, st->root, st->extra_outputs) + " (" + g.node(st->root).name +
                        ") holds tensor \"" + g.node(big).name + "\" " + g.node(big).type.str() + ", " +
                        std::to_string(g.node(big).type.numel()) + " elements: Halide's GPU kernels index in 32 bits, "
                        "up to " + std::to_string(kMax32Bit) + ".\nfix: tile the loss and the MLP over the sequence "
                        "(\"loss_seq_tile\", \"seq_tile\" in the schedule) so that each tile holds fewer, or split the "
                        "sequence over more ranks (SP).");
  // A kernel over a value of 2^31 bytes or more needs 64-bit addressing;
  // linked modules share one target, so then the whole library has it.
  if (std::any_of(kernels.begin(), kernels.end(), [](const Stage* st) { return st->large_buffers; }))
    target = target.with_feature(Halide::Target::LargeBuffers);
  std::printf("halyard_aot %s: %s; %d nodes, %zu stages (train), %zu (forward), %zu kernels; arena %.2f MiB (train), %.2f MiB (forward)\n",
              o.name.c_str(), sched.str().c_str(), g.size(), train.stages.size(), fwd.stages.size(), kernels.size(),
              static_cast<double>(train_prog.arena_bytes) / (1 << 20), static_cast<double>(fwd_prog.arena_bytes) / (1 << 20));

  if (o.plan_only) {
    std::printf("%s", p.report().c_str());
    std::printf("halyard_aot %s: mesh sp=%lld, %lld tokens per row on each rank; plan only, nothing compiled (%.0f ms)\n",
                o.name.c_str(), static_cast<long long>(sp), static_cast<long long>(local),
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  for (const Program* prog : {&train_prog, &fwd_prog})
    for (const PlannedBuffer& b : prog->buffers) check_strides(g.node(b.node));
  if (!sched.autoscheduler.empty()) {
    const std::string lib = o.plugin_dir + "/libautoschedule_" + [&] {
      std::string s = sched.autoscheduler;
      for (char& c : s) c = static_cast<char>(std::tolower(c));
      return s;
    }() + ".so";
    Halide::load_plugin(lib);
  }
  std::vector<Halide::Module> modules;
  for (size_t k = 0; k < kernels.size(); ++k) {
    const Stage& st = *kernels[k];
    const auto k0 = std::chrono::steady_clock::now();
    const bool autoschedule = !sched.autoscheduler.empty() && !target.has_gpu_feature();
    LoweredStage ls = lower_stage(g, st, autoschedule, sched.kernel_tiles, target.natural_vector_size(Halide::Float(32)),
                                  cuda ? Halide::DeviceAPI::CUDA : Halide::DeviceAPI::Host, target.has_gpu_feature());
    set_estimates(ls, g, st);
    if (autoschedule) {
      Halide::AutoschedulerParams params(sched.autoscheduler, {{"parallelism", "2"},
                                                               {"beam_size", std::to_string(sched.autoscheduler_beam_size)}});
      ls.pipeline.apply_autoscheduler(target, params);
    } else if (target.has_gpu_feature()) {
      schedule_gpu(ls, g, st, target);
    } else {
      schedule_cpu(ls, g, st, target, sched.kernel_tiles);
    }
    const std::string fn = o.name + "_k" + std::to_string(k);
    modules.push_back(ls.pipeline.compile_to_module(ls.args, fn, target));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - k0).count();
    std::printf("  %-16s %5.2fs  %s\n", fn.c_str(), secs, label(g, st.root, st.extra_outputs).c_str());
    if (std::getenv("HALYARD_AOT_VERBOSE")) std::printf("      %s\n", st.signature.c_str());
  }
  const std::string kernels_o = o.out + "/" + o.name + "_kernels.o";
  if (!target.has_gpu_feature()) {
    Halide::link_modules(o.name + "_kernels", modules).compile({{Halide::OutputFileType::object, kernels_o}});
  } else {
    // Halide 21's link_modules gives every GPU module of the link one device
    // state and one kernel source (the first call that runs wins, and every
    // other kernel is missing from its program: CL_INVALID_KERNEL_NAME, seen
    // on the OpenCL target, and the same relocations on CUDA). So each GPU
    // kernel is its own object, and `ld -r` makes them one.
    // The optimizer's kernels too: a GPU library's parameters are updated
    // where they live (Model::adamw_step).
    modules.push_back(adamw_module(target, o.name + "_adamw"));
    modules.push_back(grad_sumsq_module(target, o.name + "_grad_sumsq"));
    std::vector<std::string> parts;
    for (size_t k = 0; k < modules.size(); ++k) {
      parts.push_back(o.out + "/" + modules[k].name() + ".o");
      try {
        modules[k].compile({{Halide::OutputFileType::object, parts.back()}});
      } catch (const Halide::CompileError& e) {
        throw Halide::CompileError(modules[k].name() + ": " + e.what());
      }
    }
    link_relocatable(parts, kernels_o);
  }

  // The header and the program tables.
  const std::string guard = "HALYARD_MODEL_" + o.name + "_H";
  std::ofstream h(o.out + "/" + o.name + ".h");
  h << "// " << o.name << ": generated by halyard_aot; do not edit.\n"
    << "// batch " << o.batch << ", seq " << o.seq << ", target " << target.to_string() << "\n"
    << "// mesh sp=" << sp << ": " << local << " tokens per row on each rank"
    << (padded_seq(o.seq, sp) != o.seq ? " (seq padded to " + std::to_string(padded_seq(o.seq, sp)) + ")" : std::string())
    << "\n"
    << "// " << sched.str() << "\n"
    << "// plan on " << p.cluster.name << ": predicted peak " << p.memory.total() << " bytes per rank, step "
    << p.step_s << " s\n"
    << "// activation arena: " << train_prog.arena_bytes << " bytes (train step), " << fwd_prog.arena_bytes
    << " bytes (forward)\n"
    << "#pragma once\n#include \"runtime/model.h\"\n\nnamespace halyard_models {\n"
    << "// The model's kernels and step programs; run them with halyard::runtime::Model.\n"
    << "const halyard::runtime::ModelSpec& " << o.name << "();\n"
    << "constexpr int64_t " << o.name << "_batch = " << o.batch << ";\n"
    << "constexpr int64_t " << o.name << "_seq = " << o.seq << ";\n"
    << "constexpr int " << o.name << "_sp = " << sp << ";  // ranks the sequence is split over\n"
    << "constexpr int64_t " << o.name << "_local_seq = " << local << ";  // tokens per row on each rank\n"
    << "constexpr int64_t " << o.name << "_arena_bytes = " << std::max(train_prog.arena_bytes, fwd_prog.arena_bytes) << ";\n"
    << "}  // namespace halyard_models\n";

  std::ofstream c(o.out + "/" + o.name + "_program.cpp");
  c << "// " << o.name << ": generated by halyard_aot; do not edit.\n#include \"" << o.name << ".h\"\n\n";
  for (size_t k = 0; k < kernels.size(); ++k) c << "extern \"C\" int " << o.name << "_k" << k << "_argv(void**);\n";
  const bool optimizer = target.has_gpu_feature();  // its kernels (above)
  if (optimizer)
    c << "extern \"C\" int " << o.name << "_adamw_argv(void**);\nextern \"C\" int " << o.name << "_grad_sumsq_argv(void**);\n";
  c << "\nnamespace {\nusing namespace halyard::runtime;\n\nconst ParamSpec params[] = {\n";
  for (const Value& p : m.params) {
    const auto& hf = m.hf_shapes.at(p.node().name);
    c << "  {" << cpp_string(p.node().name) << ", " << p.type().rank() << ", {";
    for (int d = 0; d < p.type().rank(); ++d) c << (d ? ", " : "") << p.type().axes[static_cast<size_t>(d)].size;
    c << "}, " << p.type().numel() << ", " << hf.size() << ", {" << hf[0] << ", " << (hf.size() > 1 ? hf[1] : 0) << "}},\n";
  }
  c << "};\n";
  emit_program(c, g, train, train_prog, o.name, "train");
  emit_program(c, g, fwd, fwd_prog, o.name, "forward");
  std::string summary = p.summary_json();
  int64_t ulysses_degree = 0;  // the runtime makes one pair of hybrid groups per step
  for (const AttentionRule& r : sched.attention) {
    if (r.strategy == "hybrid" && ulysses_degree > 0 && r.ulysses_degree != ulysses_degree)
      throw UserError("error: schedule \"" + sched.name + "\" gives attentions hybrid Ulysses degrees " +
                      std::to_string(ulysses_degree) + " and " + std::to_string(r.ulysses_degree) +
                      ".\nlegal: one ulysses_degree for every hybrid attention of a model.");
    if (r.strategy == "hybrid") ulysses_degree = r.ulysses_degree;
  }
  if (!why.is_null()) {  // llama_train prints why this plan, before step 1
    auto j = nlohmann::ordered_json::parse(summary);
    j["autosp"] = why;
    summary = j.dump();
  }
  c << "\nconst ModelSpec spec = {\n  " << cpp_string(o.name) << ",\n  " << cpp_string(m.config_json) << ",\n  "
    << cpp_string(sched.str()) << ",\n  " << cpp_string(target.to_string()) << ",\n  " << o.batch << ", " << o.seq
    << ", " << m.vocab << ", " << sp << ", " << local << ", " << m.ignore_index << ",\n  params, " << m.params.size() << ", " << kernels.size() << ",\n"
    << "  {train_buffers, " << train_prog.buffers.size() << ", train_calls, "
    << train_prog.calls.size() + (train_prog.reduce_grads ? 1 : 0) << ", "
    << train_prog.arena_bytes << ", " << train_prog.loss << ", " << train_prog.offload_bytes << "},\n"
    << "  {forward_buffers, " << fwd_prog.buffers.size() << ", forward_calls, " << fwd_prog.calls.size() << ", "
    << fwd_prog.arena_bytes << ", " << fwd_prog.loss << ", " << fwd_prog.offload_bytes << "},\n  " << cpp_string(summary) << ",\n  "
    << cpp_string(sched.sequence_layout) << ", " << ulysses_degree << ",\n  "
    << (optimizer ? "&" + o.name + "_adamw_argv, &" + o.name + "_grad_sumsq_argv" : std::string("nullptr, nullptr"))
    << ",\n};\n}  // namespace\n\n"
    << "const halyard::runtime::ModelSpec& halyard_models::" << o.name << "() { return spec; }\n";
  std::printf("halyard_aot %s: done in %.1fs\n", o.name.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

}  // namespace

int aot_main(int argc, char** argv, const ModelBuilder& build) {
  try {
    return run(parse(argc, argv), build);
  } catch (const UserError& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const Halide::CompileError& e) {
    std::cerr << "error: Halide rejected a kernel: " << e.what() << "\n(this is a bug in Halyard's lowering)\n";
    return 3;
  } catch (const Halide::Error& e) {
    std::cerr << "error: Halide: " << e.what() << "\n";
    return 3;
  }
}

}  // namespace halyard

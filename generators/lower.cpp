// The algorithm of a stage in Halide (see lowering.h). Forward and backward
// of each op side by side; Halide dims are the DSL axes reversed.
#include <cmath>
#include <functional>

#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/op_table.h"
#include "generators/bf16.h"
#include "generators/lowering.h"
#include "runtime/attention_cuda_args.h"

namespace halyard {

using namespace Halide;

Type halide_type(DType t) {
  switch (t) {
    case DType::f32: return Float(32);
    case DType::f64: return Float(64);
    case DType::bf16: return Float(32);
    case DType::i32: return Int(32);
  }
  return Float(32);
}

Type halide_storage_type(DType t) { return t == DType::bf16 ? UInt(16) : halide_type(t); }

std::map<int, std::function<Expr(const std::vector<Expr>&)>>& pointwise_lowerings() {
  static std::map<int, std::function<Expr(const std::vector<Expr>&)>> m;
  return m;
}

namespace {
std::map<std::string, JITExtern>& library_jit_externs() {
  static std::map<std::string, JITExtern> m;
  return m;
}
}  // namespace

void set_library_jit_externs(std::map<std::string, JITExtern> externs) { library_jit_externs() = std::move(externs); }

void register_pointwise_lowering(Op op, std::function<Expr(const std::vector<Expr>&)> element) {
  pointwise_lowerings()[static_cast<int>(op)] = std::move(element);
}

namespace {

using Env = std::map<std::string, Expr>;

// A float constant of type T (f32 or f64), exactly as double rounds to T.
Expr num(Type T, double v) { return Internal::FloatImm::make(T, v); }

std::vector<std::string> without(const std::vector<std::string>& names, const std::string& drop) {
  std::vector<std::string> r;
  for (const auto& n : names)
    if (n != drop) r.push_back(n);
  return r;
}

struct Ctx {
  const Graph& g;
  const Stage& st;
  LoweredStage& ls;
  bool for_autoscheduler;
  const KernelTiles& tiles;
  int panel;  // floats in a vector of the target: B's panels (ContractLayout)
  DeviceAPI library_device;  // where the runtime's GEMM and library attention read and write
  bool gpu;               // for schedule_gpu
  std::map<int, Func> funcs;
  std::map<std::string, Var> var_of;

  const TensorType& type(int id) const { return g.node(id).type; }
  Var var(const std::string& axis) {
    auto it = var_of.find(axis);
    if (it == var_of.end()) it = var_of.emplace(axis, Var(axis)).first;
    return it->second;
  }
  // Halide arguments for a row-major axis list: innermost first.
  std::vector<Var> vars(const std::vector<std::string>& axes) {
    std::vector<Var> v;
    for (auto it = axes.rbegin(); it != axes.rend(); ++it) v.push_back(var(*it));
    return v;
  }
  static std::vector<Expr> args(const std::vector<std::string>& axes, const Env& env) {
    std::vector<Expr> a;
    for (auto it = axes.rbegin(); it != axes.rend(); ++it) {
      auto e = env.find(*it);
      HALYARD_CHECK(e != env.end(), "no index for axis " << *it);
      a.push_back(e->second);
    }
    return a;
  }
  Env env(const std::vector<std::string>& axes) {
    Env e;
    for (const auto& a : axes) e[a] = var(a);
    return e;
  }
  Expr at(int id, const Env& e) { return get(id)(args(type(id).axis_names(), e)); }
  Expr call(Func f, const std::vector<std::string>& axes, const Env& e) { return f(args(axes, e)); }

  // A copy of value `id` as its own Func (to be computed once, not per use).
  Func copy(int id, const std::string& name, const std::vector<std::string>& order) {
    Func f(name);
    f(vars(order)) = at(id, env(order));
    return f;
  }

  Func get(int id);
  Func lower(int id);
  ExternFuncArgument buffer(int id, const std::string& name, bool bits16 = false);
  void library_attention(int id, Func out);
  void library_weight_grad(int id, Func out);
  void device_gemm(int id, Func out);
  Func norm_scale(int x, const std::string& axis, double eps, const std::string& tag);
  void attention(int id, Func out);
};

Func Ctx::get(int id) {
  if (auto it = funcs.find(id); it != funcs.end()) return it->second;
  Func f;
  if (id != st.root && std::find(st.inputs.begin(), st.inputs.end(), id) != st.inputs.end()) {
    size_t k = static_cast<size_t>(std::find(st.inputs.begin(), st.inputs.end(), id) - st.inputs.begin());
    ImageParam ip = ls.inputs[k];
    f = Func("in" + std::to_string(k) + "_f");
    auto names = type(id).axis_names();
    f(vars(names)) = type(id).dtype == DType::bf16 ? bf16_decode(ip(vars(names))) : ip(vars(names));
  } else {
    f = lower(id);
  }
  funcs[id] = f;
  return f;
}

// rr(other axes) = 1 / sqrt(mean over `axis` of x^2 + eps)
Func Ctx::norm_scale(int x, const std::string& axis, double eps, const std::string& tag) {
  const TensorType& xt = type(x);
  auto other = without(xt.axis_names(), axis);
  const Type T = halide_type(xt.dtype);
  RDom r(0, static_cast<int>(xt.size(axis)), "r_norm" + tag);
  Env e = env(other);
  e[axis] = r.x;
  Func ss("sumsq" + tag), rr("rscale" + tag);
  ss(vars(other)) = cast(T, 0);
  Expr xv = at(x, e);
  ss(vars(other)) += xv * xv;
  rr(vars(other)) = 1 / sqrt(ss(vars(other)) / num(T, static_cast<double>(xt.size(axis))) + num(T, eps));
  ls.funcs.small.push_back(ss);
  ls.funcs.small.push_back(rr);
  return rr;
}

Func Ctx::lower(int id) {
  const Node& n = g.node(id);
  const bool is_root = id == st.root;
  const std::string tag = "_" + std::to_string(id);
  Func f(is_root ? std::string("out") : std::string(op_name(n.op)) + tag);
  const auto names = n.type.axis_names();
  const std::vector<Var> vs = vars(names);
  const Env e = env(names);
  const Type T = halide_type(n.type.dtype);
  auto in = [&](size_t k) { return n.inputs[k]; };

  if (is_registered_op(n.op)) {  // an op added through the op table: its element from its operands' elements
    const auto it = pointwise_lowerings().find(static_cast<int>(n.op));
    if (it == pointwise_lowerings().end())
      throw UserError("error: " + describe(g, id) + " is op \"" + op_name(n.op) +
                      "\", which has no lowering.\nlegal: register one with register_pointwise_lowering().");
    std::vector<Expr> args;
    for (size_t k = 0; k < n.inputs.size(); ++k) args.push_back(at(in(k), e));
    f(vs) = cast(T, it->second(args));
    return f;
  }
  switch (n.op) {
    case Op::Input:
    case Op::Param:
      internal_error(__FILE__, __LINE__, "buffers are stage inputs, never lowered");
    case Op::SeqToHeads:
    case Op::HeadsToSeq:
    case Op::GatherSeq:
    case Op::AllReduce:
    case Op::RingShift:
    case Op::ConcatSeq:
      internal_error(__FILE__, __LINE__, "collectives and concatenation are the runtime's, never lowered");
    case Op::LseMerge: {  // log sum_j exp(l_j), by the largest
      Expr mx = at(in(0), e);
      for (size_t k = 1; k < n.inputs.size(); ++k) mx = max(mx, at(in(k), e));
      Expr sum = cast(T, 0);
      for (size_t k = 0; k < n.inputs.size(); ++k) sum += exp(at(in(k), e) - mx);
      f(vs) = mx + log(sum);
      break;
    }
    case Op::AttentionMerge: {  // sum_j exp(l_j - L) o_j (the key blocks' k, v are the backward's)
      Expr L = at(in(kMergeLse), e), acc = cast(T, 0);
      for (size_t blk = kMergeBlocks; blk < n.inputs.size(); blk += kMergeBlockOperands)
        acc += exp(at(in(blk + 4), e) - L) * at(in(blk + 3), e);
      f(vs) = acc;
      break;
    }
    case Op::SliceSeq: {  // a view: seq shifted by the tile's start
      Env es = e;
      es["seq"] = e.at("seq") + static_cast<int>(n.attrs.offset);
      f(vs) = at(in(0), es);
      break;
    }
    case Op::PadSeq: {  // the tile in place, zeros around it (the load is clamped: never out of bounds)
      const int off = static_cast<int>(n.attrs.offset), len = static_cast<int>(type(in(0)).size("seq"));
      Env es = e;
      Expr s = e.at("seq");
      es["seq"] = clamp(s - off, 0, len - 1);
      Expr v = at(in(0), es);
      f(vs) = select(s >= off && s < off + len, v, Internal::make_zero(v.type()));
      break;
    }
    case Op::Fill:
      f(vs) = T.is_float() ? num(T, n.attrs.value) : cast(T, static_cast<int>(n.attrs.value));
      break;
    case Op::Add:
      f(vs) = at(in(0), e) + at(in(1), e);
      break;
    case Op::Mul:
      f(vs) = at(in(0), e) * at(in(1), e);
      break;
    case Op::BiasAdd:  // the bias is indexed by its own axes of x's index: it repeats over the others
      f(vs) = at(in(0), e) + at(in(1), e);
      break;
    case Op::BiasAddGrad: {  // db[bias axes] = sum of dy over its other axes (the tokens)
      const TensorType& yt = type(in(0));
      std::vector<std::string> other;
      for (const Axis& a : yt.axes)
        if (!n.type.has(a.name)) other.push_back(a.name);
      Region region;
      for (auto it = other.rbegin(); it != other.rend(); ++it) region.push_back({0, static_cast<int>(yt.size(*it))});
      RDom r(region, "r_bias" + tag);
      Env er = e;
      for (size_t k = 0; k < other.size(); ++k) er[other[other.size() - 1 - k]] = r[static_cast<int>(k)];
      f(vs) = cast(T, 0);
      f(vs) += at(in(0), er);
      break;
    }
    case Op::Silu: {  // x * sigmoid(x)
      Expr x = at(in(0), e);
      f(vs) = x / (1 + exp(-x));
      break;
    }
    // A stage's bf16 output is its 16 bits; inside a stage (and read from a
    // bf16 input buffer, get()) a bf16 value is the f32 it rounds to.
    case Op::StoreBf16: {
      Expr bits = bf16_encode(at(in(0), e));
      f(vs) = is_root ? bits : bf16_decode(bits);
      break;
    }
    case Op::LoadBf16:
      f(vs) = at(in(0), e);
      break;
    case Op::SiluGrad: {  // dy * s * (1 + x (1 - s))
      Expr x = at(in(0), e), s = 1 / (1 + exp(-x));
      f(vs) = at(in(1), e) * s * (1 + x * (1 - s));
      break;
    }
    case Op::Embedding: {  // out[ids.., X] = table[id, X]; ids are validated by the runtime
      const TensorType& table = type(in(0));
      const std::string X = table.axes[1].name;
      Env te;
      te["vocab"] = clamp(at(in(1), e), 0, static_cast<int>(table.axes[0].size) - 1);
      te[X] = var(X);
      f(vs) = at(in(0), te);
      break;
    }
    case Op::EmbeddingGrad: {  // dtable[vocab, X] = scatter-add of dy rows at ids
      const TensorType& ids = type(in(1));
      const std::string X = n.type.axes[1].name;
      Region region;
      auto ids_names = ids.axis_names();
      for (auto it = ids_names.rbegin(); it != ids_names.rend(); ++it)
        region.push_back({0, static_cast<int>(ids.size(*it))});
      RDom r(region, "r_scatter");
      Env er;
      for (size_t k = 0; k < ids_names.size(); ++k) er[ids_names[ids_names.size() - 1 - k]] = r[static_cast<int>(k)];
      Expr v = clamp(at(in(1), er), 0, static_cast<int>(n.type.axes[0].size) - 1);
      Env ed = er;
      ed[X] = var(X);
      f(vs) = cast(T, 0);
      f(var(X), v) += at(in(0), ed);
      break;
    }
    case Op::Contract: {
      if (st.library && is_root) {
        library_weight_grad(id, f);
        break;
      }
      if (st.gemm && is_root) {
        device_gemm(id, f);
        break;
      }
      const TensorType& ta = type(in(0));
      std::vector<std::string> summed;  // innermost first
      for (auto it = ta.axes.rbegin(); it != ta.axes.rend(); ++it)
        if (!n.type.has(it->name)) summed.push_back(it->name);
      // Operands (schedules/partition.h, contract_layout): the one holding the
      // innermost output axis is read as vectors along it, from a copy where
      // the layout says so.
      const std::string inner = n.type.rank() ? n.type.axes.back().name : "";
      const ContractLayout L = contract_layout(g, n, st.inputs);
      const int bop = L.b;
      std::map<int, std::pair<Func, std::vector<std::string>>> staged;
      Func panels;  // B in panels of one vector: bp(col % panel, summed..., col / panel, other kept...)
      std::vector<std::string> summed_b, kept_b;  // row-major
      if (is_root && !inner.empty()) {
        const int aop = 1 - bop;
        if (L.b_panels && !for_autoscheduler) {  // (the autoscheduler gets a plain copy: same bytes)
          for (const auto& ax : L.b_order)
            (n.type.has(ax) ? kept_b : summed_b).push_back(ax);
          kept_b.erase(std::find(kept_b.begin(), kept_b.end(), inner));
          Var ci(inner + "_pi"), co(inner + "_po");
          std::vector<Var> pv = {ci};
          for (const Var& v : vars(summed_b)) pv.push_back(v);
          pv.push_back(co);
          for (const Var& v : vars(kept_b)) pv.push_back(v);
          Env eb = env(L.b_order);
          eb[inner] = co * panel + ci;
          panels = Func("bp" + tag);
          panels(pv) = at(in(static_cast<size_t>(bop)), eb);
          ls.funcs.root_copies.push_back(panels);
        } else if (L.b_copied) {
          Func bt = copy(in(static_cast<size_t>(bop)), "bt" + tag, L.b_order);
          ls.funcs.root_copies.push_back(bt);
          staged[bop] = {bt, L.b_order};
        }
        if (L.a_staged) {
          auto order = type(in(static_cast<size_t>(aop))).axis_names();
          Func as = copy(in(static_cast<size_t>(aop)), "as" + tag, order);
          ls.funcs.staged.push_back(as);
          staged[aop] = {as, order};
        }
        ls.funcs.is_contract = true;
        ls.funcs.contract_b_operand = bop;
      }
      auto operand = [&](int k, const Env& ev) -> Expr {
        if (auto it = staged.find(k); it != staged.end()) return call(it->second.first, it->second.second, ev);
        return at(in(static_cast<size_t>(k)), ev);
      };
      if (summed.empty()) {
        f(vs) = operand(0, e) * operand(1, e);
        break;
      }
      Region region;
      for (const auto& s : summed) region.push_back({0, static_cast<int>(ta.size(s))});
      RDom r(region, "r" + tag);
      Env er = e;
      for (size_t k = 0; k < summed.size(); ++k) er[summed[k]] = r[static_cast<int>(k)];
      // The sum runs in its own Func so a schedule can keep a tile of it in
      // registers across the whole reduction (the output is written once).
      if (for_autoscheduler) {
        f(vs) = cast(T, 0);
        f(vs) += operand(0, er) * operand(1, er);
        break;
      }
      Func acc("acc" + tag);
      if (panels.defined()) {
        // The sum over B's panels: acc(col % panel, rows..., col / panel), so
        // that the kernel indexes the panels with its own loops.
        Var pci(inner + "_vi"), pco(inner + "_vo");
        std::vector<Var> av = {pci};
        av.insert(av.end(), vs.begin() + 1, vs.end());
        av.push_back(pco);
        std::vector<Expr> b_at = {pci};
        for (const Expr& x : args(summed_b, er)) b_at.push_back(x);
        b_at.push_back(pco);
        for (const Expr& x : args(kept_b, er)) b_at.push_back(x);
        acc(av) = cast(T, 0);
        acc(av) += operand(1 - bop, er) * panels(b_at);
        std::vector<Expr> out_at = {vs.front() % panel};
        out_at.insert(out_at.end(), vs.begin() + 1, vs.end());
        out_at.push_back(vs.front() / panel);
        f(vs) = acc(out_at);
        ls.funcs.contract_panel_vars = {pci, pco};
      } else {
        acc(vs) = cast(T, 0);
        acc(vs) += operand(0, er) * operand(1, er);
        f(vs) = acc(vs);
      }
      if (is_root) {
        ls.funcs.contract_rdom = r;
        ls.funcs.contract_acc = acc;
      }
      break;
    }
    case Op::RmsNorm: {  // x * rr * w
      const std::string axis = type(in(1)).axes[0].name;
      Func rr = norm_scale(in(0), axis, n.attrs.eps, tag);
      f(vs) = at(in(0), e) * rr(vars(without(names, axis))) * at(in(1), env({axis}));
      break;
    }
    case Op::RmsNormGradX: {  // rr w dy - x rr^3 / n * sum(w dy x)
      const std::string axis = type(in(1)).axes[0].name;
      const TensorType& xt = type(in(0));
      auto other = without(names, axis);
      Func rr = norm_scale(in(0), axis, n.attrs.eps, tag);
      RDom r(0, static_cast<int>(xt.size(axis)), "r_dot" + tag);
      Env er = env(other);
      er[axis] = r.x;
      Func dot("dot" + tag);
      dot(vars(other)) = cast(T, 0);
      dot(vars(other)) += at(in(1), er) * at(in(2), er) * at(in(0), er);
      ls.funcs.small.push_back(dot);
      Expr rv = rr(vars(other));
      f(vs) = rv * at(in(1), env({axis})) * at(in(2), e) -
              at(in(0), e) * rv * rv * rv / num(T, static_cast<double>(xt.size(axis))) * dot(vars(other));
      break;
    }
    case Op::RmsNormGradW: {  // dw[A] = sum over tokens of dy x rr
      const std::string axis = n.attrs.axis;
      const TensorType& xt = type(in(0));
      auto other = without(xt.axis_names(), axis);
      Func rr = norm_scale(in(0), axis, n.attrs.eps, tag);
      Region region;
      for (auto it = other.rbegin(); it != other.rend(); ++it) region.push_back({0, static_cast<int>(xt.size(*it))});
      RDom r(region, "r_tokens" + tag);
      Env er;
      er[axis] = var(axis);
      std::vector<Expr> rargs;
      for (size_t k = 0; k < other.size(); ++k) er[other[other.size() - 1 - k]] = r[static_cast<int>(k)];
      f(vs) = cast(T, 0);
      f(vs) += at(in(1), er) * at(in(0), er) * rr(args(other, er));
      break;
    }
    case Op::Rope: {  // x cos + rotate_half(x) sin at each token's position
      const TensorType& xt = type(in(0));
      const TensorType& pt = type(in(1));
      const int D = static_cast<int>(xt.size("head_dim")), half = D / 2;
      Buffer<double> inv(half, "inv_freq" + tag);
      {
        const RopeScaling& s = n.attrs.rope_scaling;
        for (int i = 0; i < half; ++i) {
          double v = 1.0 / std::pow(n.attrs.theta, 2.0 * i / D);
          if (s.factor > 0) {
            double wl = 2 * M_PI / v, low = s.original_max_position_embeddings / s.low_freq_factor,
                   high = s.original_max_position_embeddings / s.high_freq_factor;
            if (wl > low) {
              v /= s.factor;
            } else if (wl >= high) {
              double sm = (s.original_max_position_embeddings / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
              v = (1 - sm) * v / s.factor + sm * v;
            }
          }
          inv(i) = v;
        }
      }
      auto pnames = pt.axis_names();
      std::vector<std::string> tnames = pnames;
      tnames.push_back("head_dim");  // table over (positions' axes, frequency index)
      Var fi = var("head_dim");
      Expr angle = cast<double>(at(in(1), env(pnames))) * inv(fi);
      Func cs("rope_cos" + tag), sn("rope_sin" + tag);
      cs(vars(tnames)) = cast(T, cos(angle));
      sn(vars(tnames)) = cast(T, sin(angle) * Expr(n.attrs.inverse ? -1.0 : 1.0));
      ls.funcs.tables.push_back(cs);
      ls.funcs.tables.push_back(sn);
      Var d = var("head_dim");
      Env ef = e, ep = e;
      ef["head_dim"] = d % half;
      ep["head_dim"] = (d + half) % D;
      Expr sign = select(d < half, cast(T, -1), cast(T, 1));
      f(vs) = at(in(0), e) * call(cs, tnames, ef) + sign * at(in(0), ep) * call(sn, tnames, ef);
      break;
    }
    case Op::Attention:
    case Op::AttentionLse:
    case Op::AttentionGradQ:
    case Op::AttentionGradK:
    case Op::AttentionGradV:
      HALYARD_CHECK(is_root, "attention is never inlined");
      if (st.library) library_attention(id, f);
      else attention(id, f);
      break;
    case Op::TokenCount: {  // how many labels are real tokens
      const TensorType& lt = type(in(0));
      auto tok = lt.axis_names();
      Region region;
      for (auto it = tok.rbegin(); it != tok.rend(); ++it) region.push_back({0, static_cast<int>(lt.size(*it))});
      RDom rt(region, "r_tok" + tag);
      Env et;
      for (size_t k = 0; k < tok.size(); ++k) et[tok[tok.size() - 1 - k]] = rt[static_cast<int>(k)];
      f() = cast(T, 0);
      f() += select(at(in(0), et) != static_cast<int>(n.attrs.ignore_index), cast(T, 1), cast(T, 0));
      break;
    }
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad: {
      const TensorType& zt = type(in(0));
      auto tok = type(in(1)).axis_names();
      const int V = static_cast<int>(zt.axes.back().size);
      RDom rv(0, V, "r_vocab" + tag);
      Env ev = env(tok);
      ev["vocab"] = rv.x;
      Func mx("ce_max" + tag), se("ce_sumexp" + tag), lse("ce_lse" + tag);
      mx(vars(tok)) = num(T, -INFINITY);
      mx(vars(tok)) = max(mx(vars(tok)), at(in(0), ev));
      se(vars(tok)) = cast(T, 0);
      se(vars(tok)) += exp(at(in(0), ev) - mx(vars(tok)));
      lse(vars(tok)) = mx(vars(tok)) + log(se(vars(tok)));
      Region region;
      for (auto it = tok.rbegin(); it != tok.rend(); ++it) region.push_back({0, static_cast<int>(type(in(1)).size(*it))});
      RDom rt(region, "r_tok" + tag);
      Env et;
      for (size_t k = 0; k < tok.size(); ++k) et[tok[tok.size() - 1 - k]] = rt[static_cast<int>(k)];
      const int ignore = static_cast<int>(n.attrs.ignore_index);
      Expr lab_t = at(in(1), et);
      ls.funcs.small.insert(ls.funcs.small.end(), {mx, se, lse});
      Expr denom = max(at(in(2), Env{}), cast(T, 1));
      if (n.op == Op::CrossEntropy) {
        Func total("ce_total" + tag);
        Env ez = et;
        ez["vocab"] = clamp(lab_t, 0, V - 1);
        total() = cast(T, 0);
        total() += select(lab_t != ignore, lse(args(tok, et)) - at(in(0), ez), cast(T, 0));
        ls.funcs.small.push_back(total);
        f() = total() / denom;
      } else {  // (softmax - onehot) * dloss / count on real tokens
        Expr lab = at(in(1), e), z = at(in(0), e);
        Expr dl = at(in(3), Env{});
        Expr p = exp(z - lse(vars(tok))) - select(var("vocab") == lab, cast(T, 1), cast(T, 0));
        f(vs) = select(lab != ignore, p * dl / denom, cast(T, 0));
      }
      break;
    }
  }
  return f;
}

// Causal grouped-query attention, its row statistics and its three gradients,
// flash-style: scores exist only for one tile of queries (or keys) at a time,
// and every product of two matrices (q k^T, p v, dO v^T, ds k, ds^T q, p^T dO)
// is an accumulator Func that the schedule keeps in registers over the whole
// reduction. Tile sizes come from the schedule (schedule_cpu.cpp).
void Ctx::attention(int id, Func out) {
  const Node& n = g.node(id);
  const int qid = n.inputs[0], kid = n.inputs[1];
  const TensorType& qt = type(qid);
  const TensorType& kt = type(kid);
  const Type T = halide_type(qt.dtype);
  const int S = static_cast<int>(qt.size("seq")), H = static_cast<int>(qt.size("heads")),
            KV = static_cast<int>(kt.size("kv_heads")), D = static_cast<int>(qt.size("head_dim"));
  const int grp = H / KV;
  const Expr scale = num(T, 1.0 / std::sqrt(static_cast<double>(D)));
  const Expr lowest = num(T, kNoKeysLse);
  Var d("d"), h("h"), i("i"), j("j"), b("b"), gk("g");
  AttentionFuncs& A = ls.funcs.attn;
  A.kind = static_cast<int>(n.op);
  A.S = S;
  A.D = D;
  A.grp = grp;
  // Attrs::bf16: q, k, v, dO, the probabilities and dS rounded to bf16
  // before the products that read them (the sums stay f32).
  auto bf16_if = [&](Expr x) { return n.attrs.bf16 ? cast(T, bf16_decode(bf16_encode(cast<float>(x)))) : x; };
  // Operands that are inlined expressions (e.g. rope of a projection) are
  // computed once; a product's operand (not O) rounded as bf16_if says.
  auto operand = [&](int vid4, const std::string& heads_axis, const std::string& name, bool product = true) {
    Func f(name);
    Expr x = at(vid4, Env{{"head_dim", d}, {heads_axis, h}, {"seq", i}, {"batch", b}});
    f(d, h, i, b) = product ? bf16_if(x) : x;
    if (std::find(st.inputs.begin(), st.inputs.end(), vid4) == st.inputs.end()) ls.funcs.root_copies.push_back(f);
    return f;
  };
  // [d, seq] operands transposed to [seq, d], so products vectorize over keys.
  auto transposed = [&](Func x, const std::string& name) {
    Func t(name);
    t(j, d, gk, b) = x(d, gk, j, b);
    ls.funcs.root_copies.push_back(t);
    return t;
  };
  Func q = operand(qid, "heads", "q_s"), k = operand(kid, "kv_heads", "k_s");
  Func pos("pos_s");
  pos(i, b) = at(n.inputs[n.op == Op::AttentionLse ? 2 : 3], Env{{"seq", i}, {"batch", b}});
  Func kT = transposed(k, "kT");
  // Key j is visible to query i when qidx(i) - pos(i) <= kidx(j) <= qidx(i)
  // (dsl/ops.h), the indices being the tokens' places in the row: the seq
  // index itself, or a ring block's token_index operands. That is
  // 0 <= qidx - kidx <= pos, one unsigned comparison (positions are >= 0).
  const bool ring = is_ring_block(n);
  Expr visible;
  RDom rd(0, D, "rd"), rj(0, S, "rj");
  // Keys after the query are never visible: with this predicate Halide
  // trims those loops, halving the work. A ring block's visible keys are
  // likewise a prefix of it, of a length counted per query (none for a
  // block after the query's, all of one before it, half of each zigzag
  // chunk pair); the queries that see a key are a suffix. The mask keeps
  // the result exact, including the keys before a query's document (packed
  // rows): those loops are not trimmed from below, because a bound loaded
  // per query cost the unpacked rows about 10% (attention_bench, seq 4096).
  Func nvis("keys_visible"), first("first_query");
  // The rank's own block holds the queries' own tokens, in row order: keys
  // up to the query's seq index, as on one rank (an affine bound, which
  // trims the score tiles too; another rank's block is trimmed by a count).
  const bool own = ring && n.attrs.offset == 0;
  if (ring) {
    Func qidx("qidx_s"), kidx("kidx_s");
    kidx(i, b) = at(n.inputs[n.inputs.size() - 2], Env{{"seq", i}, {"batch", b}});
    qidx(i, b) = at(n.inputs.back(), Env{{"seq", i}, {"batch", b}});
    visible = cast<uint32_t>(qidx(i, b) - kidx(j, b)) <= cast<uint32_t>(pos(i, b));
    if (!own) {
      RDom rc(0, S, "r_count");
      nvis(i, b) = 0;
      nvis(i, b) += select(kidx(rc, b) <= qidx(i, b), 1, 0);
      first(j, b) = 0;
      first(j, b) += select(qidx(rc, b) < kidx(j, b), 1, 0);
      ls.funcs.small.push_back(nvis);
    }
  } else {
    visible = cast<uint32_t>(i - j) <= cast<uint32_t>(pos(i, b));
  }
  if (ring && !own) rj.where(rj < nvis(i, b));
  else rj.where(rj <= i);

  // scores[j, i, h] = q_i . k_j * scale
  auto scores = [&](const std::string& tag) {
    Func acc("s_acc" + tag), w("s" + tag);
    acc(j, i, h, b) = cast(T, 0);
    acc(j, i, h, b) += q(rd, h, i, b) * kT(j, rd, h / grp, b);
    w(j, i, h, b) = acc(j, i, h, b) * scale;
    return AttentionProduct{w, acc, j, i};
  };
  A.products.push_back(scores(""));
  Func s = A.products.back().wrapper;

  auto row_stats = [&]() {  // max and sum of exp over visible keys, per query row
    // Keys in blocks: the predicate on the block index lets Halide drop the
    // blocks after the query, while the loop inside a block stays a plain
    // vectorized reduction (the positional mask handles the diagonal block).
    const int block = S % 16 == 0 ? 16 : S % 8 == 0 ? 8 : 1;
    RDom rk(0, block, 0, S / block, "rk");
    if (ring && !own) rk.where(rk.y * block < nvis(i, b));
    else if (block > 1) rk.where(rk.y * block <= i);
    Expr key = rk.y * block + rk.x;
    Func m("row_max"), l("row_sum");
    Expr vis_r = substitute(j, key, visible);
    // The GPU schedule computes each reduction's scores inside it, one key at
    // a time: it needs Funcs of their own (Halide 21 cannot clone_in a clone).
    auto scores_of = [&](const std::string& tag) {
      if (!gpu) return s;
      A.row_products.push_back(scores(tag));
      return A.row_products.back().wrapper;
    };
    Func s_max = scores_of("_max"), s_sum = scores_of("_sum");
    m(i, h, b) = lowest;
    m(i, h, b) = max(m(i, h, b), select(vis_r, s_max(key, i, h, b), lowest));
    l(i, h, b) = cast(T, 0);
    l(i, h, b) += select(vis_r, exp(s_sum(key, i, h, b) - m(i, h, b)), cast(T, 0));
    A.row_reductions = {m, l};
    return std::pair{m, l};
  };

  // The log-sum-exp, layout [batch, seq, heads]; a ring block's row with no
  // visible key gets a finite lowest value, so that merging never computes
  // inf - inf.
  auto lse_of = [&](Func m, Func l) {
    return ring ? select(l(i, h, b) > 0, m(i, h, b) + log(l(i, h, b)), lowest) : m(i, h, b) + log(l(i, h, b));
  };
  if (n.op == Op::AttentionLse) {
    auto [m, l] = row_stats();
    out(h, i, b) = lse_of(m, l);
    A.tile_var = i;
    return;
  }
  Func v = operand(n.inputs[2], "kv_heads", "v_s");
  if (n.op == Op::Attention) {
    auto [m, l] = row_stats();
    Func p("p"), o_acc("o_acc");
    p(j, i, h, b) = bf16_if(select(visible, exp(s(j, i, h, b) - m(i, h, b)), cast(T, 0)));
    o_acc(d, h, i, b) = cast(T, 0);
    o_acc(d, h, i, b) += p(rj, i, h, b) * v(d, h / grp, rj, b);
    if (ring) out(d, h, i, b) = select(l(i, h, b) > 0, o_acc(d, h, i, b) / l(i, h, b), cast(T, 0));
    else out(d, h, i, b) = o_acc(d, h, i, b) / l(i, h, b);
    // The backward's statistics, when the partition has this kernel write them.
    for (int x : st.extra_outputs)
      if (g.node(x).op == Op::AttentionLse) {
        Func lse("lse_out");
        lse(h, i, b) = lse_of(m, l);
        ls.funcs.extra_outs = {lse};
      }
    A.pointwise = {p};
    A.out_acc = o_acc;
    A.tile_var = i;
    return;
  }
  // Gradients: P = exp(S - lse) from the saved statistics, D_i = rowsum(dO * O).
  Func o = operand(n.inputs[4], "heads", "o_s", false), dO = operand(n.inputs[5], "heads", "do_s");
  Func lse("lse_s");
  lse(i, h, b) = at(n.inputs[6], Env{{"batch", b}, {"seq", i}, {"heads", h}});
  Func p("p");
  p(j, i, h, b) = select(visible, exp(s(j, i, h, b) - lse(i, h, b)), cast(T, 0));
  A.pointwise = {p};
  Func dsum("dsum");
  dsum(i, h, b) = cast(T, 0);
  dsum(i, h, b) += dO(rd, h, i, b) * o(rd, h, i, b);
  ls.funcs.small.push_back(dsum);
  Func ds("ds");
  if (n.op != Op::AttentionGradV) {
    Func vT = transposed(v, "vT");
    Func dp_acc("dp_acc"), dp("dp");
    dp_acc(j, i, h, b) = cast(T, 0);
    dp_acc(j, i, h, b) += dO(rd, h, i, b) * vT(j, rd, h / grp, b);
    dp(j, i, h, b) = dp_acc(j, i, h, b);
    A.products.push_back({dp, dp_acc, j, i});
    ds(j, i, h, b) = bf16_if(p(j, i, h, b) * (dp(j, i, h, b) - dsum(i, h, b)) * scale);
    A.pointwise.push_back(ds);
  }
  Func acc("grad_acc");
  if (n.op == Op::AttentionGradQ) {  // dq[d, i] = sum_j ds[j, i] k[d, j]
    acc(d, h, i, b) = cast(T, 0);
    acc(d, h, i, b) += ds(rj, i, h, b) * k(d, h / grp, rj, b);
    out(d, h, i, b) = acc(d, h, i, b);
    A.tile_var = i;
  } else {  // dk[d, j] = sum_{h in group, i} ds[j, i, h] q[d, h, i]; dv likewise with p and dO
    RDom ri(0, grp, 0, S, "ri");
    if (ring && !own) {
      ls.funcs.small.push_back(first);
      ri.where(ri.y >= first(j, b));
    } else {
      ri.where(ri.y >= j);  // queries before the key never see it
    }
    // (The query's own document start is per query: the mask handles it.)
    Expr hh = gk * grp + ri.x;
    if (n.op == Op::AttentionGradK && !st.extra_outputs.empty()) {
      // dK and dV together (the stage's second output): p is computed once per tile.
      acc(d, gk, j, b) = Tuple(cast(T, 0), cast(T, 0));
      acc(d, gk, j, b) = Tuple(acc(d, gk, j, b)[0] + ds(j, ri.y, hh, b) * q(d, hh, ri.y, b),
                               acc(d, gk, j, b)[1] + bf16_if(p(j, ri.y, hh, b)) * dO(d, hh, ri.y, b));
      out(d, gk, j, b) = Tuple(acc(d, gk, j, b)[0], acc(d, gk, j, b)[1]);
    } else {
      Expr src = n.op == Op::AttentionGradK ? ds(j, ri.y, hh, b) : bf16_if(p(j, ri.y, hh, b));
      Func other = n.op == Op::AttentionGradK ? q : dO;
      acc(d, gk, j, b) = cast(T, 0);
      acc(d, gk, j, b) += src * other(d, hh, ri.y, b);
      out(d, gk, j, b) = acc(d, gk, j, b);
    }
    A.tile_var = j;
  }
  A.out_acc = acc;
}

// A value an extern stage reads: the stage's input buffer, or (an inlined
// expression, such as RoPE of a projection) a copy computed once per call,
// in bf16 (its 16 bits) where `bits16`. The copy is the value whole, as the
// extern calls ask for it (whole rows), so its size is known when the
// library is built (the plan counts it), not at run time.
ExternFuncArgument Ctx::buffer(int id, const std::string& name, bool bits16) {
  if (auto it = std::find(st.inputs.begin(), st.inputs.end(), id); it != st.inputs.end())
    return ls.inputs[static_cast<size_t>(it - st.inputs.begin())];
  const auto names = type(id).axis_names();
  Func f(name);
  f(vars(names)) = bits16 ? bf16_encode(cast<float>(at(id, env(names)))) : at(id, env(names));
  for (const Axis& a : type(id).axes) f.bound(var(a.name), 0, static_cast<int>(a.size));
  ls.funcs.root_copies.push_back(f);
  return f;
}

// Attention through the library kernels (runtime/attention_cpu.h, or on a
// CUDA target runtime/attention_cuda.h, on the device): the
// stage's output is the extern call (the forward, the backward, or a
// recomputed log-sum-exp alone), which writes the stage's other outputs
// (the forward's log-sum-exp; the backward's dV and dQ beside dK) through
// their buffers, so nothing of O(S) is copied after it. Those outputs are
// extern stages that do nothing; nothing reads them inside the stage, so
// Halide may run them before or after the call.
void Ctx::library_attention(int id, Func out) {
  const Node& n = g.node(id);
  const TensorType& qt = type(n.inputs[0]);
  const TensorType& kt = type(n.inputs[1]);
  const int H = static_cast<int>(qt.size("heads")), KV = static_cast<int>(kt.size("kv_heads")),
            D = static_cast<int>(qt.size("head_dim"));
  const bool cuda = library_device == DeviceAPI::CUDA;
  // A ring block's entry points take its token indices after the positions.
  const bool ring = is_ring_block(n);
  const std::string device = std::string(ring ? "_ring" : "") + (cuda ? "_cuda" : "");
  const std::vector<ExternFuncArgument> indices =
      ring ? std::vector<ExternFuncArgument>{buffer(n.inputs[n.inputs.size() - 2], "kidx_s"), buffer(n.inputs.back(), "qidx_s")}
           : std::vector<ExternFuncArgument>{};
  if (cuda && D > runtime::attention_cuda::kMaxHeadDim)
    throw UserError("error: " + describe(g, id) + " has head_dim " + std::to_string(D) +
                    ", over the " + std::to_string(runtime::attention_cuda::kMaxHeadDim) +
                    " the CUDA attention kernels hold (runtime/attention_cuda.h).\nfix: say \"attention_kernel\": "
                    "\"halide\" in the schedule.");
  // q, k, v and O: a bf16 copy of a buffer (a saved value stored in bf16)
  // is read in place, its 16 bits, which the kernels round to the same bf16
  // (or decode exactly), rather than decoded into an f32 copy first
  // (schedules/partition.h: attention_reads_copy). An operand computed
  // inline that the kernels round to bf16 is copied to bf16
  // (attention_copies_bf16).
  auto operand = [&](size_t k, const std::string& name) {
    const int copy = attention_reads_copy(g, st, k);
    return copy >= 0 ? buffer(copy, name) : buffer(n.inputs[k], name, attention_copies_bf16(g, st, k));
  };
  if (n.op == Op::AttentionLse) {  // (q, k, positions): the statistics alone
    std::vector<ExternFuncArgument> args = {operand(0, "q_s"), operand(1, "k_s"), buffer(n.inputs[2], "pos_s")};
    args.insert(args.end(), indices.begin(), indices.end());
    args.insert(args.end(), {Expr(H), Expr(KV), Expr(D), Expr(tiles.attention_queries), Expr(tiles.attention_keys),
                             Expr(n.attrs.bf16 ? 1 : 0)});
    out.define_extern("halyard_attention_lse" + device, args, Float(32), vars(n.type.axis_names()), NameMangling::C,
                      library_device);
    ls.funcs.library = true;
    return;
  }
  std::vector<ExternFuncArgument> args = {operand(0, "q_s"), operand(1, "k_s"), operand(2, "v_s"),
                                          buffer(n.inputs[3], "pos_s")};
  auto written_beside = [&](int e, const std::string& name) {
    Func f(name);
    f.define_extern("halyard_written_beside", {}, Float(32), vars(type(e).axis_names()), NameMangling::C, library_device);
    ls.funcs.extra_outs.push_back(f);
    return f.output_buffer();
  };
  if (n.op == Op::Attention) {
    args.insert(args.end(), indices.begin(), indices.end());
    HALYARD_CHECK(st.extra_outputs.size() <= 1, "the library forward writes the log-sum-exp only");
    for (int e : st.extra_outputs) {
      HALYARD_CHECK(g.node(e).op == Op::AttentionLse, "the library forward writes the log-sum-exp only");
      args.push_back(written_beside(e, "lse_out"));
    }
    args.insert(args.end(), {Expr(H), Expr(KV), Expr(D), Expr(tiles.attention_queries), Expr(tiles.attention_keys),
                             Expr(n.attrs.bf16 ? 1 : 0)});
    out.define_extern((st.extra_outputs.empty() ? "halyard_attention_forward" : "halyard_attention_forward_lse") + device,
                      args, Float(32), vars(n.type.axis_names()), NameMangling::C, library_device);
  } else {
    HALYARD_CHECK(n.op == Op::AttentionGradK && st.extra_outputs.size() == 2, "the library backward writes dK, dV, dQ");
    args.push_back(operand(4, "attention_operand4"));  // O
    for (size_t k = 5; k <= 6; ++k) args.push_back(buffer(n.inputs[k], "attention_operand" + std::to_string(k)));  // dO, the log-sum-exp
    args.insert(args.end(), indices.begin(), indices.end());
    // A ring block's dQ part added to the running sum (Stage::dq_sum_in):
    // the sum, often the very bytes of dq_out (written in place).
    const bool adds = st.dq_sum_in >= 0;
    HALYARD_CHECK(!adds || ring, "only a ring block's backward adds its dQ to a running sum");
    if (adds) args.push_back(buffer(st.dq_sum_in, "dq_sum_in"));
    args.push_back(written_beside(st.extra_outputs[0], "dv_out"));
    args.push_back(written_beside(st.extra_outputs[1], "dq_out"));
    args.insert(args.end(), {Expr(H), Expr(KV), Expr(tiles.attention_queries), Expr(tiles.attention_keys),
                             Expr(n.attrs.bf16 ? 1 : 0)});
    const std::string entry = std::string("halyard_attention_backward") + (adds ? "_ring_add" : ring ? "_ring" : "") +
                              (cuda ? "_cuda" : "");
    out.define_extern(entry, args, Float(32), vars(n.type.axis_names()), NameMangling::C, library_device);
  }
  ls.funcs.library = true;
}

// A weight gradient through the library GEMM (runtime/gemm_cpu.h): the
// stage's output is the extern call, writing the whole gradient.
void Ctx::library_weight_grad(int id, Func out) {
  const Node& n = g.node(id);
  WeightGradForm form;
  HALYARD_CHECK(weight_grad_form(g, n, &form), "a library weight gradient has the form weight_grad_form checks");
  std::vector<ExternFuncArgument> args = {buffer(n.inputs[static_cast<size_t>(form.a)], "wg_a"),
                                          buffer(n.inputs[static_cast<size_t>(form.b)], "wg_b"), Expr(form.a_dims),
                                          Expr(form.b_dims)};
  for (size_t k = 0; k < 3; ++k) args.push_back(Expr(static_cast<int>(k < form.tokens.size() ? form.tokens[k] : 1)));
  out.define_extern("halyard_weight_grad", args, Float(32), vars(n.type.axis_names()), NameMangling::C);
  ls.funcs.library = true;
}

// A contraction through the runtime's GEMM (runtime/gemm.h): the stage's
// output is the extern call on the stage's device, so the GEMM writes the
// output buffer itself. The call's scalars say how each buffer's
// dimensions group into the GEMM's M, N and K (schedules/partition.h:
// gemm_form); the runtime reads the extents and strides from the buffers,
// which lets it take a sequence tile's strided rows in place.
void Ctx::device_gemm(int id, Func out) {
  const Node& n = g.node(id);
  GemmForm form;
  HALYARD_CHECK(gemm_form(g, n, &form), "a device GEMM stage has the form gemm_form checks");
  // Contractions in bf16 read copies (schedules/precision.h:
  // round_contractions): the GEMM reads the 16-bit buffers themselves when
  // both operands are such copies.
  auto copy_under = [&](int id) { return bf16_copy_read(g, st, id); };
  const int a = n.inputs[static_cast<size_t>(form.a)], b = n.inputs[static_cast<size_t>(form.b)];
  const bool bf16 = copy_under(a) >= 0 && copy_under(b) >= 0;
  std::vector<ExternFuncArgument> args = {buffer(bf16 ? copy_under(a) : a, "gemm_a"), buffer(bf16 ? copy_under(b) : b, "gemm_b"),
                                          Expr(form.m_dims), Expr(form.n_dims), Expr(form.k_dims),
                                          Expr(static_cast<int>(form.a_k_inner)), Expr(static_cast<int>(form.b_k_inner)),
                                          Expr(static_cast<int>(bf16))};
  for (size_t k = 0; k < 3; ++k) args.push_back(Expr(static_cast<int>(k < form.k.size() ? form.k[k] : 1)));
  out.define_extern("halyard_gemm", args, Float(32), vars(n.type.axis_names()), NameMangling::C, library_device);
  ls.funcs.library = true;
}

// The runtime's buffers start at 0 and have their tensor's shape
// (runtime/model.cpp), so the kernel is told both, and checks both on every
// call. Halide folds its bounds checks and loop tails into constants (less
// code for LLVM to compile), and where a contraction's columns run over B's
// panels, every column tile starts on a panel: the tile's accumulators have a
// fixed size (else a third panel's, allocated on the heap for every tile) and
// the output's column % panel and column / panel simplify.
// Not for Adams2019 (it has no panels): with the extents known it schedules
// unrolled loops whose extents are not constant, and Halide rejects them.
// A one-element axis outside 2^31 or more elements (a batch of one outside
// a sequence of logits) has a dense stride beyond a Halide buffer's 32 bits;
// the runtime gives it INT32_MAX (runtime/model.cpp). Said to Halide, its
// bounds query no longer multiplies the inner extents in 32 bits: where they
// are constants (the loss's total over 32,768 x 128,256 logits) Halide
// refused to compile that product.
void pin_layout(OutputImageParam b, const TensorType& t, bool shape) {
  int64_t dense = 1;
  for (int d = 0; d < t.rank(); ++d) {  // innermost first
    const int64_t extent = t.axes[static_cast<size_t>(t.rank() - 1 - d)].size;
    if (shape) b.dim(d).set_bounds(0, static_cast<int>(extent));
    if (extent == 1 && dense > kMax32Bit) b.dim(d).set_stride(static_cast<int>(kMax32Bit));
    dense *= extent;
  }
}

}  // namespace

LoweredStage lower_stage(const Graph& g, const Stage& st, bool for_autoscheduler, const KernelTiles& tiles,
                         int vector_floats, DeviceAPI library_device, bool gpu) {
  LoweredStage ls;
  for (size_t k = 0; k < st.inputs.size(); ++k) {
    const TensorType& t = g.node(st.inputs[k]).type;
    ls.inputs.emplace_back(halide_storage_type(t.dtype), t.rank(), "in" + std::to_string(k));
    ls.args.push_back(ls.inputs.back());
  }
  const int panel = vector_floats > 0 ? vector_floats : Halide::get_host_target().natural_vector_size(Halide::Float(32));
  Ctx c{g, st, ls, for_autoscheduler, tiles, panel, library_device, gpu, {}, {}};
  ls.funcs.out = c.get(st.root);
  ls.funcs.out_vars = c.vars(g.node(st.root).type.axis_names());
  if (ls.funcs.attn.kind >= 0) {
    // attention's output Func uses its own short var names
    ls.funcs.out_vars.clear();
    for (const auto& a : ls.funcs.out.args()) ls.funcs.out_vars.push_back(a);
  }
  const bool shape = !for_autoscheduler;
  for (size_t k = 0; k < st.inputs.size(); ++k) pin_layout(ls.inputs[k], g.node(st.inputs[k]).type, shape);
  // (a Tuple's other buffers share the first one's bounds: Halide refuses them)
  const std::vector<OutputImageParam> tuple = ls.funcs.out.output_buffers();
  for (size_t i = 0; i < tuple.size(); ++i) pin_layout(tuple[i], g.node(st.root).type, shape && i == 0);
  for (size_t k = 0; k < ls.funcs.extra_outs.size(); ++k)
    pin_layout(ls.funcs.extra_outs[k].output_buffer(), g.node(st.extra_outputs.at(k)).type, shape);
  std::vector<Func> outs = {ls.funcs.out};
  outs.insert(outs.end(), ls.funcs.extra_outs.begin(), ls.funcs.extra_outs.end());
  ls.pipeline = Pipeline(outs);
  if (ls.funcs.library && !library_jit_externs().empty()) ls.pipeline.set_jit_externs(library_jit_externs());
  return ls;
}

}  // namespace halyard

// The reference interpreter (see interpreter.h). Each op is computed straight
// from its definition; shapes are in the comments beside each kernel.
#include "dsl/interpreter.h"

#include <Eigen/Dense>
#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cmath>
#include <limits>
#include <numeric>

#include "dsl/error.h"
#include "dsl/ops.h"
#include "dsl/op_table.h"

namespace halyard {
namespace {

// f32 rounded to bf16's precision (nearest, ties to even; every NaN the
// quiet 0x7FC0), as generators/bf16.h encodes it.
float round_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::bit_cast<float>(uint32_t{0x7fc00000u});
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return std::bit_cast<float>(u);
}

template <class T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// x rounded to bf16 elementwise where bf16 (Attrs::bf16's products), else x.
template <class X>
X bf16_if(X x, bool bf16) {
  if (bf16)
    for (auto& e : x) e = static_cast<std::remove_reference_t<decltype(e)>>(round_to_bf16(static_cast<float>(e)));
  return x;
}
template <class T>
Mat<T> bf16_if(Mat<T> x, bool bf16) {
  if (bf16) x = x.unaryExpr([](T e) { return static_cast<T>(round_to_bf16(static_cast<float>(e))); });
  return x;
}
template <class T>
using StridedMap = Eigen::Map<Mat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using ConstStridedMap = Eigen::Map<const Mat<T>, 0, Eigen::OuterStride<>>;

std::vector<int64_t> strides_of(const TensorType& t) {
  std::vector<int64_t> s(t.axes.size(), 1);
  for (int i = t.rank() - 2; i >= 0; --i) s[i] = s[i + 1] * t.axes[i + 1].size;
  return s;
}

// "input_ids[1, 5]" for a flat offset into a tensor.
std::string index_str(const Node& n, int64_t flat) {
  std::string s = n.name.empty() ? "%" + std::to_string(n.id) : n.name;
  s += "[";
  auto st = strides_of(n.type);
  for (size_t i = 0; i < st.size(); ++i) {
    s += (i ? ", " : "") + n.type.axes[i].name + "=" + std::to_string(flat / st[i]);
    flat %= st[i];
  }
  return s + "]";
}

// Copies x (laid out as `from`) into the layout given by `order` (a permutation
// of from's axis names).
template <class T>
std::vector<T> permute(const std::vector<T>& x, const TensorType& from, const std::vector<std::string>& order) {
  if (from.axis_names() == order) return x;
  auto src_strides = strides_of(from);
  std::vector<int64_t> size, stride;
  for (const std::string& a : order) {
    int i = from.index_of(a);
    HALYARD_CHECK(i >= 0, "permute to unknown axis " << a);
    size.push_back(from.axes[i].size);
    stride.push_back(src_strides[i]);
  }
  std::vector<T> out(x.size());
  std::vector<int64_t> idx(size.size(), 0);
  int64_t src = 0;
  for (size_t o = 0; o < out.size(); ++o) {
    out[o] = x[static_cast<size_t>(src)];
    for (int d = static_cast<int>(size.size()) - 1; d >= 0; --d) {
      src += stride[d];
      if (++idx[d] < size[d]) break;
      src -= stride[d] * size[d];
      idx[d] = 0;
    }
  }
  return out;
}

TensorType sub_type(const TensorType& t, const std::vector<std::string>& names) {
  TensorType r{t.dtype, {}};
  for (const std::string& n : names) r.axes.push_back({n, t.size(n)});
  return r;
}

// out = sum over shared axes not in out of a*b, as a batched GEMM:
// a -> [batch, free_a, summed], b -> [batch, summed, free_b].
template <class T>
std::vector<T> contract(const std::vector<T>& a, const TensorType& ta, const std::vector<T>& b,
                        const TensorType& tb, const TensorType& to) {
  std::vector<std::string> batch, fa, fb, summed;
  for (const Axis& x : to.axes) {
    bool in_a = ta.has(x.name), in_b = tb.has(x.name);
    (in_a && in_b ? batch : in_a ? fa : fb).push_back(x.name);
  }
  for (const Axis& x : ta.axes)
    if (!to.has(x.name)) summed.push_back(x.name);
  auto cat = [](std::initializer_list<const std::vector<std::string>*> parts) {
    std::vector<std::string> r;
    for (auto* p : parts) r.insert(r.end(), p->begin(), p->end());
    return r;
  };
  auto prod = [&](const std::vector<std::string>& names) {
    int64_t p = 1;
    for (const auto& n : names) p *= to.has(n) ? to.size(n) : ta.size(n);
    return p;
  };
  std::vector<T> ap = permute(a, ta, cat({&batch, &fa, &summed}));
  std::vector<T> bp = permute(b, tb, cat({&batch, &summed, &fb}));
  const int64_t nb = prod(batch), m = prod(fa), k = prod(summed), n = prod(fb);
  std::vector<T> r(static_cast<size_t>(nb * m * n));
  for (int64_t i = 0; i < nb; ++i) {
    Eigen::Map<const Mat<T>> A(ap.data() + i * m * k, m, k);
    Eigen::Map<const Mat<T>> B(bp.data() + i * k * n, k, n);
    Eigen::Map<Mat<T>> R(r.data() + i * m * n, m, n);
    R.noalias() = A * B;
  }
  auto order = cat({&batch, &fa, &fb});
  return permute(r, sub_type(to, order), to.axis_names());
}

// A fiber walk along one axis: element (outer o, position i, inner j).
struct Fibers {
  int64_t outer = 1, len = 1, inner = 1;
  Fibers(const TensorType& t, const std::string& axis) {
    int k = t.index_of(axis);
    HALYARD_CHECK(k >= 0, "no axis " << axis);
    for (int i = 0; i < t.rank(); ++i)
      (i < k ? outer : i == k ? len : inner) *= t.axes[i].size;
  }
  int64_t count() const { return outer * inner; }
  int64_t base(int64_t f) const { return (f / inner) * len * inner + f % inner; }
};

// For each element of `big` (row-major), the flat index of the element of
// `small` at the same coordinates along small's axes (all of them big's).
std::vector<int64_t> broadcast_index(const TensorType& big, const TensorType& small) {
  const auto small_strides = strides_of(small);
  std::vector<int64_t> stride(big.axes.size(), 0);  // big axis -> its stride in small (0: repeated)
  for (size_t i = 0; i < big.axes.size(); ++i)
    if (int k = small.index_of(big.axes[i].name); k >= 0) stride[i] = small_strides[static_cast<size_t>(k)];
  std::vector<int64_t> out(static_cast<size_t>(big.numel()));
  std::vector<int64_t> idx(big.axes.size(), 0);
  int64_t at = 0;
  for (size_t o = 0; o < out.size(); ++o) {
    out[o] = at;
    for (int d = big.rank() - 1; d >= 0; --d) {
      at += stride[static_cast<size_t>(d)];
      if (++idx[static_cast<size_t>(d)] < big.axes[static_cast<size_t>(d)].size) break;
      at -= stride[static_cast<size_t>(d)] * big.axes[static_cast<size_t>(d)].size;
      idx[static_cast<size_t>(d)] = 0;
    }
  }
  return out;
}

std::vector<double> rope_inv_freq(int64_t dim, const Attrs& a) {
  std::vector<double> f(static_cast<size_t>(dim / 2));
  const RopeScaling& s = a.rope_scaling;
  for (int64_t i = 0; i < dim / 2; ++i) {
    double v = 1.0 / std::pow(a.theta, static_cast<double>(2 * i) / static_cast<double>(dim));
    if (s.factor > 0) {
      double wavelen = 2 * M_PI / v;
      double low_wl = s.original_max_position_embeddings / s.low_freq_factor;
      double high_wl = s.original_max_position_embeddings / s.high_freq_factor;
      if (wavelen > low_wl) {
        v /= s.factor;
      } else if (wavelen >= high_wl) {
        double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                        (s.high_freq_factor - s.low_freq_factor);
        v = (1 - smooth) * v / s.factor + smooth * v;
      }
    }
    f[static_cast<size_t>(i)] = v;
  }
  return f;
}

// out[i] = x[i] cos - x[i+h] sin, out[i+h] = x[i+h] cos + x[i] sin (HF rotate_half);
// inverse rotates by -angle.
template <class T>
std::vector<T> rope(const std::vector<T>& x, const TensorType& tx, const std::vector<int32_t>& pos,
                    const TensorType& tp, const Attrs& a) {
  const int64_t dim = tx.size("head_dim"), half = dim / 2;
  auto inv_freq = rope_inv_freq(dim, a);
  auto xs = strides_of(tx), ps = strides_of(tp);
  std::vector<int64_t> pos_stride(tx.axes.size(), 0);
  for (int i = 0; i < tx.rank(); ++i)
    if (int j = tp.index_of(tx.axes[i].name); j >= 0) pos_stride[i] = ps[j];
  Fibers fib(tx, "head_dim");
  std::vector<T> out(x.size());
  const double sign = a.inverse ? -1.0 : 1.0;
  for (int64_t f = 0; f < fib.count(); ++f) {
    int64_t base = fib.base(f), rem = base, p = 0;
    for (int i = 0; i < tx.rank(); ++i) {
      p += (rem / xs[i]) * pos_stride[i];
      rem %= xs[i];
    }
    const double position = pos[static_cast<size_t>(p)];
    for (int64_t i = 0; i < half; ++i) {
      double ang = position * inv_freq[static_cast<size_t>(i)];
      T c = static_cast<T>(std::cos(ang)), s = static_cast<T>(sign * std::sin(ang));
      T x1 = x[base + i * fib.inner], x2 = x[base + (i + half) * fib.inner];
      out[base + i * fib.inner] = x1 * c - x2 * s;
      out[base + (i + half) * fib.inner] = x2 * c + x1 * s;
    }
  }
  return out;
}

template <class T>
struct AttentionShape {
  int64_t B, S, H, KV, D;
  explicit AttentionShape(const TensorType& q, const TensorType& k)
      : B(q.size("batch")), S(q.size("seq")), H(q.size("heads")), KV(k.size("kv_heads")), D(q.size("head_dim")) {}
  // A [seq, head_dim] slice of a [batch, seq, heads, head_dim] tensor.
  ConstStridedMap<T> view(const std::vector<T>& t, int64_t b, int64_t h, int64_t nh) const {
    return ConstStridedMap<T>(t.data() + (b * S * nh + h) * D, S, D, Eigen::OuterStride<>(nh * D));
  }
  StridedMap<T> view(std::vector<T>& t, int64_t b, int64_t h, int64_t nh) const {
    return StridedMap<T>(t.data() + (b * S * nh + h) * D, S, D, Eigen::OuterStride<>(nh * D));
  }
};

// Which keys a query sees (attention() in dsl/ops.h): key j is visible to
// query i when index(i) - positions[i] <= key(j) <= index(i), where index
// and key are the tokens' indices in the row: the seq index itself, or a
// ring block's token_index operands. One (batch) row of them.
struct Mask {
  const int32_t *pos, *qidx, *kidx;  // qidx, kidx null: the seq index
  bool operator()(int64_t i, int64_t j) const {
    const int64_t q = qidx ? qidx[i] : i, k = kidx ? kidx[j] : j;
    return q - pos[i] <= k && k <= q;
  }
};
struct MaskOperands {
  const std::vector<int32_t>* pos;
  const std::vector<int32_t>* qidx = nullptr;
  const std::vector<int32_t>* kidx = nullptr;
  Mask row(int64_t b, int64_t S) const {
    auto at = [&](const std::vector<int32_t>* v) { return v ? v->data() + b * S : nullptr; };
    return Mask{at(pos), at(qidx), at(kidx)};
  }
};

// P = softmax(q k^T / sqrt(d) + the mask) for one (batch, head). A row
// with no visible key is zero.
template <class T>
Mat<T> attention_probs(const Mat<T>& scores_in, const Mask& visible, int64_t S) {
  Mat<T> p = scores_in;
  for (int64_t i = 0; i < S; ++i) {
    T mx = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < S; ++j)
      if (visible(i, j)) mx = std::max(mx, p(i, j));
    T sum = 0;
    for (int64_t j = 0; j < S; ++j) {
      p(i, j) = visible(i, j) ? std::exp(p(i, j) - mx) : T(0);
      sum += p(i, j);
    }
    if (sum > 0) p.row(i) /= sum;
  }
  return p;
}

// With bf16 (Attrs::bf16) the probabilities are rounded before P V as the
// kernels round them: unnormalized, exp(s - the row's max) (the largest
// exactly 1), the sum of the unrounded ones dividing the product. (Kernels
// with an online softmax round a key block against the running max, which
// is the row's from the block that holds it on.)
template <class T>
std::vector<T> attention(const std::vector<T>& q_in, const std::vector<T>& k_in, const std::vector<T>& v_in,
                         const MaskOperands& mask, const AttentionShape<T>& sh, bool bf16) {
  const std::vector<T> q = bf16_if(q_in, bf16), k = bf16_if(k_in, bf16), v = bf16_if(v_in, bf16);
  std::vector<T> out(q.size());
  const T scale = T(1) / std::sqrt(static_cast<T>(sh.D));
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.H; ++h) {
      int64_t g = h / (sh.H / sh.KV);
      Mat<T> s = (sh.view(q, b, h, sh.H) * sh.view(k, b, g, sh.KV).transpose()) * scale;
      Mat<T> p = attention_probs<T>(s, mask.row(b, sh.S), sh.S);
      if (bf16)
        for (int64_t i = 0; i < sh.S; ++i) {
          const T top = p.row(i).maxCoeff();  // p = exp(s - max) / sum: the largest is 1 / sum
          if (top > 0) p.row(i) = bf16_if<T>(p.row(i) / top, true) * top;
        }
      sh.view(out, b, h, sh.H).noalias() = p * sh.view(v, b, g, sh.KV);
    }
  return out;
}

// lse[b, i, h] = log sum over visible keys j of exp(q_i . k_j / sqrt(d)).
template <class T>
std::vector<T> attention_lse(const std::vector<T>& q_in, const std::vector<T>& k_in, const MaskOperands& mask,
                             const AttentionShape<T>& sh, bool bf16) {
  const std::vector<T> q = bf16_if(q_in, bf16), k = bf16_if(k_in, bf16);
  std::vector<T> out(static_cast<size_t>(sh.B * sh.S * sh.H));
  const T scale = T(1) / std::sqrt(static_cast<T>(sh.D));
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.H; ++h) {
      Mat<T> s = (sh.view(q, b, h, sh.H) * sh.view(k, b, h / (sh.H / sh.KV), sh.KV).transpose()) * scale;
      const Mask visible = mask.row(b, sh.S);
      for (int64_t i = 0; i < sh.S; ++i) {
        T mx = -std::numeric_limits<T>::infinity(), sum = 0;
        for (int64_t j = 0; j < sh.S; ++j)
          if (visible(i, j)) mx = std::max(mx, s(i, j));
        for (int64_t j = 0; j < sh.S; ++j)
          if (visible(i, j)) sum += std::exp(s(i, j) - mx);
        out[static_cast<size_t>((b * sh.S + i) * sh.H + h)] = sum > 0 ? mx + std::log(sum) : T(kNoKeysLse);
      }
    }
  return out;
}

// dq, dk, dv of attention from dout, the forward output (D_i = rowsum(dO*O))
// and the row log-sum-exps (P = exp(S - lse) on visible keys).
template <class T>
std::array<std::vector<T>, 3> attention_backward(const std::vector<T>& q_in, const std::vector<T>& k_in,
                                                 const std::vector<T>& v_in, const MaskOperands& mask,
                                                 const std::vector<T>& o, const std::vector<T>& dout_in,
                                                 const std::vector<T>& lse, const AttentionShape<T>& sh, bool bf16) {
  const std::vector<T> q = bf16_if(q_in, bf16), k = bf16_if(k_in, bf16), v = bf16_if(v_in, bf16),
                       dout = bf16_if(dout_in, bf16);
  std::array<std::vector<T>, 3> d{std::vector<T>(q.size(), T(0)), std::vector<T>(k.size(), T(0)),
                                  std::vector<T>(v.size(), T(0))};
  const T scale = T(1) / std::sqrt(static_cast<T>(sh.D));
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.H; ++h) {
      int64_t g = h / (sh.H / sh.KV);
      auto Q = sh.view(q, b, h, sh.H);
      auto K = sh.view(k, b, g, sh.KV);
      auto V = sh.view(v, b, g, sh.KV);
      auto dO = sh.view(dout, b, h, sh.H);
      Mat<T> p = (Q * K.transpose()) * scale;
      const Mask visible = mask.row(b, sh.S);
      for (int64_t i = 0; i < sh.S; ++i)
        for (int64_t j = 0; j < sh.S; ++j)
          p(i, j) = visible(i, j) ? std::exp(p(i, j) - lse[static_cast<size_t>((b * sh.S + i) * sh.H + h)]) : T(0);
      Mat<T> dp = dO * V.transpose();
      Eigen::Matrix<T, Eigen::Dynamic, 1> rows = dO.cwiseProduct(sh.view(o, b, h, sh.H)).rowwise().sum();
      const Mat<T> ds = bf16_if<T>(p.cwiseProduct(dp.colwise() - rows) * scale, bf16);
      sh.view(d[0], b, h, sh.H).noalias() = ds * K;
      sh.view(d[1], b, g, sh.KV).noalias() += ds.transpose() * Q;
      sh.view(d[2], b, g, sh.KV).noalias() += bf16_if(p, bf16).transpose() * dO;
    }
  return d;
}

}  // namespace

template <class T>
Interpreter<T>::Interpreter(const Graph& g)
    : g_(g), f_(static_cast<size_t>(g.size())), i_(static_cast<size_t>(g.size())), bound_(static_cast<size_t>(g.size()), false) {}

template <class T>
void Interpreter<T>::set(const std::string& name, std::vector<T> data) {
  for (const Node& n : g_.nodes())
    if ((n.op == Op::Input || n.op == Op::Param) && n.name == name) {
      if (!is_float(n.type.dtype))
        throw UserError("error: \"" + name + "\" " + n.type.str() + " holds integers; bind it with set_int.");
      if (static_cast<int64_t>(data.size()) != n.type.numel())
        throw UserError("error: \"" + name + "\" " + n.type.str() + " needs " + std::to_string(n.type.numel()) +
                        " values, got " + std::to_string(data.size()) + ".");
      f_[static_cast<size_t>(n.id)] = std::move(data);
      bound_[static_cast<size_t>(n.id)] = true;
      return;
    }
  throw UserError("error: the graph has no float input or parameter named \"" + name + "\".");
}

template <class T>
void Interpreter<T>::set_int(const std::string& name, std::vector<int32_t> data) {
  for (const Node& n : g_.nodes())
    if (n.op == Op::Input && n.name == name) {
      if (n.type.dtype != DType::i32)
        throw UserError("error: \"" + name + "\" " + n.type.str() + " holds floats; bind it with set.");
      if (static_cast<int64_t>(data.size()) != n.type.numel())
        throw UserError("error: \"" + name + "\" " + n.type.str() + " needs " + std::to_string(n.type.numel()) +
                        " values, got " + std::to_string(data.size()) + ".");
      i_[static_cast<size_t>(n.id)] = std::move(data);
      bound_[static_cast<size_t>(n.id)] = true;
      return;
    }
  throw UserError("error: the graph has no integer input named \"" + name + "\".");
}

template <class T>
void Interpreter<T>::run(int last) {
  if (last < 0) last = g_.size() - 1;
  for (int id = 0; id <= last; ++id) eval(g_.node(id));
}

template <class T>
const std::vector<T>& Interpreter<T>::value(int id) const {
  const auto& v = f_.at(static_cast<size_t>(id));
  HALYARD_CHECK(static_cast<int64_t>(v.size()) == g_.node(id).type.numel(), "%" << id << " was not evaluated");
  return v;
}

template <class T>
T Interpreter<T>::scalar(Value v) const {
  HALYARD_CHECK(v.type().rank() == 0, describe(g_, v.id) << " is not a scalar");
  return value(v.id)[0];
}

template <class T>
void Interpreter<T>::eval(const Node& n) {
  auto F = [&](size_t k) -> const std::vector<T>& { return f_[static_cast<size_t>(n.inputs[k])]; };
  auto I = [&](size_t k) -> const std::vector<int32_t>& { return i_[static_cast<size_t>(n.inputs[k])]; };
  auto type = [&](size_t k) -> const TensorType& { return g_.node(n.inputs[k]).type; };
  // An attention op's mask: positions at `pos`; a ring block's token indices last.
  auto mask = [&](size_t pos) {
    MaskOperands m{&I(pos)};
    if (is_ring_block(n)) m.kidx = &I(n.inputs.size() - 2), m.qidx = &I(n.inputs.size() - 1);
    return m;
  };
  auto& out = f_[static_cast<size_t>(n.id)];
  const size_t numel = static_cast<size_t>(n.type.numel());
  if (is_registered_op(n.op)) {
    const OpInfo& r = op_info(n.op);
    if (!r.pointwise)
      throw UserError("error: " + describe(g_, n.id) + " is op \"" + r.name +
                      "\", registered without reference semantics.\nlegal: set OpInfo::pointwise to interpret it.");
    out.resize(numel);
    std::vector<double> args(n.inputs.size());
    for (size_t i = 0; i < numel; ++i) {
      for (size_t k = 0; k < args.size(); ++k) args[k] = static_cast<double>(F(k)[i]);
      out[i] = static_cast<T>(r.pointwise(args));
    }
    return;
  }
  switch (n.op) {
    case Op::Input:
    case Op::Param:
      if (!bound_[static_cast<size_t>(n.id)])
        throw UserError("error: " + std::string(op_name(n.op)) + " \"" + n.name + "\" " + n.type.str() +
                        " was not set.\nbind it with " + (n.type.dtype == DType::i32 ? "set_int" : "set") +
                        "(\"" + n.name + "\", ...) before run().");
      return;
    case Op::Fill:
      out.assign(numel, static_cast<T>(n.attrs.value));
      return;
    case Op::Embedding: {
      // out[ids.., X] = table[id, X]
      const auto& table = F(0);
      const auto& ids = I(1);
      const int64_t vocab = type(0).axes[0].size, width = type(0).axes[1].size;
      out.resize(numel);
      for (size_t t = 0; t < ids.size(); ++t) {
        if (ids[t] < 0 || ids[t] >= vocab)
          throw UserError("error: token id " + std::to_string(ids[t]) + " at " +
                          index_str(g_.node(n.inputs[1]), static_cast<int64_t>(t)) +
                          " is outside the vocabulary.\nlegal ids: 0 .. " + std::to_string(vocab - 1) +
                          " (vocab = " + std::to_string(vocab) + ").");
        std::copy_n(table.begin() + ids[t] * width, width, out.begin() + static_cast<int64_t>(t) * width);
      }
      return;
    }
    case Op::EmbeddingGrad: {
      // dtable[vocab, X] = sum over tokens with id v of dy[token, X]
      const auto& dy = F(0);
      const auto& ids = I(1);
      const int64_t width = n.type.axes[1].size;
      out.assign(numel, T(0));
      for (size_t t = 0; t < ids.size(); ++t)
        for (int64_t x = 0; x < width; ++x)
          out[static_cast<size_t>(ids[t] * width + x)] += dy[t * static_cast<size_t>(width) + static_cast<size_t>(x)];
      return;
    }
    case Op::Contract:
      out = contract(F(0), type(0), F(1), type(1), n.type);
      return;
    case Op::Add:
    case Op::Mul:
      out.resize(numel);
      for (size_t i = 0; i < numel; ++i) out[i] = n.op == Op::Add ? F(0)[i] + F(1)[i] : F(0)[i] * F(1)[i];
      return;
    case Op::BiasAdd: {  // y[i] = x[i] + b[i along b's axes]
      const auto at = broadcast_index(n.type, type(1));
      out.resize(numel);
      for (size_t i = 0; i < numel; ++i) out[i] = F(0)[i] + F(1)[static_cast<size_t>(at[i])];
      return;
    }
    case Op::BiasAddGrad: {  // db[j] = sum of dy[i] over the elements i whose bias element is j
      const auto at = broadcast_index(type(0), n.type);
      out.assign(numel, T(0));
      for (size_t i = 0; i < at.size(); ++i) out[static_cast<size_t>(at[i])] += F(0)[i];
      return;
    }
    case Op::Silu:
    case Op::SiluGrad:
      out.resize(numel);
      for (size_t i = 0; i < numel; ++i) {
        T x = F(0)[i], s = T(1) / (T(1) + std::exp(-x));
        out[i] = n.op == Op::Silu ? x * s : F(1)[i] * s * (T(1) + x * (T(1) - s));
      }
      return;
    case Op::RmsNorm:
    case Op::RmsNormGradX:
    case Op::RmsNormGradW: {
      const auto& x = F(0);
      const std::string axis = n.op == Op::RmsNormGradW ? n.attrs.axis : type(1).axes[0].name;
      Fibers fib(type(0), axis);
      const T eps = static_cast<T>(n.attrs.eps), len = static_cast<T>(fib.len);
      out.assign(numel, T(0));
      for (int64_t f = 0; f < fib.count(); ++f) {
        const int64_t base = fib.base(f);
        auto at = [&](int64_t i) { return static_cast<size_t>(base + i * fib.inner); };
        T ss = 0;
        for (int64_t i = 0; i < fib.len; ++i) ss += x[at(i)] * x[at(i)];
        const T r = T(1) / std::sqrt(ss / len + eps);
        if (n.op == Op::RmsNorm) {  // y = x r w
          for (int64_t i = 0; i < fib.len; ++i) out[at(i)] = x[at(i)] * r * F(1)[static_cast<size_t>(i)];
        } else if (n.op == Op::RmsNormGradX) {  // dx = r w dy - x r^3/n sum(w dy x)
          const auto& w = F(1);
          const auto& dy = F(2);
          T dot = 0;
          for (int64_t i = 0; i < fib.len; ++i) dot += w[static_cast<size_t>(i)] * dy[at(i)] * x[at(i)];
          for (int64_t i = 0; i < fib.len; ++i)
            out[at(i)] = r * w[static_cast<size_t>(i)] * dy[at(i)] - x[at(i)] * r * r * r / len * dot;
        } else {  // dw[i] += dy x r
          const auto& dy = F(1);
          for (int64_t i = 0; i < fib.len; ++i) out[static_cast<size_t>(i)] += dy[at(i)] * x[at(i)] * r;
        }
      }
      return;
    }
    case Op::Rope:
      out = rope(F(0), type(0), I(1), type(1), n.attrs);
      return;
    case Op::Attention:
      out = attention(F(0), F(1), F(2), mask(3), AttentionShape<T>(type(0), type(1)), n.attrs.bf16);
      return;
    case Op::AttentionLse:
      out = attention_lse(F(0), F(1), mask(2), AttentionShape<T>(type(0), type(1)), n.attrs.bf16);
      return;
    case Op::AttentionGradQ:
    case Op::AttentionGradK:
    case Op::AttentionGradV: {
      auto d = attention_backward(F(0), F(1), F(2), mask(3), F(4), F(5), F(6), AttentionShape<T>(type(0), type(1)),
                                  n.attrs.bf16);
      out = std::move(d[n.op == Op::AttentionGradQ ? 0 : n.op == Op::AttentionGradK ? 1 : 2]);
      return;
    }
    case Op::SliceSeq:
    case Op::PadSeq:
    case Op::ConcatSeq: {
      // Each tensor is [outer, seq, inner] row-major; tiles move whole seq rows.
      const int s = n.type.index_of("seq");
      int64_t outer = 1, inner = 1;
      for (int d = 0; d < n.type.rank(); ++d)
        if (d < s) outer *= n.type.axes[static_cast<size_t>(d)].size;
        else if (d > s) inner *= n.type.axes[static_cast<size_t>(d)].size;
      const int64_t len = n.type.axes[static_cast<size_t>(s)].size;
      auto move = [&](auto& dst, const auto& src, int64_t src_len, int64_t src_at, int64_t dst_at, int64_t rows) {
        for (int64_t o = 0; o < outer; ++o)
          std::copy_n(src.begin() + (o * src_len + src_at) * inner, rows * inner,
                      dst.begin() + (o * len + dst_at) * inner);
      };
      auto tiles = [&](auto& dst, auto&& get) {
        if (n.op == Op::SliceSeq) {
          move(dst, get(0), type(0).size("seq"), n.attrs.offset, 0, len);
        } else if (n.op == Op::PadSeq) {
          move(dst, get(0), type(0).size("seq"), 0, n.attrs.offset, type(0).size("seq"));
        } else {
          int64_t at = 0;
          for (size_t k = 0; k < n.inputs.size(); ++k) {
            move(dst, get(k), type(k).size("seq"), 0, at, type(k).size("seq"));
            at += type(k).size("seq");
          }
        }
      };
      if (n.type.dtype == DType::i32) {
        auto& dst = i_[static_cast<size_t>(n.id)];
        dst.assign(numel, 0);
        tiles(dst, I);
      } else {
        out.assign(numel, T(0));
        tiles(out, F);
      }
      return;
    }
    case Op::AllReduce:  // the interpreter is one rank: the sum over ranks is the value
      out = F(0);
      return;
    case Op::LseMerge: {  // log sum_j exp(l_j), by the running maximum
      out.assign(numel, T(0));
      for (size_t e = 0; e < numel; ++e) {
        T mx = -std::numeric_limits<T>::infinity(), sum = 0;
        for (size_t k = 0; k < n.inputs.size(); ++k) mx = std::max(mx, F(k)[e]);
        for (size_t k = 0; k < n.inputs.size(); ++k) sum += std::exp(F(k)[e] - mx);
        out[e] = mx + std::log(sum);
      }
      return;
    }
    case Op::AttentionMerge: {  // sum_j exp(l_j - L) o_j; l and L are [batch, seq, heads], o [.., head_dim]
      out.assign(numel, T(0));
      const auto D = static_cast<size_t>(n.type.size("head_dim"));
      const auto& L = F(kMergeLse);
      for (size_t blk = kMergeBlocks; blk < n.inputs.size(); blk += kMergeBlockOperands) {
        const auto &o = F(blk + 3), &l = F(blk + 4);
        for (size_t e = 0; e < numel; ++e) out[e] += std::exp(l[e / D] - L[e / D]) * o[e];
      }
      return;
    }
    case Op::SeqToHeads:
    case Op::HeadsToSeq:
    case Op::GatherSeq:
    case Op::RingShift:
      throw UserError("error: " + describe(g_, n.id) + " is a collective over mesh axis " + n.attrs.mesh_axis +
                      "; the reference interpreter runs one rank.\nlegal: interpret the unsharded graph, or "
                      "run the generated step with a communicator (runtime/model.h).");
    case Op::TokenCount: {
      int64_t count = 0;
      for (int32_t l : I(0)) count += l != n.attrs.ignore_index;
      out.assign(1, static_cast<T>(count));
      return;
    }
    case Op::CrossEntropy:
    case Op::CrossEntropyGrad: {
      // loss = sum over real tokens (lse(z) - z[label]) / count; no real tokens: 0
      const auto& z = F(0);
      const auto& labels = I(1);
      const int64_t vocab = type(0).axes.back().size;
      const T count = std::max(F(2)[0], T(1));
      for (size_t t = 0; t < labels.size(); ++t) {
        if (labels[t] == n.attrs.ignore_index) continue;
        if (labels[t] < 0 || labels[t] >= vocab)
          throw UserError("error: label " + std::to_string(labels[t]) + " at " +
                          index_str(g_.node(n.inputs[1]), static_cast<int64_t>(t)) +
                          " is outside the vocabulary.\nlegal labels: 0 .. " + std::to_string(vocab - 1) +
                          ", or " + std::to_string(n.attrs.ignore_index) + " to ignore the token.");
      }
      const T dl = n.op == Op::CrossEntropyGrad ? F(3)[0] : T(0);
      out.assign(numel, T(0));
      T total = 0;
      for (size_t t = 0; t < labels.size(); ++t) {
        if (labels[t] == n.attrs.ignore_index) continue;
        const T* row = z.data() + t * static_cast<size_t>(vocab);
        T mx = *std::max_element(row, row + vocab), sum = 0;
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - mx);
        const T lse = mx + std::log(sum);
        if (n.op == Op::CrossEntropy) {
          total += lse - row[labels[t]];
        } else {
          T* drow = out.data() + t * static_cast<size_t>(vocab);
          for (int64_t j = 0; j < vocab; ++j) drow[j] = std::exp(row[j] - lse) * dl / count;
          drow[labels[t]] -= dl / count;
        }
      }
      if (n.op == Op::CrossEntropy) out[0] = total / count;
      return;
    }
    case Op::StoreBf16:  // through f32 (a double rounds twice), then to nearest even as torch.bfloat16
      out.resize(numel);
      for (size_t i = 0; i < numel; ++i) out[i] = static_cast<T>(round_to_bf16(static_cast<float>(F(0)[i])));
      return;
    case Op::LoadBf16:
      out = F(0);
      return;
  }
  HALYARD_CHECK(false, "unhandled op " << op_name(n.op));
}

template class Interpreter<float>;
template class Interpreter<double>;

}  // namespace halyard

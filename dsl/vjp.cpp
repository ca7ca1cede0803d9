// The VJP rule of every differentiable op, written in the DSL itself.
//
// Forward and backward of each op sit side by side here (shapes in comments).
// A rule reads the forward values it needs as ordinary operands; whether they
// are saved or recomputed is the schedule's decision, not this file's.
#include <functional>

#include "dsl/autodiff.h"
#include "dsl/error.h"
#include "dsl/ops.h"

namespace halyard {

std::vector<Value> vjp(Graph& g, const Node& n, Value dy, const std::vector<bool>& needed, const ForwardValue& fwd) {
  std::vector<Value> d(n.inputs.size());
  // A rematerialized operand is cloned where in() first asks for it, so the
  // order of the calls numbers the backward's nodes: each operand is taken
  // in a statement of its own (an argument list's order is unspecified, and
  // GCC and clang differ), highest operand first, the order GCC's builds
  // always had.
  auto in = [&](size_t k) { return fwd(n.inputs[k]); };
  auto type = [&](size_t k) -> const TensorType& { return g.node(n.inputs[k]).type; };
  auto want = [&](size_t k) { return needed[k]; };
  switch (n.op) {
    case Op::Embedding:
      // y[ids.., X] = table[ids.., X]  =>  dtable[vocab, X] = scatter-add of dy at ids
      if (want(0)) d[0] = embedding_grad(dy, in(1), type(0).size("vocab"));
      break;
    case Op::Contract:
      // y = sum_c a*b  =>  da = sum(dy*b) over b's own axes, db likewise
      if (want(0)) d[0] = contract_to(dy, in(1), type(0).axis_names());
      if (want(1)) d[1] = contract_to(dy, in(0), type(1).axis_names());
      break;
    case Op::Add:
      if (want(0)) d[0] = dy;
      if (want(1)) d[1] = dy;
      break;
    case Op::BiasAdd:
      // y[.., h, d] = x[.., h, d] + b[h, d]  =>  dx = dy;  db = sum of dy over x's other axes
      // (over tokens: on a sequence tile or an sp rank a partial sum, which
      // autodiff's accumulation and the step's gradient all-reduce complete)
      if (want(0)) d[0] = dy;
      if (want(1)) d[1] = bias_add_grad(dy, type(1).axis_names());
      break;
    case Op::Mul:
      if (want(0)) d[0] = dy * in(1);
      if (want(1)) d[1] = dy * in(0);
      break;
    case Op::Silu:
      // y = x*s(x)  =>  dx = dy * s(x) * (1 + x*(1 - s(x)))
      d[0] = silu_grad(in(0), dy);
      break;
    case Op::RmsNorm: {
      // y = x*r*w, r = rsqrt(mean(x^2)+eps)
      //   dx = r*(w*dy) - x*r^3/n * sum(w*dy*x);  dw = sum over tokens(dy*x*r)
      if (want(0)) {
        const Value w = in(1), x = in(0);
        d[0] = rms_norm_grad_x(x, w, dy, n.attrs.eps);
      }
      if (want(1)) d[1] = rms_norm_grad_w(in(0), dy, type(1).axes[0].name, n.attrs.eps);
      break;
    }
    case Op::Rope:
      // y = x*cos + rotate_half(x)*sin is a rotation; its transpose rotates back.
      d[0] = rope(dy, in(1), n.attrs.theta, n.attrs.rope_scaling, !n.attrs.inverse);
      break;
    case Op::Attention: {
      // o = softmax(q k^T / sqrt(d) + causal) v. Flash-style, the backward reads
      // o and each score row's log-sum-exp, and recomputes the probabilities.
      Value out = fwd(n.id);
      const Op which[3] = {Op::AttentionGradQ, Op::AttentionGradK, Op::AttentionGradV};
      if (is_ring_block(n)) {  // a ring's key block, with the tokens' indices
        const TokenIndex index{in(5), in(4)};
        const Value pos = in(3), k = in(1), q = in(0);
        Value lse = attention_block_lse(q, k, pos, index, n.attrs);
        const Value v = in(2);
        for (size_t j = 0; j < 3; ++j)
          if (want(j)) d[j] = attention_block_grad(which[j], q, k, v, pos, out, dy, lse, index, n.attrs);
        break;
      }
      const Value pos = in(3), k = in(1), q = in(0);
      Value lse = attention_lse(q, k, pos);
      const Value v = in(2);
      for (size_t j = 0; j < 3; ++j)
        if (want(j)) d[j] = attention_grad(which[j], q, k, v, pos, out, dy, lse);
      break;
    }
    case Op::AttentionMerge: {
      // out = sum_j exp(l_j - L) o_j is attention over the union of the key
      // blocks. Its gradient is each block's flash backward with the merged
      // out and L (the probabilities exp(s - L) are the global ones, and
      // D_i = rowsum(dO * out) the global row term), so the cotangent goes
      // straight to q and the keys and values; the partial o_j and l_j get
      // none (autodiff skips them: they need no backward of their own).
      // A block whose o is itself a merge (the ring's blocks so far, merged
      // as they came: schedules/sharding.cpp) stands for that merge's blocks.
      // Block j's dK and dV belong to the rank j places back: they travel
      // there as one running sum, shifted back one rank before each block's
      // kernels (so the pass overlaps them) and added to that block's.
      struct Block {
        Value k, v, key_index;
        Attrs block, came;  // which block (o_j's); the shift that brought its k
      };
      std::vector<Block> blocks;
      // Copies: the graph grows below, which may move its nodes.
      std::function<void(const Node&)> flatten = [&](const Node m) {
        for (size_t at = kMergeBlocks; at < m.inputs.size(); at += kMergeBlockOperands) {
          const Node o = g.node(m.inputs[at + 3]);
          if (o.op == Op::AttentionMerge) {
            flatten(o);
            continue;
          }
          blocks.push_back({fwd(m.inputs[at]), fwd(m.inputs[at + 1]), fwd(m.inputs[at + 2]), o.attrs,
                            g.node(m.inputs[at]).attrs});
        }
      };
      flatten(n);
      Value out = fwd(n.id), lse = in(kMergeLse);
      const Op which[3] = {Op::AttentionGradQ, Op::AttentionGradK, Op::AttentionGradV};
      Value dk, dv;
      for (size_t b = blocks.size(); b-- > 0;) {
        if (dk.valid()) {
          const Attrs& ring = blocks[b + 1].came;  // the shift that brought block b+1
          dk = ring_shift(dk, ring.mesh_axis, ring.degree, -ring.offset);
          dv = ring_shift(dv, ring.mesh_axis, ring.degree, -ring.offset);
        }
        Value grads[3];
        const Value pos = in(1), q = in(0);
        const TokenIndex index{in(2), blocks[b].key_index};
        for (size_t k = 0; k < 3; ++k)
          grads[k] = attention_block_grad(which[k], q, blocks[b].k, blocks[b].v, pos, out, dy, lse, index, blocks[b].block);
        d[0] = d[0].valid() ? add(d[0], grads[0]) : grads[0];
        dk = dk.valid() ? add(grads[1], dk) : grads[1];
        dv = dv.valid() ? add(grads[2], dv) : grads[2];
      }
      d[kMergeBlocks] = dk;  // block 0's k and v: the rank's own
      d[kMergeBlocks + 1] = dv;
      break;
    }
    case Op::CrossEntropy:
      // l = sum(lse(z) - z[label]) / count  =>  dz = (softmax(z) - onehot(label)) / count * dl
      {
        const Value count = in(2), labels = in(1), logits = in(0);
        d[0] = cross_entropy_grad(logits, labels, count, dy, n.attrs.ignore_index);
      }
      break;
    // Tiles: a slice's transpose puts the cotangent back in place (zeros elsewhere).
    case Op::SliceSeq:
      d[0] = pad_seq(dy, n.attrs.offset, type(0).size("seq"));
      break;
    case Op::PadSeq:
      d[0] = slice_seq(dy, n.attrs.offset, type(0).size("seq"));
      break;
    case Op::ConcatSeq: {
      int64_t at = 0;
      for (size_t k = 0; k < n.inputs.size(); ++k) {
        if (want(k)) d[k] = slice_seq(dy, at, type(k).size("seq"));
        at += type(k).size("seq");
      }
      break;
    }
    // The collectives' transposes. Moving a slice is undone by moving it back;
    // heads a forward all-to-all replicated are summed on the way back.
    case Op::SeqToHeads:
      d[0] = heads_to_seq(dy, n.attrs.mesh_axis, n.attrs.degree);
      break;
    case Op::HeadsToSeq:
      d[0] = seq_to_heads(dy, n.attrs.mesh_axis, n.attrs.degree);
      break;
    case Op::RingShift:
      d[0] = ring_shift(dy, n.attrs.mesh_axis, n.attrs.degree, -n.attrs.offset);
      break;
    case Op::AllReduce:
      // y = sum over ranks of x, held by every rank. The objective counts y
      // once, so each rank's x has cotangent dy (not P*dy); the partial weight
      // gradients this leaves on each rank are summed after the step.
      d[0] = dy;
      break;
    case Op::StoreBf16:
    case Op::LoadBf16:
      throw UserError(std::string("error: cannot differentiate ") + op_name(n.op) + " at " + describe(g, n.id) +
                      "\nstorage precision is the schedule's choice, applied after autodiff.\n"
                      "legal: build the model in f32; a schedule rule {\"store\": \"bf16\"} keeps saved values in bf16.");
    default:
      if (const OpInfo& r = op_info(n.op); r.vjp) return r.vjp(g, n, dy, needed, fwd);
      throw UserError(std::string("error: cannot differentiate ") + op_name(n.op) + " at " +
                      describe(g, n.id) +
                      "\nit is a backward primitive; second derivatives are not supported.");
  }
  return d;
}

}  // namespace halyard

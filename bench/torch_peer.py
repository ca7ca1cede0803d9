"""PyTorch eager peer for Halyard's benchmarks: one subcommand per benchmark, each prints ONE JSON line on stdout.

  torch_peer.py step --config CONFIG.json --seq N --batch B --threads T --steps K
                     [--weights W.safetensors] [--tokens FILE] [--attention auto|sdpa|explicit]
                     [--device cpu|cuda] [--dtype f32|bf16]
      Llama-3 decoder (HF LlamaForCausalLM math restated in plain torch, f32),
      1 warm-up then K timed forward+backward steps (no optimizer), grads
      cleared between steps. Fields: peer, torch, blas, threads, seq, batch,
      attention, loss (of the first step), step_s_median, step_s_all,
      tokens_per_s (B*N/median), peak_rss_mib.
      --device cuda runs on GPU 0 (timings synchronized) and adds device,
      peak_device_mib (torch.cuda.max_memory_allocated over the whole run,
      weights included) and peak_reserved_mib (its caching allocator's);
      --dtype bf16 keeps weights and activations in bf16, with the norms'
      statistics and the loss computed in f32, as HF's Llama does.
  torch_peer.py attention --seq N --heads H --kv-heads KV --head-dim D --threads T --reps K
                          [--device cpu|cuda] [--dtype f32|bf16]
      causal GQA attention forward+backward alone, median of K after 1 warm-up.
  torch_peer.py matmul --m M --n N --k K --threads T --reps R
      f32 x[M,K] @ W[N,K].T, median of R after 1 warm-up, and GFLOP/s.

Runs under any interpreter that has torch (>= 1.13) and imports nothing from
the project, so the peer cannot share a bug with the code it is compared to.
peak_rss_mib is ru_maxrss of this whole process (interpreter and torch
included), the same measure the C++ benchmarks print; import_rss_mib is the
same figure taken before any work (torch's own libraries: ~580 MiB for the
PyPI 2.x wheel, ~230 MiB for Debian's 1.13), so the peer's working memory is
the difference.
"""

import argparse
import json
import math
import os
import re
import resource
import struct
import sys
import time

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TOKENS = os.path.join(REPO_ROOT, "examples", "llama", "data", "corpus.txt")


# ---------------------------------------------------------------- environment

def blas_name():
    """Which BLAS does the f32 GEMMs. PyPI wheels link MKL statically
    (BLAS_INFO=mkl); Debian's build says "generic" and calls whatever
    libblas.so.3 the alternatives system points at, which only the loaded
    library's path reveals (reference BLAS is ~40x slower than OpenBLAS)."""
    m = re.search(r"BLAS_INFO=([^,\s]+)", torch.__config__.show())
    info = m.group(1) if m else "unknown"
    if info != "generic":
        return info
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "blas" in os.path.basename(line.split()[-1])})
    except OSError:
        return info
    # libblas.so.3 is the library torch's symbols bind to; its directory names
    # the provider (.../openblas-pthread/, .../blas/ for the reference one).
    # OpenBLAS's liblapack can pull libopenblas in beside a reference libblas,
    # so the mere presence of libopenblas proves nothing.
    front = [lib for lib in libs if os.path.basename(lib).startswith("libblas.so")]
    if not front:
        return info + " (" + ", ".join(libs) + ")" if libs else info
    provider = os.path.basename(os.path.dirname(front[0]))
    if provider == "blas":
        return "reference (" + front[0] + ")"
    core = [os.path.basename(lib) for lib in libs if os.path.basename(lib).startswith("libopenblas")]
    if provider.startswith("openblas") and core:
        return provider + " (" + core[0] + ")"
    return "generic (" + front[0] + ")"


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention")


def pick_attention(requested):
    if requested == "auto":
        return "sdpa" if has_sdpa() else "explicit"
    if requested == "sdpa" and not has_sdpa():
        sys.exit("error: --attention sdpa needs torch >= 2.0 (F.scaled_dot_product_attention); "
                 "this is torch %s. legal: auto, explicit" % torch.__version__)
    return requested


IMPORT_RSS_MIB = None  # set in main() before any tensor work


def peak_rss_mib():
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]  # upper median, as bench_util.h's median_seconds


def timed(fn, reps):
    """Run fn once to warm up, then reps timed runs; returns (first result, seconds list)."""
    first = fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return first, ts


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def device_fields(device):
    if device != "cuda":
        return {}
    return {"device": torch.cuda.get_device_name(0),
            "peak_device_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def emit(obj):
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------- model

class Dims:
    def __init__(self, cfg, path):
        # Refuse math this peer does not implement instead of timing a different model.
        self.rope_scaling = cfg.get("rope_scaling")
        if self.rope_scaling and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) != "llama3":
            sys.exit("error: %s: rope_scaling %r: torch_peer.py implements only Llama 3's (rope_type llama3)"
                     % (path, self.rope_scaling))
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            sys.exit("error: %s: attention_bias/mlp_bias are not supported by torch_peer.py" % path)
        if cfg.get("hidden_act", "silu") != "silu":
            sys.exit("error: %s: hidden_act %r; only silu is supported" % (path, cfg.get("hidden_act")))
        self.hidden = cfg["hidden_size"]
        self.layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.head_dim = cfg.get("head_dim") or self.hidden // self.heads  # HF's fallback
        self.inter = cfg["intermediate_size"]
        self.vocab = cfg["vocab_size"]
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if self.heads % self.kv_heads:
            sys.exit("error: %s: num_key_value_heads (%d) does not divide num_attention_heads (%d)"
                     % (path, self.kv_heads, self.heads))
        if self.head_dim % 2:
            sys.exit("error: %s: head_dim (%d) must be even for rotate-half RoPE" % (path, self.head_dim))


def param_specs(d):
    """(HF name, shape, kind) in HF state-dict order; the order fixes the init RNG stream."""
    specs = [("model.embed_tokens.weight", (d.vocab, d.hidden), "linear")]
    for i in range(d.layers):
        p = "model.layers.%d." % i
        specs += [
            (p + "input_layernorm.weight", (d.hidden,), "norm"),
            (p + "self_attn.q_proj.weight", (d.heads * d.head_dim, d.hidden), "linear"),
            (p + "self_attn.k_proj.weight", (d.kv_heads * d.head_dim, d.hidden), "linear"),
            (p + "self_attn.v_proj.weight", (d.kv_heads * d.head_dim, d.hidden), "linear"),
            (p + "self_attn.o_proj.weight", (d.hidden, d.heads * d.head_dim), "linear"),
            (p + "post_attention_layernorm.weight", (d.hidden,), "norm"),
            (p + "mlp.gate_proj.weight", (d.inter, d.hidden), "linear"),
            (p + "mlp.up_proj.weight", (d.inter, d.hidden), "linear"),
            (p + "mlp.down_proj.weight", (d.hidden, d.inter), "linear"),
        ]
    specs.append(("model.norm.weight", (d.hidden,), "norm"))
    if not d.tied:
        specs.append(("lm_head.weight", (d.vocab, d.hidden), "linear"))
    return specs


def init_weights(d):
    # Same recipe as HF's _init_weights for Llama (initializer_range 0.02, norms at one).
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape, kind in param_specs(d):
        if kind == "norm":
            out[name] = torch.ones(shape, dtype=torch.float32)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
    return out


def read_safetensors(path):
    """Parse by hand: u64 LE header length, JSON header, then raw little-endian data."""
    with open(path, "rb") as f:
        blob = bytearray(f.read())  # writable, so frombuffer tensors need no copy warning
    if len(blob) < 8:
        sys.exit("error: %s: %d bytes, too short for a safetensors header" % (path, len(blob)))
    (hlen,) = struct.unpack("<Q", bytes(blob[:8]))
    try:
        if 8 + hlen > len(blob):
            raise ValueError("header length %d runs past the %d-byte file" % (hlen, len(blob)))
        header = json.loads(bytes(blob[8:8 + hlen]).decode("utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        sys.exit("error: %s: not a safetensors file (%s)" % (path, e))
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] != "F32":
            # Only parameters need to load; fixtures also hold I32/F64 entries we skip.
            continue
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        n = 1
        for s in shape:
            n *= s
        if end - begin != 4 * n:
            sys.exit("error: %s: tensor %r shape %s needs %d bytes, data_offsets span %d"
                     % (path, name, list(shape), 4 * n, end - begin))
        t = torch.frombuffer(blob, dtype=torch.float32, count=n, offset=base + begin)
        if sys.byteorder != "little":
            t = t.byteswap()  # pragma: no cover (x86/arm are little-endian)
        out[name] = t.reshape(shape).clone()
    return out


def load_weights(d, path):
    raw = read_safetensors(path)
    out = {}
    for name, shape, _ in param_specs(d):
        if name not in raw:
            sys.exit("error: %s: missing F32 tensor %r (expected shape %s)" % (path, name, list(shape)))
        if tuple(raw[name].shape) != shape:
            sys.exit("error: %s: tensor %r has shape %s, config needs %s"
                     % (path, name, list(raw[name].shape), list(shape)))
        out[name] = raw[name]
    return out


def load_tokens(path, batch, seq, vocab):
    """Row r reads stream[r*seq : r*seq+seq] and labels one to the right: the
    same continuous byte stream step_bench.cpp feeds Halyard (for batch 1 this
    is input_ids = stream[:seq], labels = stream[1:seq+1])."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        sys.exit("error: %s: empty token file" % path)
    need = batch * seq + 1
    stream = (data * (need // len(data) + 1))[:need]
    ids = torch.tensor(list(stream), dtype=torch.int64)
    if int(ids.max()) >= vocab:
        sys.exit("error: %s: byte token %d does not fit vocab_size %d" % (path, int(ids.max()), vocab))
    input_ids = ids[:-1].view(batch, seq)
    labels = ids[1:].view(batch, seq)
    return input_ids, labels


def rms_norm(x, w, eps):
    # The statistics in f32 (a no-op for f32 activations), as HF's LlamaRMSNorm.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(seq, head_dim, theta, scaling=None):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:  # Llama 3's: wavelengths past the low-frequency one slowed by `factor`, a blend up to the high one
        orig = scaling["original_max_position_embeddings"]
        low_ff, high_ff, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (orig / wavelength - low_ff) / (high_ff - low_ff)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelength > orig / low_ff, inv_freq / factor,
                               torch.where(wavelength >= orig / high_ff, blended, inv_freq))
    inv_freq = inv_freq.float()
    freqs = torch.arange(seq, dtype=torch.float32).unsqueeze(-1) * inv_freq  # [S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [S, D]
    return emb.cos(), emb.sin()  # broadcast against [B, H, S, D]


def causal_attention(q, k, v, kind):
    """q [B, H, S, D]; k, v [B, KV, S, D] -> [B, H, S, D]; query head h reads kv head h // (H/KV)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # repeat_interleave is HF's repeat_kv: copies kv head j to heads j*group .. j*group+group-1.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # default scale 1/sqrt(D)
    S = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, H, S, S]
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def forward_loss(d, p, input_ids, labels, cos, sin, attention):
    B, S = input_ids.shape
    x = F.embedding(input_ids, p["model.embed_tokens.weight"])  # [B, S, hidden]
    for i in range(d.layers):
        pre = "model.layers.%d." % i
        h = rms_norm(x, p[pre + "input_layernorm.weight"], d.eps)
        q = F.linear(h, p[pre + "self_attn.q_proj.weight"]).view(B, S, d.heads, d.head_dim).transpose(1, 2)
        k = F.linear(h, p[pre + "self_attn.k_proj.weight"]).view(B, S, d.kv_heads, d.head_dim).transpose(1, 2)
        v = F.linear(h, p[pre + "self_attn.v_proj.weight"]).view(B, S, d.kv_heads, d.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = causal_attention(q, k, v, attention)  # [B, H, S, D]
        a = a.transpose(1, 2).reshape(B, S, d.heads * d.head_dim)
        x = x + F.linear(a, p[pre + "self_attn.o_proj.weight"])
        h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], d.eps)
        m = F.silu(F.linear(h, p[pre + "mlp.gate_proj.weight"])) * F.linear(h, p[pre + "mlp.up_proj.weight"])
        x = x + F.linear(m, p[pre + "mlp.down_proj.weight"])
    x = rms_norm(x, p["model.norm.weight"], d.eps)
    head = p["model.embed_tokens.weight"] if d.tied else p["lm_head.weight"]
    logits = F.linear(x, head)  # [B, S, vocab]
    # Labels arrive already shifted to the next token, so no shift here.
    return F.cross_entropy(logits.reshape(-1, d.vocab).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def cmd_step(a):
    with open(a.config) as f:
        d = Dims(json.load(f), a.config)
    attention = pick_attention(a.attention)
    print("torch_peer: attention=%s" % attention, file=sys.stderr)
    dev, dt = a.device, DTYPES[a.dtype]
    p = load_weights(d, a.weights) if a.weights else init_weights(d)
    p = {k: t.to(device=dev, dtype=dt).requires_grad_(True) for k, t in p.items()}
    input_ids, labels = (t.to(dev) for t in load_tokens(a.tokens, a.batch, a.seq, d.vocab))
    cos, sin = (t.to(device=dev, dtype=dt) for t in rope_cos_sin(a.seq, d.head_dim, d.theta, d.rope_scaling))

    def step():
        for t in p.values():
            t.grad = None  # frees last step's grads, like zero_grad(set_to_none=True)
        loss = forward_loss(d, p, input_ids, labels, cos, sin, attention)
        loss.backward()
        sync(dev)
        return loss.item()

    loss, ts = timed(step, a.steps)
    med = median(ts)
    emit({"peer": "pytorch-eager", "config": os.path.splitext(os.path.basename(a.config))[0],
          "torch": torch.__version__, "blas": blas_name(), "threads": a.threads, "seq": a.seq, "batch": a.batch, "attention": attention, "dtype": a.dtype, "loss": round(loss, 6),
          "step_s_median": round(med, 4), "step_s_all": [round(t, 4) for t in ts],
          "tokens_per_s": round(a.batch * a.seq / med, 1), "peak_rss_mib": round(peak_rss_mib(), 1),
          "import_rss_mib": IMPORT_RSS_MIB, **device_fields(dev)})


def cmd_attention(a):
    if a.heads % a.kv_heads:
        sys.exit("error: --kv-heads (%d) does not divide --heads (%d)" % (a.kv_heads, a.heads))
    attention = pick_attention(a.attention)
    print("torch_peer: attention=%s" % attention, file=sys.stderr)
    g = torch.Generator().manual_seed(0)
    dev, dt = a.device, DTYPES[a.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dt)

    q = randn(a.batch, a.heads, a.seq, a.head_dim).requires_grad_(True)
    k = randn(a.batch, a.kv_heads, a.seq, a.head_dim).requires_grad_(True)
    v = randn(a.batch, a.kv_heads, a.seq, a.head_dim).requires_grad_(True)
    dout = randn(a.batch, a.heads, a.seq, a.head_dim)

    def run():
        for t in (q, k, v):
            t.grad = None
        causal_attention(q, k, v, attention).backward(dout)
        sync(dev)

    _, ts = timed(run, a.reps)
    emit({"peer": "pytorch-eager", "bench": "attention", "torch": torch.__version__, "blas": blas_name(),
          "threads": a.threads, "seq": a.seq, "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads,
          "head_dim": a.head_dim, "attention": attention, "dtype": a.dtype, "s_median": round(median(ts), 4),
          "s_all": [round(t, 4) for t in ts], "peak_rss_mib": round(peak_rss_mib(), 1),
          "import_rss_mib": IMPORT_RSS_MIB, **device_fields(dev)})


def cmd_matmul(a):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.m, a.k, generator=g)
    w = torch.randn(a.n, a.k, generator=g)
    _, ts = timed(lambda: x @ w.t(), a.reps)
    med = median(ts)
    emit({"peer": "pytorch-eager", "bench": "matmul", "torch": torch.__version__, "blas": blas_name(),
          "threads": a.threads, "m": a.m, "n": a.n, "k": a.k, "s_median": round(med, 6),
          "s_all": [round(t, 6) for t in ts], "gflops": round(2.0 * a.m * a.n * a.k / med / 1e9, 1),
          "peak_rss_mib": round(peak_rss_mib(), 1),
          "import_rss_mib": IMPORT_RSS_MIB})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    attn_help = "auto: sdpa when torch has F.scaled_dot_product_attention, else explicit"

    s = sub.add_parser("step", help="Llama forward+backward step time")
    s.add_argument("--config", required=True)
    s.add_argument("--seq", type=int, required=True)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--steps", type=int, default=5)
    s.add_argument("--weights")
    s.add_argument("--tokens", default=DEFAULT_TOKENS)
    s.add_argument("--attention", choices=["auto", "sdpa", "explicit"], default="auto", help=attn_help)
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    s.add_argument("--dtype", choices=sorted(DTYPES), default="f32")

    t = sub.add_parser("attention", help="causal attention forward+backward time")
    t.add_argument("--seq", type=int, required=True)
    t.add_argument("--batch", type=int, default=1)
    t.add_argument("--heads", type=int, required=True)
    t.add_argument("--kv-heads", type=int, required=True)
    t.add_argument("--head-dim", type=int, required=True)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--reps", type=int, default=5)
    t.add_argument("--attention", choices=["auto", "sdpa", "explicit"], default="auto", help=attn_help)
    t.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    t.add_argument("--dtype", choices=sorted(DTYPES), default="f32")

    m = sub.add_parser("matmul", help="x[M,K] @ W[N,K].T time and GFLOP/s")
    m.add_argument("--m", type=int, required=True)
    m.add_argument("--n", type=int, required=True)
    m.add_argument("--k", type=int, required=True)
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--reps", type=int, default=9)

    a = ap.parse_args()
    for name in ("seq", "batch", "steps", "reps", "heads", "kv_heads", "head_dim", "m", "n", "k", "threads"):
        v = getattr(a, name, None)
        if v is not None and v < 1:
            sys.exit("error: --%s is %d; it must be >= 1" % (name.replace("_", "-"), v))
    if getattr(a, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda, but torch %s sees no CUDA device" % torch.__version__)
    global IMPORT_RSS_MIB
    IMPORT_RSS_MIB = round(peak_rss_mib(), 1)
    torch.set_num_threads(a.threads)
    {"step": cmd_step, "attention": cmd_attention, "matmul": cmd_matmul}[a.cmd](a)


if __name__ == "__main__":
    main()

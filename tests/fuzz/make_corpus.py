#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/)
from the repository's real files: safetensors files cut from
tests/fixtures/llama_micro.safetensors, the example configs and schedules, and
token files made of README text. Seeds are named seed-*; inputs that once broke
a parser are named crash-* and are kept as they are (this script never touches
them). Rerun after changing a source file: python3 tests/fuzz/make_corpus.py
"""
import json
import pathlib
import shutil
import struct

root = pathlib.Path(__file__).resolve().parents[2]
corpus = root / "tests" / "fuzz" / "corpus"


def write(target, name, data):
    d = corpus / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


NO_METADATA = object()


def safetensors(entries, metadata=NO_METADATA, pad=True):
    """entries: name -> (dtype, shape, bytes); laid out in name order, like the writer."""
    header, data = {}, b""
    for name in sorted(entries):
        dtype, shape, raw = entries[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not NO_METADATA:
        header["__metadata__"] = metadata  # None writes null, which readers take as none
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def fixture():
    raw = (root / "tests/fixtures/llama_micro.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    def tensor(name, count):  # the first `count` elements
        e = header[name]
        size = {"F64": 8, "F32": 4, "I32": 4}[e["dtype"]]
        b = e["data_offsets"][0] + 8 + n
        return e["dtype"], raw[b:b + count * size]
    return header, tensor


def safetensors_seeds():
    header, tensor = fixture()
    meta = {k: header["__metadata__"][k] for k in ("format", "seed", "batch", "seq")}
    f64, loss = tensor("loss", 1)
    i32, ids = tensor("input_ids", 8)
    f32, norm = tensor("model.norm.weight", 8)
    _, q = tensor("model.layers.0.self_attn.q_proj.weight", 8)
    write("safetensors", "seed-micro-cut", safetensors(
        {"loss": (f64, [], loss), "input_ids": (i32, [2, 4], ids), "model.norm.weight": (f32, [8], norm),
         "model.layers.0.self_attn.q_proj.weight": (f32, [2, 4], q)}, meta))
    write("safetensors", "seed-dtypes", safetensors(
        {"f16": ("F16", [2], b"\x00\x3c\x00\xfc"), "bf16": ("BF16", [2], b"\x80\x3f\xc0\x7f"),
         "i64": ("I64", [2], struct.pack("<qq", -5, 1 << 40)), "u32": ("U32", [1], struct.pack("<I", 1 << 31)),
         "i16": ("I16", [1], b"\xff\xff"), "u8": ("U8", [3], b"\x01\x02\x03"), "bool": ("BOOL", [1], b"\x01"),
         "empty": ("F32", [0, 3], b""), "scalar": ("I8", [], b"\x80")}))
    write("safetensors", "seed-empty-header", safetensors({}))
    write("safetensors", "seed-metadata-null-unpadded", safetensors({"x": (f32, [2], norm)}, None, pad=False))
    # The fixture's own header, cut to six entries, with no data: truncated.
    names = ["__metadata__", "input_ids", "labels", "loss", "model.norm.weight", "lm_head.weight"]
    text = json.dumps({k: header[k] for k in names}).encode()
    write("safetensors", "seed-fixture-header-truncated", struct.pack("<Q", len(text)) + text)


def config_seeds():
    for p in sorted((root / "examples/llama/configs").glob("*.json")):
        if p.stem in ("tiny", "llama-3.1-8b", "llama-2-13b"):
            write("llama_config", "seed-" + p.name, p.read_bytes())
    write("llama_config", "seed-llama_micro.json", (root / "tests/fixtures/llama_micro.json").read_bytes())
    write("llama_config", "seed-minimal.json",
          '{"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 96, '
          '"vocab_size": 32, "tie_word_embeddings": true, "rope_scaling": null, "head_dim": null}')


def schedule_seeds():
    for p in sorted((root / "examples/llama/schedules").glob("*.json")):
        write("schedule", "seed-" + p.name, p.read_bytes())
    write("schedule", "seed-tiled_micro.json", (root / "tests/fixtures/tiled_micro.json").read_bytes())
    write("schedule", "seed-mesh-kernels.json", json.dumps(
        {"name": "mesh", "mesh": {"dp": 2, "sp": 4, "zero": 1}, "split_sequence": "sp", "redistribute_heads": "ulysses",
         "kernel_tiles": {"attention_queries": 64, "attention_keys": 128}, "loss_seq_tile": 8,
         "autoscheduler": ""}, indent=1))
    write("schedule", "seed-first-vocabulary.json", json.dumps(
        {"checkpoint": True, "recompute": ["rms_norm", "silu"], "seq_tile": 12, "autoscheduler": "Adams2019"}))
    write("schedule", "seed-strategies.json", json.dumps(
        {"name": "strategies", "mesh": {"sp": 8}, "split_sequence": "sp", "sequence_layout": "zigzag",
         "attention": [{"match": "model.layers.0.*", "strategy": "ring"},
                       {"match": "model.layers.1.*", "strategy": "hybrid", "ulysses_degree": 2}]}, indent=1))
    write("schedule", "seed-patterns.json", json.dumps(
        {"values": [{"match": "model.layers.*.mlp", "keep": "recompute"},
                    {"match": "model.*.self_attn.*_proj class:heavy", "keep": "save", "compute": "root"},
                    {"match": "lm_head seq_tiles", "keep": "recompute"}]}))


def token_params(kind, batch, seq, vocab, ranks, rank, replicas, replica, step, start, n, view=None):
    """The 31 parameter bytes of fuzz_token_file.cpp; view: (begin, end) of a slice."""
    return bytes([kind, batch, seq, vocab & 0xff, vocab >> 8, ranks, rank & 0xff, replicas, replica, step]) + \
        struct.pack("<qq", start, n) + (struct.pack("<Bhh", 1, *view) if view else bytes(5))


def token_seeds():
    text = (root / "README.md").read_bytes()[:240]
    u16 = b"".join(struct.pack("<H", c) for c in text[:96])
    u32 = b"".join(struct.pack("<I", c * 1000) for c in text[:48])
    write("token_file", "seed-u16-two-ranks", token_params(0, 2, 16, 256, 2, 1, 1, 0, 3, 0, 4) + u16)
    write("token_file", "seed-u16-three-ranks-padded", token_params(0, 3, 10, 256, 3, 2, 2, 1, 9, 90, 6) + u16)
    write("token_file", "seed-u16-slice", token_params(0, 2, 12, 256, 2, 0, 1, 0, 5, 10, 20, (30, 90)) + u16)
    write("token_file", "seed-text-slice-tail", token_params(2, 1, 8, 256, 1, 0, 1, 0, 1, 0, 9, (200, 240)) + text)
    write("token_file", "seed-u32-ids-past-vocab", token_params(1, 1, 8, 200, 1, 0, 1, 0, 0, 47, 1) + u32)
    write("token_file", "seed-u32-id-past-int32", token_params(1, 1, 2, 65535, 1, 0, 1, 0, 1, 0, 3) +
          struct.pack("<III", 5, 0x80000000, 7))
    write("token_file", "seed-text-four-ranks", token_params(2, 2, 37, 256, 4, 3, 1, 0, 200, 100, 140) + text)
    write("token_file", "seed-u16-odd-size", token_params(0, 1, 4, 256, 1, 0, 1, 0, 0, 0, 1) + u16[:21])
    write("token_file", "seed-read-out-of-range", token_params(0, 1, 4, 256, 1, 0, 1, 0, 0, 3, (1 << 63) - 1) + u16[:40])


if __name__ == "__main__":
    for target in ("safetensors", "llama_config", "schedule", "token_file"):
        for p in (corpus / target).glob("seed-*"):
            p.unlink()
    safetensors_seeds()
    config_seeds()
    schedule_seeds()
    token_seeds()
    for d in sorted(corpus.iterdir()):
        files = list(d.iterdir())
        print(f"{d.name}: {len(files)} inputs, {sum(f.stat().st_size for f in files)} bytes")

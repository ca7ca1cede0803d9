#!/usr/bin/env python3
"""What ptxas and the SASS say of CUDA kernels, on a machine without a GPU.

    python3 scripts/cuda_kernel_stats.py [--source runtime/attention_cuda.cu]
        [--arch sm_90] [--kernel REGEX] [--loops]

For each kernel of the source (compiled as the runtime's fatbin is: nvcc -O3,
C++17): registers, bytes spilled, static shared memory (ptxas -v), its SASS
instructions and mma instructions; with --loops, every loop of its SASS (a
backward branch) with its instructions by kind. A loop's count times its trip
count is what a warp issues there: that is how docs/gpu.md counts the
attention kernels' instructions a tile. Nothing here runs a kernel.

The SASS comes from cuobjdump and nvdisasm, which the CUDA toolkit here lacks:
they are installed from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)
into the project's .venv the first time (scripts/setup.sh makes the venv).
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg):
    sys.exit("cuda_kernel_stats: " + msg)


def sass_tools():
    """The folder holding cuobjdump and nvdisasm, installed into .venv if absent."""
    if shutil.which("cuobjdump") and shutil.which("nvdisasm"):
        return None
    py = os.path.join(ROOT, ".venv", "bin", "python")

    def found():
        for d in glob.glob(os.path.join(ROOT, ".venv", "lib", "python*", "site-packages", "nvidia", "cu*", "bin")):
            if os.path.exists(os.path.join(d, "cuobjdump")) and os.path.exists(os.path.join(d, "nvdisasm")):
                return d
        return None

    d = found()
    if d:
        return d
    if not os.path.exists(py):
        die("no .venv (run bash scripts/setup.sh first): cuobjdump and nvdisasm are installed into it")
    print("installing cuobjdump and nvdisasm from PyPI into .venv ...", file=sys.stderr)
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "nvidia-cuda-cuobjdump==13.*", "nvidia-cuda-nvdisasm==13.*"])
    d = found()
    if r.returncode != 0 or not d:
        die("could not install nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm from PyPI")
    for tool in ("cuobjdump", "nvdisasm"):
        os.chmod(os.path.join(d, tool), 0o755)
    return d


def ptxas_stats(log):
    """{kernel: (registers, spill-store bytes, shared bytes)} from nvcc -Xptxas -v."""
    stats, cur, spill = {}, None, 0
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur, spill = m.group(1), 0
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)
        if m and cur:
            stats[cur] = (int(m.group(1)), spill, int(m.group(2)))
    return stats


def sass_functions(text):
    """{kernel: [(address, instruction)]} from cuobjdump -sass."""
    funcs = {}
    for block in re.split(r"\n\s+Function : ", text)[1:]:
        name = block.split("\n")[0].strip()
        funcs[name] = [(int(m.group(1), 16), m.group(2).strip())
                       for m in (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", l) for l in block.split("\n")) if m]
    return funcs


def opcode(ins):
    return (ins.split()[1] if ins.startswith("@") else ins.split()[0])


def kinds(body):
    c = collections.Counter()
    for _, ins in body:
        op = opcode(ins)
        for kind, prefixes in (("mma", ("HMMA",)), ("lds", ("LDS", "LDSM")), ("sts", ("STS",)),
                               ("ld", ("LDG", "LD.")), ("st", ("STG", "ST.")), ("shfl", ("SHFL",)),
                               ("bar", ("BAR",)), ("mufu", ("MUFU",)), ("atom", ("ATOM", "RED")),
                               ("local", ("LDL", "STL")), ("branch", ("BRA",))):
            if op.startswith(prefixes):
                c[kind] += 1
    return c


def loops(ins):
    """(first, last) index of each loop: a branch back to an earlier instruction."""
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA .*0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            out.append((at[int(m.group(1), 16)], i))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="runtime/attention_cuda.cu")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernel", default=".", help="a regex the kernels' names must contain")
    ap.add_argument("--loops", action="store_true", help="every loop of each kernel's SASS, by kind")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if not nvcc:
        die("nvcc not found (the CUDA toolkit compiles the kernels; no GPU is needed)")
    src = os.path.join(ROOT, args.source)
    tools = sass_tools()
    env = dict(os.environ)
    if tools:
        env["PATH"] = tools + os.pathsep + env["PATH"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        r = subprocess.run([nvcc, "-cubin", "-O3", "-std=c++17", "-I" + ROOT, "-arch=" + args.arch, "-Xptxas", "-v",
                            "-o", cubin, src], capture_output=True, text=True)
        if r.returncode != 0:
            die("nvcc failed:\n" + r.stderr)
        stats = ptxas_stats(r.stderr)
        d = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, env=env)
        if d.returncode != 0:
            die("cuobjdump failed:\n" + d.stderr)
        funcs = sass_functions(d.stdout)
    print(f"{args.source}, {args.arch} (nvcc -O3; ptxas -v and SASS)")
    print(f"{'kernel':40s} {'regs':>5s} {'spill':>6s} {'smem':>7s} {'instr':>6s} {'mma':>5s}")
    for name in sorted(stats):
        if not re.search(args.kernel, name):
            continue
        regs, spill, smem = stats[name]
        ins = funcs.get(name, [])
        print(f"{name:40s} {regs:5d} {spill:6d} {smem:7d} {len(ins):6d} {kinds(ins)['mma']:5d}")
        if args.loops:
            ls = loops(ins)
            for first, last in ls:
                depth = sum(1 for o in ls if o != (first, last) and o[0] <= first and last <= o[1])
                c = kinds(ins[first:last + 1])
                what = " ".join(f"{k} {c[k]}" for k in ("mma", "lds", "sts", "ld", "st", "shfl", "mufu", "atom", "bar",
                                                        "local") if c[k])
                print(f"    {'  ' * depth}loop {first}-{last}: {last - first + 1} instructions; {what}")


if __name__ == "__main__":
    main()

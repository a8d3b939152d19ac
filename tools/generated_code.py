"""The generated code of a tree's GPU kernels, to show that a refactor changed none of it (no GPU needed).

    python3 tools/generated_code.py dump TREE OUT [--cuda]
    python3 tools/generated_code.py compare OLD_OUT NEW_OUT

`dump` runs in a child process that imports TREE's `pcvr_lib` (TileLang re-reads kernel sources from the
files, so TREE must not change while it runs) and writes to OUT:
- TileLang: the TIR script (`script(show_meta=True)`: what TileLang's disk-cache key hashes) of the
  attention key-block backward kernels (dkdv, fused; D64/D128, bf16/fp16, the five masks, with and without
  key lengths and dropout, four tile configs: 320 files) and of every norm kernel of the workload manifest;
  with --cuda also the lowered sm_90a CUDA of 28 attention variants (about 4 s each here).
- Triton: sm_90 PTX of the four norm kernels (widths 96 / 333 / 1024 / 16384, fp16 / bf16 / fp32, save flag).
  It uses the norms' `triton_impl.compile_for` (the norms package, or the rms_norm package of an older TREE).
- Triton attention: sm_90 PTX of every kernel variant the workload can launch (`_triton_attention_variants`):
  triton_impl's fwd / dq / dkdv at each distinct tile config of head dims 16 / 32 / 64 / 128 and the one-tile
  backward, triton_long's fwd and bwd at their configs; every mask (none, key lengths, causal with and
  without key lengths, causal-valid, window and roles with and without key lengths), with and without
  dropout; bf16 everywhere, fp16 at head dim 64; the forward with and without the LSE at head dim 64.
  `--only-triton-attention` dumps just these (672 compiles, about 15 minutes on 2 shared CPU cores; a
  disk-cached one takes milliseconds).
`compare` sorts every file of OLD_OUT into identical / identical but for debug info (PTX `.loc` and `.file`
lines, `$L__tmp` labels, `.debug` sections: line numbers move with any edit) / different, and lists the latter.
Use it around any change that moves kernel code without meaning to change it (notes/architecture.md).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEBUG_LINE = re.compile(r"^\s*\.(loc|file)\b|^\$L__tmp\d+:$")


def _attention_variants():
    for D, dt, mode, kl, drop in itertools.product((64, 128), ("bfloat16", "float16"), (1, 2, 3, 4, 5),
                                                   (True, False), (True, False)):
        for cfg in ((64, 64, 128, 2), (64, 64, 128, 1)):
            yield "dkdv", D, dt, mode, kl, drop, cfg
        for cfg in ((128, 128, 256, 2, "fused"), (64, 128, 256, 2, "fused")):
            yield "fused", D, dt, mode, kl, drop, cfg


# (mode name, key lengths) pairs the kernels take: MODE 1 is "none" without and "key_lengths" with them
_MASKS = (("none", False), ("key_lengths", True), ("causal", False), ("causal", True), ("causal_valid", True),
          ("window", False), ("window", True), ("roles", False), ("roles", True))


def _triton_attention_variants():
    """(module, kind, D, dtype, mode, has_kl, dropout, store_lse, config) of every attention Triton kernel,
    every kind and mask of head dim 64 first (a run cut short still covers every kernel)."""
    order = {64: 0, 128: 1, 16: 2, 32: 3}
    return sorted(_all_triton_attention_variants(),
                  key=lambda v: (order[v[2]], v[3] != "bf16", not v[7], v[0] == "impl" and v[8] != _bucket0(v)))


def _bucket0(v):
    from pcvr_lib.kernels.attention import config as cfg

    module, kind, D = v[:3]
    tables = {"fwd": cfg.TRITON_FWD_CONFIGS, "dq": cfg.TRITON_BWD_DQ_CONFIGS, "dkdv": cfg.TRITON_BWD_KV_CONFIGS}
    return tables[kind][(D, 0)] if kind in tables else cfg.TRITON_BWD_ONE_TILE_CONFIGS[D]


def _all_triton_attention_variants():
    from pcvr_lib.kernels.attention import config as cfg

    tables = {"fwd": cfg.TRITON_FWD_CONFIGS, "dq": cfg.TRITON_BWD_DQ_CONFIGS, "dkdv": cfg.TRITON_BWD_KV_CONFIGS}
    for D in (16, 32, 64, 128):
        per_kind = [(kind, sorted({c for (d, _), c in table.items() if d == D})) for kind, table in tables.items()]
        per_kind.append(("one_tile", [cfg.TRITON_BWD_ONE_TILE_CONFIGS[D]]))
        for kind, configs in per_kind:
            for config, (mode, kl), drop, dt in itertools.product(configs, _MASKS, (False, True),
                                                                ("bf16", "fp16") if D == 64 else ("bf16",)):
                for store_lse in ((True, False) if kind == "fwd" and D == 64 else (True,)):
                    yield "impl", kind, D, dt, mode, kl, drop, store_lse, config
    for kind, table in (("fwd", cfg.TRITON_LONG_FWD_CONFIGS), ("bwd", cfg.TRITON_LONG_BWD_CONFIGS)):
        for D, config in sorted(table.items()):
            for (mode, kl), drop, dt in itertools.product(_MASKS[:5], (False, True),
                                                          ("bf16", "fp16") if D == 64 else ("bf16",)):
                yield "long", kind, D, dt, mode, kl, drop, True, config


def _dump_triton_attention(write) -> None:
    from pcvr_lib.kernels.attention import triton_impl, triton_long

    for module, kind, D, dt, mode, kl, drop, store_lse, config in _triton_attention_variants():
        tag = f"{module}_{kind}_{D}_{dt}_{mode}_{kl}_{drop}_{store_lse}_{'-'.join(map(str, config))}"
        if module == "impl":
            compiled = triton_impl.compile_for(90, kind, D, dt, mode, kl, drop, store_lse, config)
        else:
            compiled = triton_long.compile_for(90, kind, D, dt, mode, kl, drop, config)
        write(f"ptx_attn_{tag}.ptx", compiled.asm["ptx"])


def _norm_modules():
    """(Triton module with compile_for, {op: TileLang KERNELS}, the norm workload) of TREE: the norms package, or the
    separate rms_norm / layer_norm packages of a tree before it."""
    try:
        from pcvr_lib.kernels.norms import OPS, tilelang_impl, triton_impl
        from pcvr_lib.workloads import norms as workload

        return triton_impl, {op: tilelang_impl.KERNELS for op in OPS}, workload
    except ModuleNotFoundError:
        import importlib

        from pcvr_lib.kernels.rms_norm import triton_impl, workload

        kernels = {op: importlib.import_module(f"pcvr_lib.kernels.{op}.tilelang_impl").KERNELS for op in workload.OPS}
        return triton_impl, kernels, workload


def _dump(out: str, cuda: bool, only_triton_attention: bool = False) -> None:
    """Runs inside TREE (cwd and sys.path)."""
    os.makedirs(out, exist_ok=True)

    def write(name, text):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)

    _dump_triton_attention(write)
    if only_triton_attention:
        print(f"{len(os.listdir(out))} files in {out}")
        return
    import tilelang
    import torch
    import tvm

    from pcvr_lib.kernels._tilelang import tl_dtype
    from pcvr_lib.kernels.attention import tilelang_impl as attention

    norm_triton, norm_kernels, workload = _norm_modules()
    for which, D, dt, mode, kl, drop, cfg in _attention_variants():
        tag = f"attn_{which}_{D}_{dt}_{mode}_{kl}_{drop}_{'-'.join(map(str, cfg))}"
        write(f"tir_{tag}.txt", attention._PROGRAMS[which](D, dt, mode, kl, drop, *cfg).script(show_meta=True))
        if cuda and D == 64 and dt == "bfloat16" and (kl or mode in (1, 4)) and cfg[3] == 2 \
                and (which == "dkdv" or cfg[0] == 128):
            write(f"cuda_{tag}.cu", attention.lower_source(which, D, dt, mode, kl, drop, cfg,
                                                           {"kind": "cuda", "arch": "sm_90a"}))
    for op, kernels in norm_kernels.items():
        for kind, n, dtype in workload.tilelang_variants(op):
            program = kernels.build((f"{op}.{kind}", n, dtype))()
            tag = f"{op}_{kind}_{n}_{tl_dtype(dtype)}"
            write(f"tir_{tag}.txt", program.script(show_meta=True))
            if cuda and n in (96, 333, 1024, 16384) and dtype in (torch.float16, torch.float32):
                with tvm.target.Target({"kind": "cuda", "arch": "sm_90"}):
                    lowered = tilelang.lower(program, target={"kind": "cuda", "arch": "sm_90"})
                write(f"cuda_{tag}.cu", lowered.kernel_source)
    compile_for = norm_triton.compile_for
    for name, n, dt, flag in itertools.product(("rms_fwd", "rms_bwd", "ln_fwd", "ln_bwd"), (96, 333, 1024, 16384),
                                               ("fp16", "bf16", "fp32"), (True, False)):
        if name.endswith("bwd") and not flag:
            continue
        write(f"ptx_{name}_{n}_{dt}_{flag}.ptx", compile_for(90, name, n, dt, flag).asm["ptx"])
    print(f"{len(os.listdir(out))} files in {out}")


def _without_debug(text: str) -> list[str]:
    text = text.split("\t.section\t.debug", 1)[0]
    return [line for line in text.splitlines() if not _DEBUG_LINE.search(line)]


def compare(old: str, new: str) -> int:
    """Prints the counts and the files that differ; returns how many differ (or are missing in NEW)."""
    same = debug_only = 0
    different = []
    for name in sorted(os.listdir(old)):
        path = os.path.join(new, name)
        if not os.path.exists(path):
            different.append(f"{name} (missing in {new})")
            continue
        with open(os.path.join(old, name)) as a, open(path) as b:
            left, right = a.read(), b.read()
        if left == right:
            same += 1
        elif name.endswith(".ptx") and _without_debug(left) == _without_debug(right):
            debug_only += 1
        else:
            different.append(name)
    print(f"{same} identical, {debug_only} identical but for debug info, {len(different)} different")
    for name in different:
        print(f"  differs: {name}")
    return len(different)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="write TREE's generated code to OUT")
    dump.add_argument("tree")
    dump.add_argument("out")
    dump.add_argument("--cuda", action="store_true", help="also lowered CUDA sources (slow)")
    dump.add_argument("--only-triton-attention", action="store_true",
                      help="only the attention Triton kernels' PTX (no TileLang, no norms)")
    dump.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    cmp = sub.add_parser("compare", help="compare two dumps")
    cmp.add_argument("old")
    cmp.add_argument("new")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return 1 if compare(args.old, args.new) else 0
    if args.inside:
        _dump(os.path.abspath(args.out), args.cuda, args.only_triton_attention)
        return 0
    tree = os.path.abspath(args.tree)
    if not os.path.isdir(os.path.join(tree, "pcvr_lib")):
        parser.error(f"{args.tree}: no pcvr_lib folder: not a checkout of this project")
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, os.path.abspath(__file__), "dump", tree, os.path.abspath(args.out), "--inside"]
    cmd += ["--cuda"] if args.cuda else []
    cmd += ["--only-triton-attention"] if args.only_triton_attention else []
    return subprocess.run(cmd, cwd=tree, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())

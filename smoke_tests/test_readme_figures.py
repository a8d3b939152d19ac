"""The README's result figures are the committed snapshots' numbers: each one is recomputed here from
`.benchmarks/` and must appear in README.md as written (a re-measured snapshot fails this test until the
README follows it), and each describes the code of this tree: a figure from a case whose sources changed
since its snapshot (pcvr_lib.sources: `stale`) fails unless the README says "stale since <its digest>" on
the figure's line; a figure from a snapshot recorded before source digests (`unknown`) needs the README
section that quotes it to say that its snapshot (named in backquotes) predates source digests."""

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from pcvr_lib import sources
from pcvr_lib.report import case_times

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
UNKNOWN_NOTE = re.compile(r"predates?\s+source\s+digests")  # the words an unknown figure's section must hold

_READ: list[tuple[str, dict]] = []  # (snapshot, case) read since the last claim was made


@dataclass(frozen=True)
class Claim:
    text: str  # as README.md must say it
    cases: tuple[tuple[str, dict], ...]  # (snapshot, case) the figures come from


def claim(text: str) -> Claim:
    """A README figure and the snapshot cases read to compute it (every read since the previous claim)."""
    cases = tuple(_READ)
    _READ.clear()
    return Claim(text, cases)


CLAIMS: list[Claim] = []


def say(text: str) -> None:
    """The README quotes `text`, computed from the cases read since the previous figure."""
    CLAIMS.append(claim(text))


@cache
def run(name: str) -> dict:
    return json.loads((ROOT / ".benchmarks" / name).read_text())


def snapshot(name: str) -> list[dict]:
    """Every case of a snapshot, all counted as read by the claim being made."""
    _READ.extend((name, b) for b in run(name)["benchmarks"])
    return run(name)["benchmarks"]


def read(name: str, bench: dict) -> dict:
    _READ.append((name, bench))
    return bench


def kernel(name: str, **match) -> tuple[float, float, dict]:
    """(per-call us, device us, extra_info) of the one case of a kernel snapshot matching every key."""
    found = [b for b in run(name)["benchmarks"] if all(b["extra_info"].get(k) == v for k, v in match.items())]
    assert len(found) == 1, f"{name}: {len(found)} cases match {match}"
    per_call, device, _ = case_times(read(name, found[0]))
    return per_call, device, found[0]["extra_info"]


def named(name: str, test_name: str) -> dict:
    found = [b for b in run(name)["benchmarks"] if b["name"] == test_name]
    assert len(found) == 1, f"{name}: no case {test_name}"
    return read(name, found[0])


def norm(op, backend, shape, dtype="fp16", direction="fwd"):
    return kernel("h200/kernels_norms.json", op=op, backend=backend, shape=shape, dtype=dtype, dir=direction)


def attention(backend, shape, mask, dtype="fp16", direction="fwd"):
    test = (f"test_attention_perf[op=flash_attention,backend={backend},shape={shape},mask={mask},dtype={dtype},"
            f"dir={direction}]")
    b = named("h200/attention.json", test)
    per_call, device, _ = case_times(b)
    return per_call, device, b["extra_info"]


NORM_PEERS = ("torch", "torch_compile", "liger")
OURS = ("triton", "tilelang")


def fastest(cases: dict) -> tuple[str, float, float, dict]:
    """(backend, device us, per-call us, extra_info) of the fastest by device time of {backend: case}."""
    backend = min(cases, key=lambda name: cases[name][0])
    return (backend, *cases[backend])


def norm_cases(op, shape, dtype, direction, backends) -> dict:
    out = {}
    for backend in backends:
        found = [b for b in run("h200/kernels_norms.json")["benchmarks"]
                 if b["extra_info"].get("op") == op and b["extra_info"].get("backend") == backend
                 and b["extra_info"].get("shape") == shape and b["extra_info"].get("dtype") == dtype
                 and b["extra_info"].get("dir") == direction]
        if found:
            per_call, device, _ = case_times(read("h200/kernels_norms.json", found[0]))
            out[backend] = (device, per_call, found[0]["extra_info"])
    return out


def norm_row(label, op, shape, dtype="fp16", direction="fwd") -> None:
    """Ours (the faster of Triton and TileLang by device time) against torch eager and the best peer."""
    ours, d, c, e = fastest(norm_cases(op, shape, dtype, direction, OURS))
    peers = norm_cases(op, shape, dtype, direction, NORM_PEERS)
    torch_d, torch_c, _ = peers["torch"]
    peer, pd, _, _ = fastest(peers)
    say(f"| {label} | {d:.1f} [{c:.1f}] ({ours}, {e['fraction_of_copy_ceiling']:.1%} of copy ceiling) "
        f"| {torch_d:.1f} [{torch_c:.1f}] | {peer} {pd:.1f} | {pd / d:.2f}x |")


def attention_cases(shape, mask, dtype, direction, backends, model_set=False) -> dict:
    out = {}
    for backend in backends:
        test = (f"test_attention_perf[op=flash_attention,{'set=model,' if model_set else ''}backend={backend},"
                f"shape={shape},mask={mask},dtype={dtype},dir={direction}]")
        found = [b for b in run("h200/attention.json")["benchmarks"] if b["name"] == test]
        if found:
            per_call, device, _ = case_times(read("h200/attention.json", found[0]))
            out[backend] = (device, per_call, found[0]["extra_info"])
    return out


SDPA_PEERS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn")


def attention_row(label, shape, mask, dtype="fp16", direction="fwd") -> None:
    """Ours (the faster backend by device time) against the fastest SDPA backend by device time."""
    ours, d, c, e = fastest(attention_cases(shape, mask, dtype, direction, OURS))
    peer, pd, pc, _ = fastest(attention_cases(shape, mask, dtype, direction, SDPA_PEERS))
    say(f"| {label} | {d:.1f} [{c:.1f}] ({ours}, {e['device_tflops']:.0f} TFLOP/s) | {peer} {pd:.1f} [{pc:.1f}] "
        f"| {pd / d:.2f}x |")


def embedding_cases(name: str) -> dict:
    """(shape, dtype, dist, dir) -> backend -> case of an embedding snapshot (read() only where a figure uses it)."""
    by_key: dict = {}
    for b in run(name)["benchmarks"]:
        e = b["extra_info"]
        by_key.setdefault((e["shape"], e["dtype"], e["dist"], e["dir"]), {})[e["backend"]] = b
    return by_key


def embedding_times(name: str, by: dict) -> dict:
    out = {}
    for backend, b in by.items():
        per_call, device, _ = case_times(read(name, b))
        out[backend] = (device, per_call, b["extra_info"])
    return out


def embedding_forward(name: str) -> str:
    """Ours (the fastest by device time) against torch at B65536 V1M D128 bag8 fp16, forward."""
    fwd = embedding_times(name, embedding_cases(name)["B65536xV1MxD128xbag8", "fp16", "uniform", "fwd"])
    ours, d, c, e = fastest({k: v for k, v in fwd.items() if k != "torch"})
    torch_d, torch_c, _ = fwd["torch"]
    return (f"{d:.1f} [{c:.1f}] ({ours}, {e['fraction_of_copy_ceiling']:.1%} of copy ceiling) | "
            f"{torch_d:.1f} [{torch_c:.1f}] | torch | {torch_d / d:.2f}x")


def embedding_fwd_bwd(name: str) -> tuple[int, str]:
    """(cases, "min-max (target ...)") of torch / ours (the fastest by device time) over every fwd+bwd case."""
    ratios = []
    for key, by in embedding_cases(name).items():
        if key[3] == "fwd+bwd":
            both = embedding_times(name, by)
            _, d, _, _ = fastest({k: v for k, v in both.items() if k != "torch"})
            ratios.append(both["torch"][0] / d)
    missed = sum(r < 1.5 for r in ratios)
    return len(ratios), f"{min(ratios):.2f}x-{max(ratios):.2f}x (target 1.5x: missed at {missed})"


def embedding_rows(name: str) -> None:
    say(f"| embedding bag fwd B65536 V1M D128 bag8 fp16 | {embedding_forward(name)} |")
    cases, ratios = embedding_fwd_bwd(name)
    say(f"| embedding bag fwd+bwd, sparse gradient with duplicate rows summed (both sides), {cases} cases "
        f"| | | torch | {ratios} |")


def kernel_claims() -> None:
    norm_row("RMSNorm fwd 65536x1024 fp16", "rms_norm", "65536x1024")
    norm_row("RMSNorm fwd 16384x4096 fp16", "rms_norm", "16384x4096")
    norm_row("RMSNorm fwd 262144x128 fp16", "rms_norm", "262144x128")
    norm_row("LayerNorm fwd 65536x1024 fp16", "layer_norm", "65536x1024")
    norm_row("LayerNorm fwd 262144x128 fp16", "layer_norm", "262144x128")
    norm_row("RMSNorm fwd 8192x128 fp16", "rms_norm", "8192x128")
    norm_row("RMSNorm fwd+bwd 65536x1024 fp16", "rms_norm", "65536x1024", direction="fwd+bwd")
    norm_row("LayerNorm fwd+bwd 65536x1024 bf16", "layer_norm", "65536x1024", "bf16", "fwd+bwd")
    embedding_rows("h200/kernels_embedding.json")
    attention_row("flash attention fwd B64 H8 S256 D64 + key lengths", "B64xH8xS256xD64", "key_lengths")
    attention_row("flash attention fwd B16 H8 S1024 D64", "B16xH8xS1024xD64", "none")
    attention_row("flash attention fwd B4 H16 S4096 D128 bf16", "B4xH16xS4096xD128", "none", "bf16")
    attention_row("flash attention fwd+bwd B16 H8 S1024 D64 bf16", "B16xH8xS1024xD64", "none", "bf16", "fwd+bwd")
    attention_row("flash attention fwd+bwd B4 H16 S4096 D128 bf16", "B4xH16xS4096xD128", "none", "bf16", "fwd+bwd")
    attention_row("flash attention fwd PCVR B8 H8 S128 D64 + key lengths", "B8xH8xS128xD64", "key_lengths")
    attention_row("flash attention fwd+bwd PCVR B8 H8 S128 D64 + key lengths", "B8xH8xS128xD64", "key_lengths",
                  direction="fwd+bwd")


FRONTIER_NORMS = "h200/frontier_norms.json"
FRONTIER_ATTENTION = "h200/frontier_attention.json"


def frontier_norm_row(label, op, shape, dtype="fp16", direction="fwd") -> None:
    """Our Triton norm against quack and torch eager, device time, one run (frontier_norms_models.json)."""
    device = {backend: kernel(FRONTIER_NORMS, op=op, backend=backend, shape=shape, dtype=dtype, dir=direction)[1]
              for backend in ("triton", "quack", "torch")}
    say(f"| {label} | {device['triton']:.1f} | {device['quack']:.1f} | {device['torch']:.1f} "
        f"| {device['quack'] / device['triton']:.2f}x |")


def frontier_attention_row(label, snapshot, shape, dtype, direction, target) -> None:
    """Our Triton attention against cuDNN (SDPA) and FlashAttention 4, device time, one run: the better peer
    over ours, against the target the row names."""
    def device(backend):
        return kernel(snapshot, op="flash_attention", backend=backend, shape=shape, dtype=dtype, dir=direction)

    _, ours, extra = device("triton")
    cudnn, fa4 = device("sdpa_cudnn")[1], device("fa4")[1]
    ratio = min(cudnn, fa4) / ours
    say(f"| {label} | {ours:.1f} ({extra['device_tflops']:.0f} TFLOP/s) | {cudnn:.1f} | {fa4:.1f} | {ratio:.2f}x "
        f"| >= {target:.2f}x: {'met' if ratio >= target else 'missed'} |")


def frontier_claims() -> None:
    frontier_norm_row("RMSNorm fwd 65536x1024 fp16", "rms_norm", "65536x1024")
    frontier_norm_row("RMSNorm fwd 16384x4096 fp16", "rms_norm", "16384x4096")
    frontier_norm_row("RMSNorm fwd 262144x128 fp16", "rms_norm", "262144x128")
    frontier_norm_row("LayerNorm fwd 65536x1024 fp16", "layer_norm", "65536x1024")
    frontier_norm_row("LayerNorm fwd 16384x4096 fp16", "layer_norm", "16384x4096")
    frontier_norm_row("LayerNorm fwd 262144x128 fp16", "layer_norm", "262144x128")
    frontier_norm_row("RMSNorm fwd+bwd 65536x1024 fp16", "rms_norm", "65536x1024", direction="fwd+bwd")
    frontier_norm_row("RMSNorm fwd+bwd 16384x4096 fp16", "rms_norm", "16384x4096", direction="fwd+bwd")
    frontier_norm_row("LayerNorm fwd+bwd 65536x1024 fp16", "layer_norm", "65536x1024", direction="fwd+bwd")
    frontier_norm_row("LayerNorm fwd+bwd 16384x4096 fp16", "layer_norm", "16384x4096", direction="fwd+bwd")
    for dtype in ("bf16", "fp16"):
        for direction, target in (("fwd", 1.05), ("fwd+bwd", 1.0)):
            for shape, label in (("B16xH8xS1024xD64", "B16 H8 S1024 D64"), ("B4xH16xS4096xD128", "B4 H16 S4096 D128")):
                frontier_attention_row(f"{direction} {label} {dtype}", FRONTIER_ATTENTION, f"{shape},mask=none", dtype,
                                       direction, target)


def optim_claims() -> None:
    def step(name, variant, workload):
        b = named(name, f"test_optimizer_step[optimizer={variant},device=cuda,workload={workload}]")
        return b["stats"]["median"] * 1e6

    main = "h200/optim.json"
    follow = "h200/optim_orthogonal_followup.json"
    current = "h200/optim_current.json"  # stats hold device time; per-call in extra_info

    def now(variant):
        b = named(current, f"test_optimizer_step[optimizer={variant},device=cuda,workload=pcvr_dense]")
        return b["stats"]["median"] * 1e6, b["extra_info"]["per_call_us"]

    (f_dev, f_call), (m_dev, m_call), (o_dev, o_call) = now("fused_adamw"), now("muon"), now("orthogonal_adamw")
    tensors = named(current, "test_optimizer_step[optimizer=fused_adamw,device=cuda,workload=pcvr_dense]")[
        "extra_info"]["tensors"]
    say(
        f"| PCVR dense shapes, current {tensors}-tensor workload (`optim_current.json`): device time [per call] "
        f"| {f_dev:.1f} us [{f_call:.1f}] | {m_dev:.1f} us = {m_dev / f_dev:.2f}x [{m_call:.1f}] "
        f"| {o_dev:.1f} us = {o_dev / f_dev:.2f}x [{o_call:.1f}] |")
    fused_mlp, muon, ortho = (step(main, v, "mlp") for v in ("fused_adamw", "muon", "orthogonal_adamw"))
    say(
        f"| reference MLP | {fused_mlp:.1f} us | {muon:.1f} us = {muon / fused_mlp:.2f}x (target <= 3x) "
        f"| {ortho:.1f} us = {ortho / fused_mlp:.2f}x (target <= 2x, missed; bf16 variant "
        f"{step(follow, 'orthogonal_adamw_bf16', 'mlp'):.1f} us) |")
    fused_dense, muon_d, ortho_d = (step(main, v, "pcvr_dense") for v in ("fused_adamw", "muon", "orthogonal_adamw"))
    ortho_follow = step(follow, "orthogonal_adamw", "pcvr_dense")
    say(
        f"| {fused_dense:.1f} us | {muon_d:.1f} us = {muon_d / fused_dense:.2f}x | {ortho_d:.1f} us = "
        f"{ortho_d / fused_dense:.2f}x; {ortho_follow:.1f} us = {ortho_follow / fused_dense:.2f}x in the follow-up run")


def data_claims() -> None:
    name = "cpu/make-bench-2core.json"

    def micro():
        return [named(name, f"test_converter_micro[strict={s}]")["extra_info"] for s in (0, 1)]

    def loader(preset):
        return named(name, f"test_data_pipeline[preset={preset},mode=loader]")["extra_info"]

    strict0, strict1 = micro()
    say(f"{strict0['rows_per_sec']:,.0f} / {strict1['rows_per_sec']:,.0f} rows/s "
        f"({strict0['rows_per_sec'] / 6400:.1f}x / {strict1['rows_per_sec'] / 6400:.1f}x "
        "the reference's 6,400)")
    converts = [read(name, b)["extra_info"]["ratio_to_copy_floor"] for b in run(name)["benchmarks"]
                if "ratio_to_copy_floor" in b["extra_info"]]
    say(f"| {min(converts):.2f}-{max(converts):.2f} |")
    say(f"| {loader('none')['ratio_to_pyarrow_read']:.2f} (opt {loader('opt')['ratio_to_pyarrow_read']:.2f}, "
        f"cache {loader('cache')['ratio_to_pyarrow_read']:.2f}, "
        f"augment {loader('augment')['ratio_to_pyarrow_read']:.2f})")
    say(f"{loader('opt')['cache_hit_rate']:.1%} = Belady's optimum on the trace")
    say(f"LRU {loader('opt')['hit_rates_same_trace']['lru']:.1%}")
    say(f"One converted 256-row batch is {micro()[0]['bytes_per_batch'] / 1e6:.1f} MB")


def attention_model_claims() -> None:
    """The table at the models' attention shapes (attention.json's set=model cases): per shape and direction,
    the best peer (SDPA or flex) and the best of ours by device time, their ratio, the per-call ratio, met at
    1.5x."""
    name = "h200/attention.json"
    before = len(CLAIMS)
    cases = {}
    for b in run(name)["benchmarks"]:
        if "set=model" not in b["name"]:
            continue
        e = b["extra_info"]
        cases.setdefault((e["shape"], e["dir"]), {})[e["backend"]] = (e["device_us"], e["per_call_us"], b)
    for (shape, direction), by in cases.items():
        for *_, b in by.values():
            read(name, b)
        peers = {k: v for k, v in by.items() if k.startswith("sdpa") or k == "flex"}
        ours = {k: v for k, v in by.items() if k in ("triton", "tilelang")}
        peer = min(peers, key=lambda k: peers[k][0])
        best = min(ours, key=lambda k: ours[k][0])
        ratio = peers[peer][0] / ours[best][0]
        per_call = min(v[1] for v in peers.values()) / min(v[1] for v in ours.values())
        say(f"| {shape.split(',')[0]} {direction} | {peers[peer][0]:.1f} ({peer}) | {ours[best][0]:.1f} ({best}) "
            f"| {ratio:.2f}x | {per_call:.2f}x | {'met' if ratio >= 1.5 else 'missed'} |")
    assert len(CLAIMS) - before == 8, "four shapes, fwd and fwd+bwd"


MODEL_COLUMNS = tuple((backend, mode) for backend in ("torch", "triton")
                      for mode in ("eager", "compile", "graph", "captured"))


def model_cases(snap: str) -> dict:
    """(model, phase, backend, mode) -> case of a model snapshot (read() only where a figure uses it)."""
    times = {}
    for b in run(snap)["benchmarks"]:
        fields = dict(part.split("=") for part in b["name"][b["name"].index("[") + 1:-1].split(","))
        if fields.get("precision", "fp32") == "fp32":  # the table is fp32's (fp32 ids name no precision)
            times[fields["model"], fields["phase"], fields["backend"], fields["mode"]] = b
    return times


def model_claims() -> None:
    """The model table (models.json: per call and device ms per backend x mode, the faster of ours per call
    against eager torch and against torch.compile of torch, the faster of its modes compile and graph) and
    the smoke's worst paired AUC difference (smoke_s6/compare_*.json, every verdict `same`)."""
    snap = "h200/models.json"
    times = model_cases(snap)
    for model in ("baseline", "interformer", "tokenformer", "onetrans", "symbiosis", "queryformer", "dualq"):
        for phase in ("train_step", "infer"):
            cells, measured = [], {}
            for backend, mode in MODEL_COLUMNS:
                b = times.get((model, phase, backend, mode))
                if b is None:
                    case = (f"perf_tests/test_models.py::test_model[model={model},backend={backend},mode={mode},"
                            f"phase={phase}]")
                    cells.append("check failed" if case in run(snap).get("failed", {}) else "not run")
                    continue
                read(snap, b)
                measured[backend, mode] = (b["extra_info"]["per_call_us"] / 1e3, b["extra_info"]["device_us"] / 1e3)
                cells.append(f"{measured[backend, mode][0]:.1f} [{measured[backend, mode][1]:.1f}]")
            ours = min(v[0] for k, v in measured.items() if k[0] != "torch")
            compiled = [measured[k][0] for k in (("torch", "compile"), ("torch", "graph")) if k in measured]
            peers = [measured[("torch", "eager")][0] if ("torch", "eager") in measured else None,
                     min(compiled) if compiled else None]  # torch.compile: the faster of its two modes
            ratios = [f"{peer / ours:.2f}x" if peer else "-" for peer in peers]
            say(f"| {model} | {phase} | {' | '.join(cells)} | {' | '.join(ratios)} |")
    compares = [json.loads((ROOT / ".benchmarks/h200/smoke_s6" / f"compare_{b}.json").read_text())["models"]
                for b in ("triton", "tilelang")]
    verdicts = [v for c in compares for v in c.values()]
    assert len(verdicts) == 14 and all(v["verdict"] == "same" for v in verdicts), "the README says: all seven, both"
    worst = max(verdicts, key=lambda v: v["max_abs_auc_diff"])
    say(f"largest paired difference {worst['max_abs_auc_diff']:.4f} against that\n"
        f"model's seed SD {worst['seed_noise']:.4f}")


for figures in (kernel_claims, frontier_claims, optim_claims, data_claims, attention_model_claims, model_claims):
    figures()
ALL_CLAIMS = tuple(CLAIMS)


def recorded_files(name: str) -> dict:
    return run(name).get("source_files") or {}


def figure_lines(text: str, readme: str) -> str:
    """The whole README lines that hold `text`."""
    at = readme.index(text)
    end = readme.find("\n", at + len(text))
    return readme[readme.rfind("\n", 0, at) + 1:end if end >= 0 else len(readme)]


def section_of(text: str, readme: str) -> str:
    """The README section (from one heading to the next) that holds `text`."""
    at = readme.index(text)
    starts = [m.start() for m in re.finditer(r"(?m)^#{1,6} ", readme)]
    start = max((x for x in starts if x <= at), default=0)
    end = min((x for x in starts if x > at), default=len(readme))
    return readme[start:end]


def freshness_problems(figure: Claim, readme: str, source_files=recorded_files) -> list[str]:
    """Why the README may not quote `figure` as it stands: a case it comes from ran code that has changed
    since (stale) and the figure's line does not say "stale since <digest>", or its snapshot predates source
    digests (unknown) and the figure's section does not say so."""
    problems = []
    for name, bench in figure.cases:
        state = sources.case_state(bench.get("extra_info") or {}, source_files(name))
        if state["state"] == sources.STALE and f"stale since {state['recorded']}" not in figure_lines(figure.text,
                                                                                                     readme):
            problems.append(f"{name} {bench['name']}: its sources changed since the snapshot "
                            f"({', '.join(state['changed']) or state['subject']}): re-measure it, or write "
                            f"\"stale since {state['recorded']}\" beside the figure")
        if state["state"] == sources.UNKNOWN:
            section = section_of(figure.text, readme)
            if not UNKNOWN_NOTE.search(section) or f"`{Path(name).name}`" not in section:
                problems.append(f"{name} {bench['name']}: recorded before source digests; the README section "
                                f"that quotes it must say that `{Path(name).name}` predates source digests")
    return problems


NOT_FROM_A_SNAPSHOT = ("largest paired difference",)  # figures computed from other files (the smoke comparisons)


@pytest.mark.parametrize("figure", ALL_CLAIMS, ids=lambda c: c.text[:60])
def test_readme_figure_names_the_cases_it_comes_from(figure):
    """A figure computed from a snapshot must have read its cases, or its freshness goes unchecked (a figure
    whose cases were all taken by the previous claim passes every freshness test)."""
    assert figure.cases or figure.text.startswith(NOT_FROM_A_SNAPSHOT), f"no snapshot case behind: {figure.text}"


@pytest.mark.parametrize("figure", ALL_CLAIMS, ids=lambda c: c.text[:60])
def test_readme_figure_matches_the_snapshot(figure):
    assert figure.text in README, f"README.md does not say (from the committed snapshot):\n{figure.text}"


@pytest.mark.parametrize("figure", ALL_CLAIMS, ids=lambda c: c.text[:60])
def test_readme_figure_describes_this_trees_code(figure):
    problems = freshness_problems(figure, README)
    assert not problems, "\n".join(sorted(set(problems)))


# ---------------------------------------------------------------- the freshness rule itself


def made_up(extra_info: dict, text: str = "| RMSNorm fwd | 1.0 us |") -> Claim:
    return Claim(text, (("h200/made_up.json", {"name": "test_norm[made-up]", "extra_info": extra_info}),))


def no_files(_name: str) -> dict:
    return {}


def test_a_figure_from_a_fresh_case_passes():
    figure = made_up(sources.stamp("kernel:rms_norm:triton"))
    assert freshness_problems(figure, f"### Kernels\n{figure.text}\n", no_files) == []


def test_a_figure_from_a_stale_case_needs_stale_since_its_digest_beside_it():
    figure = made_up({"sources": "kernel:rms_norm:triton", "sources_digest": "not-this-tree"})
    readme = f"### Kernels\n{figure.text}\n"
    assert "stale since not-this-tree" in freshness_problems(figure, readme, no_files)[0]
    assert freshness_problems(figure, readme.replace(" |\n", " | stale since not-this-tree |\n"), no_files) == []
    elsewhere = readme + "\nstale since not-this-tree\n"  # not on the figure's line
    assert freshness_problems(figure, elsewhere, no_files)


def test_a_figure_from_a_snapshot_without_digests_needs_the_sections_note():
    figure = made_up({"op": "rms_norm"})
    readme = f"### Kernels\n{figure.text}\n### Other\n`made_up.json` predates source digests\n"
    assert freshness_problems(figure, readme, no_files)  # the note is in another section
    assert freshness_problems(figure, f"### Kernels\n{figure.text}\nmade_up.json predates source digests\n", no_files)
    noted = f"### Kernels\n{figure.text}\nThese figures (`made_up.json`) predate source digests.\n"
    assert freshness_problems(figure, noted, no_files) == []

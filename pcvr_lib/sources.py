"""What each benchmark case runs of this repository, and a digest of those files: a snapshot says which code
it measured, and `pcvr report` says which of its cases ran code that has changed since (`stale`).

A case names its *subject* in `extra_info["sources"]` (the perf tests record it with `stamp`):

    kernel:<op>:<backend>   one of our backends of a kernel op (torch, triton, tilelang, cuembed)
    peer:<name>             a third-party implementation (Liger, SDPA, flex_attention, torch.compile): no file of
                            ours; its version is in the run's machine_info.libraries
    model:<name>:<backend>  a model's train step or inference with its operator switches on <backend>
    optim                   the optimizers (pcvr_lib.optim: the registry, every optimizer, the step)
    data:convert            the converter alone
    data:loader             the loader (reading, planning, caching, converting)

The files of a subject are derived, not listed by hand. Its roots: a kernel op's package (the OPS table of
pcvr_lib.workloads) with `__init__.py` and the module `<backend>_impl.py` that pcvr_lib.kernels.dispatch loads
for that backend; a model's module and pcvr_lib/models/step.py, plus the `<backend>_impl.py` of every op
package those reach (dispatch loads them at run time, no import statement names them); the packages' entry
modules of optim and data. Then every pcvr_lib module that a file imports, transitively (read from the source
with `ast`, nothing is imported: a package's `__init__` counts only where an import names the package
itself), and each non-Python file beside a module whose source names it (cuembed.cu, convert_native.c).

`digest(subject)`: sha256 over the (path, sha256 of the content) pairs of its files, 12 hex digits, computed
once per process; a run records it per case in `extra_info["sources_digest"]` and the digest of every file
it used in the JSON's top-level `source_files`, so a later tree can say which files changed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

from pcvr_lib.workloads import OPS

ROOT = Path(__file__).resolve().parents[1]  # the checkout: paths are relative to it
PACKAGE = "pcvr_lib"
DIGEST_CHARS = 12
SUBJECT_KINDS = ("kernel", "peer", "model", "optim", "data")
DATA_ROOTS = {"convert": "pcvr_lib/data/convert.py", "loader": "pcvr_lib/data/loader.py"}
OPTIM_ROOT = "pcvr_lib/optim/__init__.py"
MODEL_STEP = "pcvr_lib/models/step.py"
# what `pcvr report` says of a case
FRESH, STALE, UNKNOWN, THIRD_PARTY = "fresh", "stale", "unknown", "third-party"


class SourcesError(ValueError):
    """A subject that names no code of this tree (an unknown op, backend or model)."""


def _module_file(module: str) -> str | None:
    """The file of a pcvr_lib module (`a/b.py` or the package's `a/b/__init__.py`), None when there is none."""
    if module != PACKAGE and not module.startswith(PACKAGE + "."):
        return None
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if (ROOT / candidate).is_file():
            return candidate
    return None


def _module_name(path: str) -> str:
    name = path[:-3].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


@functools.cache
def _direct_files(path: str) -> tuple[str, ...]:
    """The pcvr_lib modules `path` imports (any depth: function-level imports are imports) and the files
    beside it that its source names."""
    text = (ROOT / path).read_text()
    module = _module_name(path)
    package = module if path.endswith("/__init__.py") else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(text, filename=path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from a import b`: the module a.b when there is one, else a itself (b is a name defined in a)
            names = [f"{base}.{alias.name}" if _module_file(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        found.update(file for file in map(_module_file, names) if file)
    folder = (ROOT / path).parent
    for sibling in folder.iterdir():
        if sibling.is_file() and sibling.suffix not in (".py", ".pyc") and sibling.name in text:
            found.add(sibling.relative_to(ROOT).as_posix())
    found.discard(path)
    return tuple(sorted(found))


def _closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.endswith(".py"):
            todo.extend(_direct_files(path))
    return seen


def _op_package(op: str) -> str:
    if op not in OPS:
        raise SourcesError(f"unknown kernel op {op!r}; known: {', '.join(OPS)}")
    return OPS[op].package


def _backend_module(package: str, backend: str) -> str | None:
    """`<package>/<backend>_impl.py` when the backend has a module of its own (a torch backend may live in
    the package's `__init__`)."""
    path = f"{package}/{backend}_impl.py"
    return path if (ROOT / path).is_file() else None


def _kernel_roots(op: str, backend: str) -> list[str]:
    package = _op_package(op)
    impl = _backend_module(package, backend)
    if impl is None and backend != "torch":
        raise SourcesError(f"{op}: no backend {backend!r} in {package}/ (no {backend}_impl.py)")
    return [f"{package}/__init__.py", *([impl] if impl else [])]


def _model_files(name: str, backend: str) -> set[str]:
    model = f"pcvr_lib/models/{name}.py"
    if not (ROOT / model).is_file():
        raise SourcesError(f"unknown model {name!r} (no {model})")
    files = _closure([model, MODEL_STEP])
    packages = {entry.package for entry in OPS.values() if f"{entry.package}/__init__.py" in files}
    impls = [impl for impl in (_backend_module(p, backend) for p in sorted(packages)) if impl]
    return files | _closure(impls)


@functools.cache
def files(subject: str) -> tuple[str, ...]:
    """The repository-relative files a subject runs (empty for a third-party peer)."""
    kind, *parts = subject.split(":")
    if kind == "peer" and len(parts) == 1:
        return ()
    if kind == "kernel" and len(parts) == 2:
        return tuple(sorted(_closure(_kernel_roots(*parts))))
    if kind == "model" and len(parts) == 2:
        return tuple(sorted(_model_files(*parts)))
    if kind == "optim" and not parts:
        return tuple(sorted(_closure([OPTIM_ROOT])))
    if kind == "data" and len(parts) == 1 and parts[0] in DATA_ROOTS:
        return tuple(sorted(_closure([DATA_ROOTS[parts[0]]])))
    raise SourcesError(f"not a sources subject: {subject!r} (kernel:<op>:<backend>, peer:<name>, "
                       f"model:<name>:<backend>, optim, data:{'|data:'.join(DATA_ROOTS)})")


@functools.cache
def file_digest(path: str) -> str:
    """sha256 of one file's content (12 hex digits); "missing" when the file is gone."""
    full = ROOT / path
    return hashlib.sha256(full.read_bytes()).hexdigest()[:DIGEST_CHARS] if full.is_file() else "missing"


def digest_of_files(paths) -> str:
    """One digest of a set of files: sha256 over their sorted (path, content digest) pairs."""
    pairs = "\n".join(f"{path} {file_digest(path)}" for path in sorted(paths))
    return hashlib.sha256(pairs.encode()).hexdigest()[:DIGEST_CHARS]


@functools.cache
def digest(subject: str) -> str:
    """The digest of a subject's files in this working tree."""
    return digest_of_files(files(subject))


def kernel_subject(op: str, backend: str, ours: bool) -> str:
    """The subject of a kernel case: `kernel:<op>:<backend>` for one of our backends, `peer:<backend>` for a
    third-party one (`ours`: whether `backend` is the library's own, pcvr_lib.kernels.dispatch)."""
    return f"kernel:{op.split('[')[0]}:{backend}" if ours else f"peer:{backend}"


def stamp(subject: str) -> dict:
    """The extra_info entries that record what a case runs: its subject and the digest of its files (none
    for a peer: no file of ours)."""
    if subject.startswith("peer:"):
        return {"sources": subject}
    return {"sources": subject, "sources_digest": digest(subject)}


def run_file_digests(subjects) -> dict[str, str]:
    """Path -> content digest of every file of these subjects (a run's top-level `source_files`)."""
    paths = sorted({path for subject in subjects for path in files(subject)})
    return {path: file_digest(path) for path in paths}


def case_state(extra_info: dict, recorded_files: dict | None = None) -> dict:
    """Whether the code a stored case ran is still this tree's: {"state": fresh | stale | unknown |
    third-party, "subject", "recorded" (its stored digest), "current", "changed" (files whose digest
    differs from the run's `source_files`, when the run recorded them)}."""
    subject, recorded = extra_info.get("sources"), extra_info.get("sources_digest")
    out = {"state": UNKNOWN, "subject": subject, "recorded": recorded, "current": None, "changed": []}
    if subject and subject.startswith("peer:"):
        return {**out, "state": THIRD_PARTY}
    if not subject or not recorded:
        return out  # recorded before source digests, or by a case that names no subject
    try:
        now = files(subject)
    except SourcesError as exc:
        return {**out, "state": STALE, "changed": [str(exc)]}
    current = digest(subject)
    changed = []
    if current != recorded and recorded_files:
        changed = [path for path in now if recorded_files.get(path) != file_digest(path)]
        if not changed:  # same contents, another set of files (a module no longer imported, say)
            changed = ["the list of files it runs"]
    return {**out, "state": FRESH if current == recorded else STALE, "current": current, "changed": changed}

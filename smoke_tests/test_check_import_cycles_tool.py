"""tools/check_import_cycles.py on tiny packages written to tmp_path: a cycle is reported as a chain of
imports, a deferred (function-level) import counts, and a package without a cycle passes."""

from __future__ import annotations

import pathlib

from smoke_tests.tool_loader import load_tool


def write_package(root: pathlib.Path, name: str, modules: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    for module, source in {"__init__": "", **modules}.items():
        (package / f"{module}.py").write_text(source)


def test_a_cycle_through_a_deferred_import_is_reported_as_a_chain(tmp_path, monkeypatch, capsys):
    write_package(tmp_path, "cyclic_demo", {
        "first": "from cyclic_demo import second\n",
        "second": "import cyclic_demo.third\n",
        # the import that closes the cycle runs only when the function is called
        "third": "def later():\n    from cyclic_demo import first\n    return first\n",
        "leaf": "import cyclic_demo.first\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = load_tool("check_import_cycles")

    edges = tool.import_graph("cyclic_demo")
    assert edges.edges["cyclic_demo.third", "cyclic_demo.first"]["lines"] == [2]
    assert tool.find_cycles(edges) == [["cyclic_demo.first", "cyclic_demo.second", "cyclic_demo.third",
                                        "cyclic_demo.first"]]

    assert tool.main(["cyclic_demo"]) == 1
    out = capsys.readouterr().out
    assert ("cyclic_demo.first (l.1) -> cyclic_demo.second (l.1) -> cyclic_demo.third (l.2) -> cyclic_demo.first"
            in out)
    assert "leaf" not in out


def test_a_cycle_through_a_package_init_is_reported(tmp_path, monkeypatch, capsys):
    write_package(tmp_path, "init_cycle_demo", {"registry": "def names():\n    import init_cycle_demo\n"})
    (tmp_path / "init_cycle_demo" / "__init__.py").write_text("from init_cycle_demo.registry import names\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = load_tool("check_import_cycles")

    assert tool.main(["init_cycle_demo"]) == 1
    assert ("init_cycle_demo (l.1) -> init_cycle_demo.registry (l.2) -> init_cycle_demo"
            in capsys.readouterr().out)


def test_a_package_without_a_cycle_passes(tmp_path, monkeypatch, capsys):
    write_package(tmp_path, "acyclic_demo", {
        "base": "VALUE = 1\n",
        "middle": "from acyclic_demo.base import VALUE\n",
        "top": "import acyclic_demo.middle\n\ndef later():\n    from acyclic_demo import base\n    return base\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    tool = load_tool("check_import_cycles")

    assert tool.find_cycles(tool.import_graph("acyclic_demo")) == []
    assert tool.main(["acyclic_demo"]) == 0
    assert capsys.readouterr().out.strip() == "no import cycles in acyclic_demo (4 modules)"

"""Import cycles between the modules of a package, each printed as a chain of imports.

    python3 tools/check_import_cycles.py [PACKAGE ...]      # default: pcvr_lib

grimp's graph holds every import statement of the package, those inside functions and under
`if TYPE_CHECKING:` too, so a deferred import that hides a cycle at run time is still a cycle here.
The graph is one node per module (a package's own node is its __init__.py), which also catches a
cycle through a package's __init__ (the package imports a child that imports the package back); the
import-linter acyclic_siblings contract compares whole sibling packages instead and cannot see that.

Exit status 1 when there is a cycle, 0 when there is none. The current directory is searched for the
package first, as lint-imports does.
"""

from __future__ import annotations

import os
import sys

import grimp
import networkx as nx


def import_graph(package: str) -> nx.DiGraph:
    """The package's modules and the direct imports between them (importer -> imported)."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = nx.DiGraph()
    edges.add_nodes_from(graph.modules)
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
            edges.add_edge(importer, imported, lines=lines)
    return edges


def find_cycles(edges: nx.DiGraph) -> list[list[str]]:
    """For each group of modules that import each other (a strongly connected component), the shortest
    cycle through each of its modules, as [m0, m1, ..., m0]; a cycle found from two of its modules is
    listed once. Groups and cycles are sorted, so the output is stable."""
    cycles: list[list[str]] = []
    for component in sorted(sorted(c) for c in nx.strongly_connected_components(edges) if len(c) > 1):
        inside = edges.subgraph(component)
        seen: set[frozenset[str]] = set()
        for start in component:
            # the shortest way back to `start` over each of its imports inside the group
            paths = [[start, *nx.shortest_path(inside, nxt, start)] for nxt in sorted(inside.successors(start))]
            cycle = min(paths, key=len)
            key = frozenset(zip(cycle, cycle[1:], strict=False))
            if key not in seen:
                seen.add(key)
                cycles.append(cycle)
    return cycles


def format_cycle(edges: nx.DiGraph, cycle: list[str]) -> str:
    """`a (l.3) -> b (l.12) -> a`: each module with the line(s) of its import of the next one."""
    steps = []
    for importer, imported in zip(cycle, cycle[1:], strict=False):
        lines = ", ".join(f"l.{n}" for n in edges.edges[importer, imported]["lines"])
        steps.append(f"{importer} ({lines})")
    return " -> ".join([*steps, cycle[-1]])


def main(argv: list[str] | None = None) -> int:
    packages = (sys.argv[1:] if argv is None else argv) or ["pcvr_lib"]
    found = 0
    for package in packages:
        edges = import_graph(package)
        cycles = find_cycles(edges)
        if not cycles:
            print(f"no import cycles in {package} ({edges.number_of_nodes()} modules)")
            continue
        found += len(cycles)
        print(f"import cycles in {package}:")
        for cycle in cycles:
            print(f"  {format_cycle(edges, cycle)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())

"""python -m pcvr_lib.workloads: print the table of each op's files (the README's layout section)."""

from pcvr_lib.workloads import markdown_table

print(markdown_table())

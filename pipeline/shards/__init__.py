"""Stage 6, write: training shards (Arrow IPC) of sequences joined with their neighbours.

Its modules, one line each: docs/design.md §2.
"""

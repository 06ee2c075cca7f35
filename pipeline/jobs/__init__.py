"""The jobs: each resolves its inputs, builds its Beam graph, builds its manifest from the data
written and commits it; and what runs them.

Its modules, one line each: docs/design.md §2.
"""

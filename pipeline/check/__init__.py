"""Looking at committed outputs: `validate` (in-process and as a Beam job), `inspect`, `report`.

Its modules, one line each: docs/design.md §2.
"""

"""The build-shards job: training sequences packed, their neighbours retrieved from the committed
index, written as shards, with the manifest it commits.

Its modules, one line each: docs/design.md §2.
"""

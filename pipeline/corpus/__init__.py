"""Stage 1, read: list, split and parse the corpus into `Document`s and `Rejected` records.

`records` (the row types), `parse` (files and byte ranges into records, without Beam), `read`
(`ReadCorpus`, the Beam transform).
"""

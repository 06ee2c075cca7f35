"""Decontamination: training and retrieval documents that are near-duplicates of evaluation
documents (word n-gram Jaccard at or above a threshold, RETRO's 13-grams at 0.8), found by
MinHash signatures and LSH bands.

Its modules, one line each: docs/design.md §2.
"""

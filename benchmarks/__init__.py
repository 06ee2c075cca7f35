"""Benchmarks: scripts run as `.venv/bin/python benchmarks/<name>.py`. A package so that tests can
import shared pieces (e.g. `benchmarks.synthetic.LowRankClusters`) as `benchmarks.*` from the
repository root, as `make test` runs them."""

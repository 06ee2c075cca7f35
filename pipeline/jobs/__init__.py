"""What every job shares: `Job` (staging, the pipeline, the commit step, running), the commit
protocol, the reuse policy, Beam options and runners (worker pools, Flink), the memory model. The
jobs themselves: `pipeline.build_index`, `pipeline.build_shards`, `pipeline.run`.

Its modules, one line each: docs/design.md §2.
"""

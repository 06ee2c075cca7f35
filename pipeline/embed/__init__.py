"""Stage 3, embed: chunks into L2-normalised vectors with a sentence-transformers encoder.

`encoder` (loading, precision, encoding; the only torch import), `precision` (the bfloat16
check against float32), `beam` (`EmbedChunks`, RunInference).
"""

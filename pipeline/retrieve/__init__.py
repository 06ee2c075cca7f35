"""Stage 5, retrieve: each training chunk's nearest chunks outside its sequence's documents.

`sequences` (packing and document spans), `search` (batches, the search with exclusion,
depth tuning, without Beam), `recall` (neighbour recall against exact search), `beam`
(`PackSequences`, `DocumentSpans`, `SpansOfTrainingChunks`, `ReadQueryBlocks`,
`RetrieveNeighbours`).
"""

"""Stage 5, retrieve: each training chunk's nearest chunks outside its sequence's documents.

`sequences` (packing and document spans), `search` (batches, the search with exclusion,
without Beam), `depth` (index files loaded, slices searched in turn, depth tuning, without
Beam), `routed` (the search over slices by lists, without Beam), `recall` (neighbour recall
against exact search), `search_beam` (the search step, `SearchIndex`), `beam`
(`PackSequences`, `DocumentSpans`, `SpansOfTrainingChunks`, `ReadQueryBlocks`,
`RetrieveNeighbours`), `online` (`Retriever`).
"""

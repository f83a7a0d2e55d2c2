"""Operations on a model shared by analyzers: capture, resume, readout, ensemble members,
skipping, patching and scoring subsets of units."""

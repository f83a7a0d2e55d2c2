"""Running analyzers: one fused pass per batch, state that merges, results written as they finish;
a run split between processes (torchrun) or into shards that merge."""

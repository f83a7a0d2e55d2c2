"""Running analyzers: one fused pass per batch, state that merges, results written as they finish."""

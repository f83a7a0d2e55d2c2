"""The bottom layer: errors, streaming state, results, the analyzer contract and the registry.

Nothing here imports another lensdiv layer; every other layer may import from here.
"""

"""Benchmarks: magis and its peers measured side by side (the protocol, the methods, comparisons, plots)."""

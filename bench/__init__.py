"""Benchmarks: run side by side in one run, reported as ratios."""

"""Small models of real architectures with random weights, for tests, benchmarks and the demo.

Nothing here downloads anything; everything is built from configs with a fixed seed.
"""

"""The capacity benchmark (python -m benchmarks.capacity): the largest batch and sequence each
allocator trains under a cap on memory. __main__.py says how to run it."""

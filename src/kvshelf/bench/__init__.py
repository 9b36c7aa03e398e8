"""Benchmarks and the test bed around them: local models, prompts, engine runs."""

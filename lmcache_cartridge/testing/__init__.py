"""Harness, not product: launching real vLLM servers and gateways for the demo, tests and
benchmarks. Nothing in the serving path imports it.
"""

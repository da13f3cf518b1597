"""What llmgw's tests, benchmarks and demo run against: fakes, a local cluster, samples.

Import the modules by name (`llmgw.testing.cluster`, `llmgw.testing.fake_engine`,
...); this package itself exports nothing.
"""

__all__: list[str] = []

"""A local deployment of the three services, for the CLI's demo and trace, the benchmarks and the tests: the
flags that choose its models and workload (``arguments``), its server processes (``processes``) and an
in-process OTLP receiver for its spans (``otlp_receiver``)."""
